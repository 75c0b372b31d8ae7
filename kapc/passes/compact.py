"""compact: the selected-KV view in access order, and the policies that govern running it.

Reads `pages`, `target`, `prompt`. The view lists the selected blocks in ascending logical order
(the order attention reads them); every block before the tail is full and the tail starts on a
block boundary, which is what a paged-attention kernel needs to read a compact block table as one
sequence. Generated tokens continue the tail: the token at logical position p >= prompt length
sits at compact index `tail_slot + (p - tail_block * block_size)`. The table width is padded to
a power of two so that runtimes see few distinct shapes.

Also writes the verification policy (`k`, `accept` greedy or top{N}), the fallback conditions,
and the cost model's prediction for this prompt: with W the weight bytes shared by a batch of
`batch` requests, KV this prompt's full KV bytes, s the retained ratio and h the expected
acceptance, base = (1 + k h)(W/batch + KV) against plan = k (W/batch + s KV) + (W/batch + KV).
"""

from __future__ import annotations

import dataclasses

import msgspec

from kapc import ir
from kapc.errors import excerpt
from kapc.limits import MAX_BATCH, MAX_K
from kapc.passes.base import CompileContext, Pass
from kapc.policy import MAX_TOPN, PolicyError, parse_accept, predicted_speedup


@dataclasses.dataclass(frozen=True)
class Compact(Pass):
    name = "compact"
    requires = ("resolve-pages",)
    k: int = 6
    accept: str = "greedy"
    expect_acceptance: float = 0.8
    batch: int = 1
    dtype_bytes: int = 4
    max_retained: float = 0.5
    min_acceptance: float = 0.3
    acceptance_window: int = 32
    on_predicted_loss: bool = True

    def option_problem(self) -> str | None:
        if not 1 <= self.k <= MAX_K:
            return f"k must be within 1..{MAX_K}, not {self.k}"
        try:
            parse_accept(self.accept)
        except PolicyError:
            return f"accept must be greedy or top2..top{MAX_TOPN}, not {excerpt(self.accept)}"
        for name in ("expect_acceptance", "max_retained", "min_acceptance"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                return f"{name.replace('_', '-')} must be within [0, 1], not {getattr(self, name)}"
        if not 1 <= self.batch <= MAX_BATCH:
            return f"batch must be within 1..{MAX_BATCH}, not {self.batch}"
        if self.dtype_bytes not in (1, 2, 4, 8):
            return f"dtype-bytes must be 1, 2, 4 or 8, not {self.dtype_bytes}"
        if not 1 <= self.acceptance_window <= 1_000_000:
            return f"acceptance-window must be within 1..1000000, not {self.acceptance_window}"
        return None

    def run(self, module: ir.Module, ctx: CompileContext) -> ir.Module:
        pages, target, n = module.pages, module.target, module.prompt.tokens
        width = sum(len(r) for r in pages.selected)
        tail_block = pages.blocks - 1
        view = ir.View(blocks=width, padded_blocks=1 << (width - 1).bit_length(),
                       tail_block=tail_block, tail_slot=(width - 1) * pages.block_size)

        weights = target.parameters * self.dtype_bytes
        kv = n * target.kv_elements_per_token * self.dtype_bytes
        s, h, k = pages.retained, self.expect_acceptance, self.k
        speedup = round(predicted_speedup(weights, kv, self.batch, s, h, k), 4)
        cost = ir.Cost(dtype_bytes=self.dtype_bytes, batch=self.batch, weight_bytes=weights,
                       kv_bytes=kv, s=s, h=h, k=k, speedup=speedup, pays=speedup > 1.0)
        return msgspec.structs.replace(
            module, view=view, verify=ir.Verify(k=k, accept=self.accept),
            fallback=ir.Fallback(max_retained=self.max_retained, min_acceptance=self.min_acceptance,
                                 acceptance_window=self.acceptance_window,
                                 on_predicted_loss=self.on_predicted_loss),
            cost=cost)
