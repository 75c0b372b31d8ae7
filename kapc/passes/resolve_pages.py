"""resolve-pages: the KV pages (blocks of the engine's block size) the proposal reads.

Reads `keep`. A block is selected when any kept token lies in it; the block holding the last
prompt token is always selected, since generated tokens follow it (the tail). Every selected block
is read whole, so the retained ratio `s` (visible prompt tokens / prompt tokens) is what the
proposal really pays for, page rounding included. Writes `pages`.
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np

from kapc import ir
from kapc.limits import MAX_BLOCK_SIZE
from kapc.passes.base import CompileContext, Pass


@dataclasses.dataclass(frozen=True)
class ResolvePages(Pass):
    name = "resolve-pages"
    requires = ("select",)
    block_size: int = 16

    def option_problem(self) -> str | None:
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            return f"block-size must be within 1..{MAX_BLOCK_SIZE}, not {self.block_size}"
        return None

    def run(self, module: ir.Module, ctx: CompileContext) -> ir.Module:
        bs = self.block_size
        n = ir.present(module.prompt, "prompt").tokens
        blocks = -(-n // bs)
        hit = np.zeros(blocks, dtype=bool)
        for k in module.keep:
            if len(k.tokens):
                hit[k.tokens.start // bs : (k.tokens.end - 1) // bs + 1] = True
        hit[-1] = True  # the tail
        selected = _runs(hit)
        visible = int(hit[:-1].sum()) * bs + (n - (blocks - 1) * bs)
        pages = ir.Pages(
            block_size=bs,
            blocks=blocks,
            selected=tuple(selected),
            retained=round(visible / n, 6),
            visible=visible,
        )
        return msgspec.structs.replace(module, pages=pages)


def _runs(mask: np.ndarray) -> list[ir.Range]:
    """Maximal runs of True as block ranges."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return [ir.Range(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]
