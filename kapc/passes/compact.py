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
import re

import msgspec

from kapc import ir
from kapc.passes.base import CompileContext, Pass, PassError


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

    def run(self, module: ir.Module, ctx: CompileContext) -> ir.Module:
        if self.k < 1:
            raise PassError(f"compact: k must be at least 1, not {self.k}")
        if not re.fullmatch(r"greedy|top[2-9]", self.accept):
            raise PassError(f"compact: accept must be greedy or top2..top9, not {self.accept!r}")
        if not 0.0 <= self.expect_acceptance <= 1.0 or self.batch < 1 or self.dtype_bytes < 1:
            raise PassError("compact: expect-acceptance must be within [0, 1], batch and "
                            "dtype-bytes at least 1")
        pages, target, n = module.pages, module.target, module.prompt.tokens
        width = sum(len(r) for r in pages.selected)
        tail_block = pages.blocks - 1
        view = ir.View(blocks=width, padded_blocks=1 << (width - 1).bit_length(),
                       tail_block=tail_block, tail_slot=(width - 1) * pages.block_size)

        weights = target.parameters * self.dtype_bytes
        kv = n * target.kv_elements_per_token * self.dtype_bytes
        shared_w = weights / self.batch
        s, h, k = pages.retained, self.expect_acceptance, self.k
        base = (1 + k * h) * (shared_w + kv)
        plan = k * (shared_w + s * kv) + (shared_w + kv)
        speedup = round(base / plan, 4)
        cost = ir.Cost(dtype_bytes=self.dtype_bytes, batch=self.batch, weight_bytes=weights,
                       kv_bytes=kv, s=s, h=h, k=k, speedup=speedup, pays=speedup > 1.0)
        return msgspec.structs.replace(
            module, view=view, verify=ir.Verify(k=k, accept=self.accept),
            fallback=ir.Fallback(max_retained=self.max_retained, min_acceptance=self.min_acceptance,
                                 acceptance_window=self.acceptance_window,
                                 on_predicted_loss=self.on_predicted_loss),
            cost=cost)
