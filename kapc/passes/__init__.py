"""The pass registry: every pass, by its kebab-case name. One file per pass in this package."""

from __future__ import annotations

from kapc.passes.align_spans import AlignSpans
from kapc.passes.base import CompileContext, Pass, PassError
from kapc.passes.compact import Compact
from kapc.passes.ground import Ground
from kapc.passes.resolve_pages import ResolvePages
from kapc.passes.select import Select

PASSES: dict[str, type[Pass]] = {p.name: p for p in (Ground, AlignSpans, Select, ResolvePages, Compact)}

DEFAULT_PIPELINE = "ground,align-spans,select,resolve-pages,compact"

__all__ = ["PASSES", "DEFAULT_PIPELINE", "CompileContext", "Pass", "PassError"]
