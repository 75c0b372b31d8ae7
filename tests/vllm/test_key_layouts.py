"""Key bounds on every KV cache layout vLLM 0.32 allocates, built on CPU from known keys: vLLM-CPU's
packed blocks (float32 for its "vec" kernels, bfloat16 for its AMX kernel), and the logical [blocks, kv_heads, block_size, 2 * head_dim] view its GPU backends
(FlashAttention, FlashInfer, Triton, FlexAttention) index, under each physical stride order vLLM
defines (`vllm.v1.kv_cache_layout.KVCacheLayout`). Each gives the same bounds and the same page
choice as the keys themselves, the reader is found from one written key before any bound is read,
and a cache that holds keys nowhere kapc knows is refused with the reason."""

from __future__ import annotations

import pytest
import torch

from kapc.runtime import selection
from kapc.runtime.vllm import compat
from tests.runtime.test_kernels import amx_cache

pytest.importorskip("vllm")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

N, KVH, BS, HD = 6, 2, 4, 8  # blocks, KV heads, block size, head_dim


def known_kv():
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, KVH, BS, HD, generator=g), torch.randn(N, KVH, BS, HD, generator=g)


def cpu_packed(keys, values):
    """vLLM-CPU's cache: per block and head, keys head_dim-major, then values, behind the shape
    [blocks, kv_heads, block_size, 2 * head_dim]."""
    packed = torch.stack([keys.transpose(2, 3), values.transpose(2, 3)], dim=2).contiguous()
    return packed.view(N, KVH, BS, 2 * HD)


def logical_view(keys, values, layout: KVCacheLayout):
    """The GPU backends' view: logical [B, H, N, C] (C: key then value), its memory in the
    physical order `layout` gives a layer (`layer_view_order`), as vLLM allocates it."""
    logical = torch.cat([keys, values], dim=-1)
    order = layout.layer_view_order
    physical = logical.permute(*order).contiguous()
    inverse = [order.index(i) for i in range(4)]
    return physical.permute(*inverse)


def layouts():
    keys, values = known_kv()
    out = [("vllm-cpu packed", "vllm-cpu packed", cpu_packed(keys, values))]
    for layout in KVCacheLayout:
        out.append((layout.name, "vLLM's logical view", logical_view(keys, values, layout)))
    return out


@pytest.mark.parametrize("name,reader,kv", layouts(), ids=[x[0] for x in layouts()])
def test_every_layout_gives_the_keys_bounds_and_page_choice(name, reader, kv):
    keys, _ = known_kv()
    slot = 3 * BS + 2
    assert compat.reader_of(kv, slot, keys[3, :, 2]) == reader
    blocks = [0, 2, 3, 5]
    lo, hi = compat.layer_key_bounds([kv, kv], reader, blocks)
    want_lo, want_hi = selection.KeySummaries.of_blocks(
        torch.stack([keys.transpose(0, 1)] * 2), torch.tensor(blocks)
    )
    assert torch.equal(lo, want_lo) and torch.equal(hi, want_hi)
    # the page choice of a query over those bounds: the same blocks as from the keys themselves
    q = torch.randn(1, 2 * KVH, HD, generator=torch.Generator().manual_seed(1))
    valid = torch.ones(1, len(blocks), dtype=torch.bool)
    got = selection.block_scores(q, lo[0][:, None], hi[0][:, None], valid, HD**-0.5)
    want = selection.block_scores(q, want_lo[0][:, None], want_hi[0][:, None], valid, HD**-0.5)
    forced = torch.zeros_like(valid)
    assert torch.equal(
        selection.choose(got, forced, valid, keep=2), selection.choose(want, forced, valid, keep=2)
    )


def test_a_cache_without_the_key_where_any_reader_looks_is_refused():
    keys, values = known_kv()
    kv = cpu_packed(keys, values)
    with pytest.raises(compat.UnsupportedAttention, match="query-aware pages are off"):
        compat.reader_of(kv, 3 * BS + 2, torch.full((KVH, HD), 1234.5))
    # values where keys should be (a kernel that packs values first): no reader matches
    swapped = cpu_packed(values, keys)
    with pytest.raises(compat.UnsupportedAttention, match="tried: vllm-cpu packed"):
        compat.reader_of(swapped, 3 * BS + 2, keys[3, :, 2])


def test_a_cache_of_another_shape_is_refused_with_the_reason():
    class Layer:
        kv_cache = [torch.zeros(2, N, BS, KVH, HD)]  # a list per virtual engine: not read

    with pytest.raises(compat.UnsupportedAttention, match="4-D KV cache"):
        compat._layer_cache(Layer())


@pytest.mark.parametrize("name,reader,kv", layouts(), ids=[x[0] for x in layouts()])
def test_a_block_stamp_is_its_first_and_last_key(name, reader, kv):
    keys, _ = known_kv()
    got = compat.layer_block_stamps(kv, reader, [4, 1])
    assert torch.equal(got, keys[[4, 1]][:, :, [0, BS - 1]].transpose(1, 2))


def test_shared_key_bounds_are_read_once_and_again_when_a_block_holds_other_keys():
    """Requests on one prefix hold the same blocks: their bounds are read once, and held by
    block id. A block the engine has filled with other tokens since (freed and reused) is read
    again; a page choice over the store reads each row's own blocks."""
    from kapc.runtime.vllm.keys import BlockBounds

    keys, values = known_kv()
    layers = [cpu_packed(keys, values), cpu_packed(keys * 2, values)]
    reader = "vllm-cpu packed"
    store = BlockBounds(
        lambda blocks: compat.layer_key_bounds(layers, reader, blocks),
        lambda blocks: compat.layer_block_stamps(layers[-1], reader, blocks),
        blocks=keys.shape[0],
    )

    def held(pool):
        return store.kmin[:, :, pool], store.kmax[:, :, pool]

    for pool in ([0, 2, 3], [0, 2, 5], [0, 2, 3]):
        assert store.read(pool).tolist() == pool
        want = compat.layer_key_bounds(layers, reader, pool)
        got = held(pool)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert store.blocks_read == 4 and store.blocks_reused == 5
    # block 2 now holds other tokens in every layer, as a reused block would
    new = keys.clone()
    new[2] = torch.randn(KVH, BS, HD, generator=torch.Generator().manual_seed(7))
    layers[0].copy_(cpu_packed(new, values))
    layers[1].copy_(cpu_packed(new * 2, values))
    store.read([0, 2])
    want = compat.layer_key_bounds(layers, reader, [0, 2])
    got = held([0, 2])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert store.blocks_read == 5  # block 2 alone read again
    # two rows over the store, of different lengths: each layer's bounds are the row's blocks'
    pools = [torch.tensor([5, 0]), torch.tensor([3, 2, 1])]
    store.read([3, 2, 1])
    summ = selection.KeySummaries.from_store(store.kmin, store.kmax, pools)
    assert summ.valid.tolist() == [[True, True, False], [True, True, True]]
    for layer in range(2):
        lo, hi = summ.layer(layer)  # [kv_heads, rows, blocks, head_dim]
        for row, pool in enumerate(pools):
            want = compat.layer_key_bounds(layers, reader, pool.tolist())
            n = pool.numel()
            assert torch.equal(lo[:, row, :n], want[0][layer])
            assert torch.equal(hi[:, row, :n], want[1][layer])


def test_vllm_cpu_amx_layout_gives_the_keys_bounds_and_stamps():
    # vLLM-CPU's bfloat16 cache for its AMX kernel splits a block's tokens in halves of 16 and a
    # key's dims in pairs; bounds and stamps read through that are the keys' own
    n, kvh, bs, hd = 5, 2, 32, 16
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(n, kvh, bs, hd, generator=g).bfloat16().float()
    kv = amx_cache(keys, torch.randn(n, kvh, bs, hd, generator=g), bs)
    slot = 3 * bs + 21  # in the second half of block 3
    assert compat.reader_of(kv, slot, keys[3, :, 21].bfloat16()) == "vllm-cpu amx"
    blocks = [4, 0, 3]
    lo, hi = compat.layer_key_bounds([kv], "vllm-cpu amx", blocks)
    want = keys[blocks].transpose(0, 1)  # [kvh, blocks, bs, hd]
    assert torch.equal(lo[0].float(), want.amin(dim=2))
    assert torch.equal(hi[0].float(), want.amax(dim=2))
    stamps = compat.layer_block_stamps(kv, "vllm-cpu amx", [4, 1])
    assert torch.equal(stamps.float(), keys[[4, 1]][:, :, [0, bs - 1]].transpose(1, 2))
    assert compat.KEY_READERS["vllm-cpu amx"](kv).shape[0] == n  # the blocks it holds


def test_the_amx_layout_is_the_one_vllm_cpu_writes():
    # vLLM-CPU's own cache write (its "amx" ISA) puts every key and value where the readers and
    # kapc's bfloat16 kernel look
    from vllm import _custom_ops as ops

    if not torch.cpu._is_amx_tile_supported():
        # vLLM-CPU builds that code for AMX machines; elsewhere it may not run at all
        pytest.skip("this CPU has no AMX: vLLM-CPU keeps no cache in its AMX layout here")
    n, kvh, bs, hd = 3, 2, 32, 64
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(n * bs, kvh, hd, generator=g).bfloat16()
    values = torch.randn(n * bs, kvh, hd, generator=g).bfloat16()
    kv = torch.zeros(n, kvh, bs, 2 * hd, dtype=torch.bfloat16)
    k_view, v_view = kv.view(n, kvh, 2 * bs, hd).chunk(2, dim=2)
    try:
        ops.cpu_attn_reshape_and_cache(keys, values, k_view, v_view, torch.arange(n * bs), "amx")
    except RuntimeError as exc:  # a vLLM-CPU build without its AMX kernels
        pytest.skip(f"vLLM-CPU does not write its AMX layout here: {exc}")
    per_block = (
        keys.view(n, bs, kvh, hd).transpose(1, 2),
        values.view(n, bs, kvh, hd).transpose(1, 2),
    )
    assert torch.equal(kv, amx_cache(per_block[0].float(), per_block[1].float(), bs))


@pytest.mark.parametrize(
    "isa,dtype,problem",
    [
        ("vec", torch.float32, None),
        ("amx", torch.bfloat16, None),
        ("vec", torch.bfloat16, "bfloat16 cache for its 'vec' kernel"),
        ("vec16", torch.float32, "float32 cache for its 'vec16' kernel"),
    ],
)
def test_kapc_kernel_stands_in_only_for_the_caches_it_reads(isa, dtype, problem):
    # kapc's kernel reads vLLM-CPU's float32 "vec" and bfloat16 "amx" layouts; any other pair
    # of kernel and dtype keeps vLLM's, with the reason
    from types import SimpleNamespace

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    impl = object.__new__(CPUAttentionBackendImpl)
    impl.kv_cache_dtype, impl.alibi_slopes, impl.sliding_window = "auto", None, -1
    impl.logits_soft_cap, impl.sinks = 0.0, None
    module = SimpleNamespace(impl=impl, isa=isa)
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={"layer.0": module}),
        model_config=SimpleNamespace(dtype=dtype),
    )
    layout = compat.AttentionLayout(layer_names=["layer.0"], block_size=32, builder=None)
    got = compat.attention_kernel_problem(config, layout)
    assert got == problem if problem is None else problem in got
