"""The paged KV cache on its own: allocation, slot mapping, fork with shared blocks, no leaks."""

import pytest
import torch

from kapc.runtime.paged_kv import OutOfBlocks, PagedKVCache


def make(blocks=12, bs=4):
    return PagedKVCache(num_layers=2, kv_heads=2, head_dim=3, block_size=bs, num_blocks=blocks)


def test_slots_and_write_roundtrip():
    c = make()
    c.add("a")
    c.add("b")
    c.ensure("b", 5)
    c.ensure("a", 10)
    table = c.tables["a"]
    assert len(table) == 3 and 0 not in table
    pos = torch.arange(10)
    slots = c.slots("a", pos)
    assert slots.tolist() == [table[p // 4] * 4 + p % 4 for p in range(10)]
    k = torch.randn(10, 2, 3)
    v = torch.randn(10, 2, 3)
    c.write(1, slots, k, v)
    ok, ov = torch.empty(2, 10, 3), torch.empty(2, 10, 3)
    c.gather_slots(1, slots, ok, ov)
    assert torch.equal(ok.transpose(0, 1), k) and torch.equal(ov.transpose(0, 1), v)
    bk, bv = torch.empty(2, 3, 4, 3), torch.empty(2, 3, 4, 3)
    c.gather_blocks(1, torch.tensor(table), bk, bv)
    assert torch.equal(bk.reshape(2, 12, 3)[:, :10].transpose(0, 1), k)


def test_fork_shares_full_blocks_and_copies_partial():
    c = make()
    c.add("a")
    c.ensure("a", 6)
    k = torch.randn(6, 2, 3)
    c.write(0, c.slots("a", torch.arange(6)), k, k)
    free = c.num_free_blocks
    c.fork("a", "b", 6)
    assert c.num_free_blocks == free - 1  # only the partial block is copied
    assert c.tables["b"][0] == c.tables["a"][0] and c.tables["b"][1] != c.tables["a"][1]
    out = torch.empty(2, 6, 3)
    c.gather_slots(0, c.slots("b", torch.arange(6)), out, torch.empty(2, 6, 3))
    assert torch.equal(out.transpose(0, 1), k)
    c.free("a")
    assert c.tables["b"][0] not in c._free  # still referenced by b
    c.free("b")
    c.check_no_leak()


def test_out_of_blocks():
    c = make(blocks=3)
    c.add("a")
    with pytest.raises(OutOfBlocks):
        c.ensure("a", 9)
    c.free("a")
    c.check_no_leak()


def test_tables_are_contiguous_runs_where_the_pool_allows():
    c = make(blocks=16)
    for seq in "abc":
        c.add(seq)
        c.ensure(seq, 8)  # two blocks each: 1-2, 3-4, 5-6
    c.free("b")
    c.ensure("a", 12)  # block 3 is free again: a grows into it
    assert c.tables["a"] == [1, 2, 3] and c.runs("a", 12) == ((4, 12),)
    c.ensure("c", 16)  # 7-8 follow c's last block
    assert c.tables["c"] == [5, 6, 7, 8]
    c.ensure("a", 20)  # 4 is free but 5 is not: the lowest free run of two, 9-10
    assert c.tables["a"] == [1, 2, 3, 9, 10]
    assert c.runs("a", 18) == ((4, 12), (36, 6))
    # runs name exactly the slots of positions [0, n)
    for seq, n in (("a", 18), ("c", 13)):
        flat = [s for a, m in c.runs(seq, n) for s in range(a, a + m)]
        assert flat == c.slots(seq, torch.arange(n)).tolist()
    c.fork("a", "d", 6)  # shares block 1, copies the partial block 2 into the lowest free, 4
    assert c.runs("d", 6) == ((4, 4), (16, 2))
    for seq in "acd":
        c.free(seq)
    c.check_no_leak()
