"""Build `.kapb` plans in memory from a choice of prompt blocks: what tests and benchmarks use to
exercise the executor without the compiler (the compiler's `select`/`resolve-pages`/`compact`
passes are the real source of plans)."""

from __future__ import annotations

import numpy as np

from kapc.lower.kapb import (
    CostPrediction,
    FallbackPolicy,
    Plan,
    PlanHeader,
    decode_plan,
    encode_plan,
    prompt_hash,
)
from kapc.policy import predicted_speedup


def plan_from_blocks(
    model,
    prompt_ids,
    blocks,
    *,
    block_size: int,
    k: int = 6,
    accept: str = "greedy",
    h: float = 0.85,
    batch: int = 1,
    fallback: FallbackPolicy | None = None,
    name: str = "plan",
    pays: bool | None = None,
) -> Plan:
    """A plan whose proposal sees the given logical prompt blocks plus the tail block (the one
    holding the last prompt token), block 0 included only if listed. `model` is a RuntimeModel."""
    ids = np.asarray(prompt_ids, dtype=np.int32).reshape(-1)
    P = int(ids.size)
    tail = (P - 1) // block_size
    sel = sorted({int(b) for b in blocks if 0 <= int(b) < tail} | {tail})
    pos = np.concatenate([np.arange(b * block_size, min(P, (b + 1) * block_size)) for b in sel])
    s = pos.size / P
    kv = model.kv_bytes_per_token() * P
    sp = predicted_speedup(model.weight_bytes, kv, batch, s, h, k)
    header = PlanHeader(
        name=name,
        kapc_version="runtime-test",
        model=model.name,
        model_fingerprint=model.fingerprint,
        tokenizer_fingerprint=model.tokenizer_fingerprint,
        template_fingerprint=model.template_fingerprint,
        block_size=block_size,
        prompt_tokens=P,
        prompt_hash=prompt_hash(ids),
        visible_prompt_tokens=int(pos.size),
        retained_ratio=s,
        padded_blocks=len(sel),
        k=k,
        accept=accept,
        fallback=fallback or FallbackPolicy(),
        cost=CostPrediction(
            weight_bytes=model.weight_bytes,
            kv_bytes=kv,
            batch=batch,
            s=s,
            h=h,
            k=k,
            speedup=sp,
            pays=sp > 1.0 if pays is None else pays,
        ),
    )
    return decode_plan(encode_plan(header, ids, np.asarray(sel, dtype=np.int32), pos))


class PlanTarget:
    """What `plan_from_blocks` needs of a model, from the compiler's `ModelAssets` (no weights
    loaded): for runtimes that run a model elsewhere, such as a vLLM engine."""

    def __init__(self, assets, dtype_bytes: int = 4):
        self.name = assets.name
        self.fingerprint = assets.fingerprint
        self.tokenizer_fingerprint = assets.tokenizer_fingerprint
        self.template_fingerprint = assets.template_fingerprint
        self.weight_bytes = assets.parameter_count() * dtype_bytes
        self._kv = assets.kv_elements_per_token() * dtype_bytes

    def kv_bytes_per_token(self) -> int:
        return self._kv


def spread_blocks(prompt_tokens: int, block_size: int, s: float) -> list[int]:
    """About s of a prompt's full blocks, spread evenly (the tail block is added by the plan):
    a selection with the retained ratio of a real plan, for timing."""
    tail = (prompt_tokens - 1) // block_size
    want = max(0, round(s * prompt_tokens / block_size) - 1)
    if want <= 0 or tail == 0:
        return []
    return sorted({int(b) for b in np.linspace(0, tail - 1, num=min(want, tail))})
