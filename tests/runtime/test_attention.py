"""Attention read in place from the paged pool equals attention over gathered K/V."""

import pytest
import torch
import torch.nn.functional as F

from kapc.runtime.attention import RowContext, in_place


@pytest.mark.parametrize("q_lens", [(1, 1, 1), (4, 1, 6)])
def test_in_place_equals_gathered_attention(q_lens):
    g = torch.Generator().manual_seed(0)
    kvh, groups, hd, slots = 2, 3, 8, 200
    k_pool = torch.randn(kvh, slots, hd, generator=g, dtype=torch.float64)
    v_pool = torch.randn(kvh, slots, hd, generator=g, dtype=torch.float64)
    # row contexts: one run, two runs, three runs (forked prefix, own blocks, a late block)
    layouts = [((10, 37),), ((100, 16), (40, 9)), ((150, 8), (0, 8), (60, 20))]
    q = torch.randn(sum(q_lens), kvh * groups, hd, generator=g, dtype=torch.float64)
    rows, off = [], 0
    for runs, n in zip(layouts, q_lens):
        T = sum(m for _, m in runs)
        rows.append(RowContext(offset=off, c=T - n, q=n, runs=runs))
        off += n
    out = in_place(q, k_pool, v_pool, rows, scale=0.3, groups=groups, masks={})
    for r in rows:
        idx = torch.tensor([s for a, m in r.runs for s in range(a, a + m)])
        K = k_pool[:, idx].repeat_interleave(groups, 0)  # [heads, T, hd]
        V = v_pool[:, idx].repeat_interleave(groups, 0)
        Q = q[r.offset : r.offset + r.q].transpose(0, 1)  # [heads, q, hd]
        T = idx.numel()
        allowed = torch.arange(T)[None, :] <= (r.c + torch.arange(r.q))[:, None]
        want = F.scaled_dot_product_attention(Q, K, V, attn_mask=allowed, scale=0.3)
        got = out[r.offset : r.offset + r.q].view(r.q, kvh * groups, hd).transpose(0, 1)
        assert torch.allclose(got, want, atol=1e-12)
