"""The `.kap` text form: grammar (kap.lark), parser, printer, diagnostics. Knows nothing of passes."""

from kapc.parse.diagnostics import KapError
from kapc.parse.parser import SourceMap, parse_file, parse_file_located, parse_located, parse_module
from kapc.parse.printer import print_module

__all__ = [
    "KapError",
    "SourceMap",
    "parse_file",
    "parse_file_located",
    "parse_located",
    "parse_module",
    "print_module",
]
