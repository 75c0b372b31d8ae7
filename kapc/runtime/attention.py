"""Attention for the reference executor, as small named pieces.

- `in_place`: a few new query tokens per row (decoding, verification) against the row's whole
  context, read where it lies in the paged KV pool: a row's blocks are contiguous runs of the pool
  (the cache allocates them so), and each run is a strided view, so nothing is copied per step.
  Scores are computed run by run and softmaxed together, as split-K attention does.

Chunked prefill (one gather serves 512 query tokens) and a plan's compact selected-KV view
(gathered once per draft cycle: it is s of the context) still gather (`kapc.runtime.executor`).

Query heads are grouped over KV heads (GQA): query head h reads KV head h // groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowContext:
    """One row of an in-place attention call: its `q` query tokens sit at positions c .. c+q-1 of
    the packed queries starting at `offset`, and its context (those included) is the pool slots
    of `runs`, (first slot, length) in logical order, c+q slots in all."""

    offset: int
    c: int
    q: int
    runs: tuple[tuple[int, int], ...]


def causal_tail_mask(q: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    """Additive mask [q, q] for the last q columns: query i sees the new tokens up to itself."""
    if q == 1:
        return None
    upper = torch.ones(q, q, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(q, q, dtype=dtype, device=device).masked_fill_(upper, float("-inf"))


def in_place(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    rows: list[RowContext],
    scale: float,
    groups: int,
    masks: dict[int, torch.Tensor | None],
) -> torch.Tensor:
    """q [N, heads, head_dim] packed by row; k_pool, v_pool [kv_heads, slots, head_dim] (one
    layer, slot-indexed) -> attention output [N, heads * head_dim]. `masks` caches
    `causal_tail_mask` by q."""
    N, nh, hd = q.shape
    kvh = k_pool.shape[0]
    out = q.new_empty(N, nh * hd)
    for r in rows:
        # [q, kvh, g, hd] -> [kvh, g*q, hd]: each KV head's query rows, grouped then by token
        Q = (
            q[r.offset : r.offset + r.q]
            .view(r.q, kvh, groups, hd)
            .permute(1, 2, 0, 3)
            .reshape(kvh, groups * r.q, hd)
        )
        scores = [torch.matmul(Q, k_pool[:, s : s + n].transpose(1, 2)) for s, n in r.runs]
        S = (scores[0] if len(scores) == 1 else torch.cat(scores, dim=-1)).mul_(scale)
        mask = masks.get(r.q)
        if mask is None and r.q not in masks:
            mask = masks[r.q] = causal_tail_mask(r.q, S.dtype, S.device)
        if mask is not None:
            T = S.shape[-1]
            S.view(kvh, groups, r.q, T)[..., T - r.q :].add_(mask)
        P = torch.softmax(S, dim=-1)
        acc, t = None, 0
        for s, n in r.runs:
            part = torch.matmul(P[..., t : t + n], v_pool[:, s : s + n])
            acc = part if acc is None else acc.add_(part)
            t += n
        out[r.offset : r.offset + r.q] = (
            acc.view(kvh, groups, r.q, hd).permute(2, 0, 1, 3).reshape(r.q, nh * hd)
        )
    return out
