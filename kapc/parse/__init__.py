"""The `.kap` text form: grammar (kap.lark), parser, printer, diagnostics. Knows nothing of passes."""

from kapc.parse.diagnostics import KapError
from kapc.parse.parser import parse_file, parse_module
from kapc.parse.printer import print_module

__all__ = ["KapError", "parse_file", "parse_module", "print_module"]
