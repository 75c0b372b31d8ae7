"""Build `.kapb` plans in memory from a choice of prompt blocks: what tests and benchmarks use to
exercise the executor without the compiler (the compiler's `select`/`resolve-pages`/`compact`
passes are the real source of plans)."""

from __future__ import annotations

import numpy as np

from kapc.lower.kapb import (CostPrediction, FallbackPolicy, Plan, PlanHeader, decode_plan,
                             encode_plan, prompt_hash)
from kapc.policy import predicted_speedup


def plan_from_blocks(model, prompt_ids, blocks, *, block_size: int, k: int = 6,
                     accept: str = "greedy", h: float = 0.85, batch: int = 1,
                     fallback: FallbackPolicy | None = None, name: str = "plan",
                     pays: bool | None = None) -> Plan:
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
        name=name, kapc_version="runtime-test", model=model.name,
        model_fingerprint=model.fingerprint, tokenizer_fingerprint=model.tokenizer_fingerprint,
        template_fingerprint=model.template_fingerprint, block_size=block_size, prompt_tokens=P,
        prompt_hash=prompt_hash(ids), visible_prompt_tokens=int(pos.size), retained_ratio=s,
        padded_blocks=len(sel), k=k, accept=accept, fallback=fallback or FallbackPolicy(),
        cost=CostPrediction(weight_bytes=model.weight_bytes, kv_bytes=kv, batch=batch, s=s, h=h,
                            k=k, speedup=sp, pays=sp > 1.0 if pays is None else pays))
    return decode_plan(encode_plan(header, ids, np.asarray(sel, dtype=np.int32), pos))
