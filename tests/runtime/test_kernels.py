"""kapc's paged attention kernel (kapc.runtime.kernels) against attention written out in float64
torch, on vLLM-CPU's cache layout: rows of different lengths and query counts in one batch, a
shuffled block table, partial last blocks, strided queries, key splits and query tiles; and the
refusals that send the hook back to vLLM's kernel."""

from __future__ import annotations

import pytest
import torch

from kapc.runtime import kernels
from kapc.runtime.kernels import KernelUnavailable, paged_attention


def make_cache(rows_tokens, kv_heads, head_dim, block_size, seed=0, shares=None):
    """A vLLM-CPU layer cache [blocks, kv_heads, block_size, 2 * head_dim] holding each row's keys
    and values in shuffled blocks, the block table that finds them, and the plain [tokens,
    kv_heads, head_dim] keys and values of every row. `shares` maps a row to (another row, n):
    its first n blocks are that row's, as a prefix cache shares a common prompt's."""
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in rows_tokens]
    total = sum(per_row) + 3  # spare blocks the table never names
    cache = torch.randn(total, kv_heads, block_size, 2 * head_dim, generator=g)
    order = torch.randperm(total, generator=g)
    table = torch.full((len(rows_tokens), max(per_row) + 2), -1, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(per_row):
        table[r, :nb] = order[used : used + nb].to(torch.int32)
        used += nb
    for r, (source, n) in (shares or {}).items():
        table[r, :n] = table[source, :n]
    plain = []
    for r, (n, nb) in enumerate(zip(rows_tokens, per_row)):
        blocks = table[r, :nb].long()
        # keys are head-dim-major per block ([head_dim, block_size]), values token-major
        keys = cache[blocks, :, :, :].reshape(nb, kv_heads, 2 * block_size * head_dim)
        k = keys[:, :, : block_size * head_dim].reshape(nb, kv_heads, head_dim, block_size)
        v = keys[:, :, block_size * head_dim :].reshape(nb, kv_heads, block_size, head_dim)
        k = k.permute(0, 3, 1, 2).reshape(nb * block_size, kv_heads, head_dim)[:n]
        v = v.permute(0, 2, 1, 3).reshape(nb * block_size, kv_heads, head_dim)[:n]
        plain.append((k, v))
    return cache, table, plain


def reference(query, qsl, seq_lens, plain, heads, kv_heads, scale):
    out = torch.zeros(query.shape, dtype=torch.float64)
    group = heads // kv_heads
    for r, (k, v) in enumerate(plain):
        q0, q1, n = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        for i in range(q1 - q0):
            visible = n - (q1 - q0) + i + 1
            for h in range(heads):
                kk = k[:visible, h // group].double()
                w = torch.softmax(kk @ query[q0 + i, h].double() * scale, dim=0)
                out[q0 + i, h] = w @ v[:visible, h // group].double()
    return out


def run_case(
    rows_tokens,
    queries,
    heads=9,
    kv_heads=3,
    head_dim=64,
    block_size=32,
    seed=0,
    strided=False,
    shares=None,
):
    cache, table, plain = make_cache(rows_tokens, kv_heads, head_dim, block_size, seed, shares)
    qsl = torch.tensor([0] + list(torch.tensor(queries).cumsum(0)), dtype=torch.int32)
    seq_lens = torch.tensor(rows_tokens, dtype=torch.int32)
    tokens = int(qsl[-1])
    g = torch.Generator().manual_seed(seed + 1)
    if strided:  # the query as vLLM's attention layer passes it: a view into the fused qkv output
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
        query = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
        assert not query.is_contiguous()
    else:
        query = torch.randn(tokens, heads, head_dim, generator=g)
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    paged_attention(query, cache, out, qsl, seq_lens, table, scale)
    want = reference(query, qsl, seq_lens, plain, heads, kv_heads, scale)
    return out, want


def test_mixed_rows_match_attention_written_out():
    # decode rows (1 query), verification rows (2..9), a row shorter than a block, partial
    # last blocks, and rows long enough to be split over keys
    out, want = run_case([700, 33, 1030, 5, 32, 400], [1, 5, 9, 2, 1, 3], strided=True)
    assert torch.isfinite(out).all()
    assert (out.double() - want).abs().max().item() < 2e-5


def test_more_query_tokens_than_one_tile_holds():
    # 64 query rows per tile: with 3 heads per KV head a tile holds 21 tokens, so 30 need two
    out, want = run_case([300, 90], [30, 23])
    assert (out.double() - want).abs().max().item() < 2e-5


def test_other_shapes_compile_their_own_kernel():
    out, want = run_case([100, 260], [4, 2], heads=8, kv_heads=2, head_dim=128, block_size=16)
    assert (out.double() - want).abs().max().item() < 2e-5
    out, want = run_case([130], [6], heads=4, kv_heads=4, head_dim=64, block_size=64)  # no GQA
    assert (out.double() - want).abs().max().item() < 2e-5


def test_one_row_per_thread_split_over_keys_agrees_with_unsplit():
    # a single long row is split over its keys across threads; the combined result must equal
    # the written-out attention as closely as many short rows do
    out, want = run_case([4000], [5], seed=3)
    assert (out.double() - want).abs().max().item() < 2e-5


def test_rows_sharing_a_prompts_blocks_match_attention_written_out():
    # the kernel runs items reading the same blocks one after another: rows with one prompt
    # (rows 0, 2 and 4), a row sharing only a prefix (row 3), decode and verification rows, and
    # a row sharing nothing (row 1)
    out, want = run_case(
        [3000, 700, 3000, 2900, 3000],
        [1, 2, 5, 1, 1],
        shares={2: (0, 94), 4: (0, 94), 3: (0, 40)},
        strided=True,
    )
    assert (out.double() - want).abs().max().item() < 2e-5


def test_rows_sharing_a_prefix_split_over_keys_match_attention_written_out():
    # two rows of 125 blocks on two threads are split over keys (at block 93); the second row
    # shares the first's first 100 blocks, so its second split starts on a shared block and
    # runs beside the first row's, though its blocks from 100 on are its own
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, want = run_case([4000, 3990], [1, 5], shares={1: (0, 100)}, seed=5)
    finally:
        torch.set_num_threads(threads)
    assert (out.double() - want).abs().max().item() < 2e-5


def test_inputs_it_cannot_read_are_refused_with_the_reason():
    cache, table, _ = make_cache([64], 3, 64, 32)
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    lens = torch.tensor([64], dtype=torch.int32)
    q = torch.randn(2, 9, 64)
    with pytest.raises(KernelUnavailable, match="float32"):
        paged_attention(q.double(), cache, q.double(), qsl, lens, table, 0.1)
    with pytest.raises(KernelUnavailable, match="int32 block table"):
        paged_attention(q, cache, torch.empty_like(q), qsl, lens, table.long(), 0.1)
    with pytest.raises(KernelUnavailable, match="head dim"):
        paged_attention(torch.randn(2, 9, 32), cache, torch.empty(2, 9, 32), qsl, lens, table, 0.1)
    with pytest.raises(KernelUnavailable, match="one query start per row"):
        paged_attention(q, cache, torch.empty_like(q), qsl[:1], lens, table, 0.1)
    big = torch.randn(2, 130, 64)  # 65 query heads per KV head: more than a tile holds
    wide = torch.randn(4, 2, 32, 128)
    with pytest.raises(KernelUnavailable, match="at most 64 query heads"):
        paged_attention(big, wide, torch.empty_like(big), qsl, lens, table, 0.1)


def test_no_compiler_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("KAPC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "kapc-no-such-compiler")
    kernels._library.cache_clear()
    try:
        with pytest.raises(KernelUnavailable, match="no C\\+\\+ compiler"):
            kernels.load_paged_attention(64, 32)
    finally:
        kernels._library.cache_clear()
    assert not list(tmp_path.glob("kernels/*.so"))


def test_built_once_per_shape_and_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("KAPC_CACHE_DIR", str(tmp_path))
    kernels._library.cache_clear()
    try:
        kernels.load_paged_attention(64, 32)
        built = list(tmp_path.glob("kernels/*.so"))
        assert len(built) == 1 and "hd64-bs32" in built[0].name
        stamp = built[0].stat().st_mtime_ns
        kernels._library.cache_clear()
        kernels.load_paged_attention(64, 32)  # a new process finds it: no second build
        assert [p.stat().st_mtime_ns for p in tmp_path.glob("kernels/*.so")] == [stamp]
        with pytest.raises(KernelUnavailable, match="multiples of 8"):
            kernels.load_paged_attention(60, 32)
    finally:
        kernels._library.cache_clear()


def amx_cache(keys, values, block_size):
    """vLLM-CPU's bfloat16 layer cache for its AMX kernel, from each block's keys and values
    [blocks, kv_heads, block_size, head_dim]: keys in halves of 16 tokens, each pairs of dims;
    values in chunks of 16 dims, each pairs of tokens (paged_attention.cpp)."""
    n, kvh, bs, hd = keys.shape
    k = keys.view(n, kvh, bs // 16, 16, hd // 2, 2).permute(0, 1, 2, 4, 3, 5)
    v = values.view(n, kvh, bs // 2, 2, hd // 16, 16).permute(0, 1, 4, 2, 5, 3)
    packed = torch.cat([k.reshape(n, kvh, -1), v.reshape(n, kvh, -1)], dim=2)
    return packed.to(torch.bfloat16).contiguous().view(n, kvh, bs, 2 * hd)


def needs_amx(head_dim=64, block_size=32):
    try:
        if kernels.has_bfloat16(head_dim, block_size):
            return
    except KernelUnavailable as exc:
        pytest.skip(str(exc))
    pytest.skip("this CPU has no AMX-BF16: kapc's bfloat16 kernel is not built here")


def bf16_rows(rows_tokens, kv_heads=2, head_dim=64, block_size=32, seed=0):
    """Rows' keys and values in shuffled blocks of a bfloat16 cache in the AMX layout: (cache,
    block table, each row's plain keys and values as float32)."""
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in rows_tokens]
    total = sum(per_row) + 2
    keys = torch.randn(total, kv_heads, block_size, head_dim, generator=g).bfloat16().float()
    values = torch.randn(total, kv_heads, block_size, head_dim, generator=g).bfloat16().float()
    order = torch.randperm(total, generator=g).to(torch.int32)
    table = torch.zeros((len(rows_tokens), max(per_row)), dtype=torch.int32)
    plain, used = [], 0
    for r, (n, nb) in enumerate(zip(rows_tokens, per_row)):
        table[r, :nb] = order[used : used + nb]
        used += nb
        blocks = table[r, :nb].long()
        k = keys[blocks].permute(0, 2, 1, 3).reshape(nb * block_size, kv_heads, head_dim)[:n]
        v = values[blocks].permute(0, 2, 1, 3).reshape(nb * block_size, kv_heads, head_dim)[:n]
        plain.append((k, v))
    return amx_cache(keys, values, block_size), table, plain


def starts(queries):
    return torch.tensor([0] + list(torch.tensor(queries).cumsum(0)), dtype=torch.int32)


def test_bfloat16_amx_layout_matches_attention_written_out():
    # decode and verification rows, partial blocks, a row shorter than a tile's 16 tokens, a
    # long row split over keys, and more query rows than one AMX tile holds (5 tokens x 7 heads)
    needs_amx()
    rows, queries, heads = [700, 20, 4000, 33], [1, 5, 5, 9], 14
    cache, table, plain = bf16_rows(rows)
    qsl, lens = starts(queries), torch.tensor(rows, dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    query = torch.randn(int(qsl[-1]), heads, 64, generator=g).bfloat16()
    out = torch.full_like(query, float("nan"))
    paged_attention(query, cache, out, qsl, lens, table, 64**-0.5)
    want = reference(query.float(), qsl, lens, plain, heads, 2, 64**-0.5)
    assert torch.isfinite(out.float()).all()
    # bfloat16 outputs of values about 1 in size, from bfloat16 softmax weights
    assert (out.double() - want).abs().max().item() < 1.5e-2
    assert (out.double() - want).abs().mean().item() < 1.5e-3


def test_bfloat16_tokens_decode_alike_in_any_step():
    # each query token gets the same bits in a verification of five tokens in a batch of three
    # as when decoded alone, seeing only the keys up to it: in bfloat16 a differently rounded
    # verification would change greedy tokens, so no rounding may depend on the step's makeup
    needs_amx()
    rows, heads = [3000, 1500, 4100], 14
    cache, table, _ = bf16_rows(rows, seed=4)
    g = torch.Generator().manual_seed(5)
    five = torch.randn(3 * 5, heads, 64, generator=g).bfloat16()
    out5 = torch.empty_like(five)
    lens = torch.tensor(rows, dtype=torch.int32)
    paged_attention(five, cache, out5, starts([5, 5, 5]), lens, table, 0.125)
    for r, n in enumerate(rows):
        for i in range(5):
            token = five[r * 5 + i : r * 5 + i + 1].contiguous()
            alone = torch.empty_like(token)
            seen = torch.tensor([n - 4 + i], dtype=torch.int32)
            paged_attention(token, cache, alone, starts([1]), seen, table[r : r + 1], 0.125)
            assert torch.equal(alone[0], out5[r * 5 + i]), (r, i)


def test_bfloat16_needs_query_and_output_of_the_caches_dtype():
    cache, table, _ = bf16_rows([64])
    q = torch.randn(1, 14, 64)  # float32 against a bfloat16 cache
    with pytest.raises(KernelUnavailable, match="bfloat16 cache, with query and output"):
        paged_attention(
            q,
            cache,
            torch.empty_like(q),
            starts([1]),
            torch.tensor([64], dtype=torch.int32),
            table,
            0.1,
        )
