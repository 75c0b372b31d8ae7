"""The pass registry: every pass, by its kebab-case name. One file per pass in this package."""

from __future__ import annotations

from kapc.passes.align_spans import AlignSpans
from kapc.passes.base import CompileContext, Pass, PassError
from kapc.passes.compact import Compact
from kapc.passes.ground import Ground
from kapc.passes.resolve_pages import ResolvePages
from kapc.passes.select import Select

PASSES: dict[str, type[Pass]] = {
    p.name: p for p in (Ground, AlignSpans, Select, ResolvePages, Compact)
}

# Evidence-driven selection by default: the 5 best passages, one more per doubling of the
# passages beyond 16, within half the prompt (max_retained). Over 500 HotpotQA questions (graph frontend) that
# keeps gold recall at 0.92 / 0.91 / 0.91 while s falls 0.37 / 0.21 / 0.12 at 2K / 4K / 8K
# (docs/passes.md); a fixed budget ratio would keep s flat as the context grows.
DEFAULT_SELECT_OPTIONS = {"budget-ratio": 0.5, "keep-top": 5, "keep-growth": 1}
DEFAULT_SELECT = "select{" + ",".join(f"{k}={v}" for k, v in DEFAULT_SELECT_OPTIONS.items()) + "}"
DEFAULT_PIPELINE = f"ground,align-spans,{DEFAULT_SELECT},resolve-pages,compact"

__all__ = [
    "PASSES",
    "DEFAULT_PIPELINE",
    "DEFAULT_SELECT_OPTIONS",
    "CompileContext",
    "Pass",
    "PassError",
]
