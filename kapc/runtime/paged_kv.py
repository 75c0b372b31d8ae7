"""A paged KV cache, the way serving engines keep one.

Per layer, K and V each live in one block pool `[kv_heads, num_blocks, block_size, head_dim]`.
A request owns a block table (a list of block ids); logical position p of a request lives at
slot `table[p // block_size] * block_size + p % block_size` of the pool viewed as
`[kv_heads, num_blocks * block_size, head_dim]`. Blocks come from a free list and go back to it
when their reference count drops to zero (a forked request shares its parent's full prompt blocks,
copy-on-fork for the partially filled last one). Block 0 is the null block: it is never handed
out, padded table entries point at it, and nothing valid is ever read from it.

Blocks are handed out as contiguous ascending runs where the pool allows (a table grows into the
block after its last when that one is free), so a request's context is usually one run of slots,
which attention reads in place as a strided view (`runs`, `kapc.runtime.attention`).

The same code runs on CPU and CUDA (everything is a tensor on `device`).
"""

from __future__ import annotations

import bisect

import torch

NULL_BLOCK = 0


class OutOfBlocks(RuntimeError):
    """The pool has no free block left."""


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        if num_blocks < 2:
            raise ValueError("a pool needs at least two blocks (one is the null block)")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.block_size, self.num_blocks = block_size, num_blocks
        self.device, self.dtype = torch.device(device), dtype
        shape = (num_layers, kv_heads, num_blocks, block_size, head_dim)
        self.k = torch.zeros(shape, device=self.device, dtype=dtype)
        self.v = torch.zeros(shape, device=self.device, dtype=dtype)
        self._free: list[int] = list(range(1, num_blocks))  # ascending
        self._ref = [0] * num_blocks
        self.tables: dict[object, list[int]] = {}

    # ---- allocation -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def _take(self) -> int:
        if not self._free:
            raise OutOfBlocks(
                f"KV pool exhausted ({self.capacity_blocks} blocks of "
                f"{self.block_size} tokens); raise kv_blocks or lower the batch"
            )
        b = self._free.pop(0)
        self._ref[b] = 1
        return b

    def _take_run(self, n: int, after: int | None) -> list[int]:
        """n free blocks, contiguous where possible: the n following block `after`, else the
        lowest free run of n, else the n lowest free blocks."""
        free = self._free
        start = None
        if after is not None:
            i = bisect.bisect_left(free, after + 1)
            if i + n <= len(free) and free[i] == after + 1 and free[i + n - 1] == after + n:
                start = i
        if start is None:
            for i in range(len(free) - n + 1):
                if free[i + n - 1] - free[i] == n - 1:
                    start = i
                    break
        if start is None:
            return [self._take() for _ in range(n)]
        run = free[start : start + n]
        del free[start : start + n]
        for b in run:
            self._ref[b] = 1
        return run

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            bisect.insort(self._free, b)
        elif self._ref[b] < 0:
            raise AssertionError(f"block {b} released twice")

    def add(self, seq) -> None:
        if seq in self.tables:
            raise KeyError(f"sequence {seq!r} already has a block table")
        self.tables[seq] = []

    def ensure(self, seq, n_tokens: int) -> list[int]:
        """Make the table of `seq` cover positions [0, n_tokens)."""
        table = self.tables[seq]
        need = self.blocks_for(n_tokens) - len(table)
        if need > len(self._free):
            raise OutOfBlocks(
                f"KV pool exhausted: {need} more blocks needed, {len(self._free)} free"
            )
        if need > 0:
            table.extend(self._take_run(need, table[-1] if table else None))
        return table

    def free(self, seq) -> None:
        for b in self.tables.pop(seq):
            self._release(b)

    def fork(self, src, dst, n_tokens: int) -> None:
        """`dst` starts with the first `n_tokens` of `src`: full blocks are shared (reference
        counted, never written again: decoding writes only past n_tokens), a partially filled last
        block is copied so that `dst` can append into it."""
        table = self.tables[src]
        full = n_tokens // self.block_size
        new = list(table[:full])
        for b in new:
            self._ref[b] += 1
        self.tables[dst] = new
        if n_tokens % self.block_size:
            b = self._take()
            new.append(b)
            s = table[full]
            self.k[:, :, b].copy_(self.k[:, :, s])
            self.v[:, :, b].copy_(self.v[:, :, s])

    # ---- addressing -------------------------------------------------------------------------
    def table_tensor(self, seq) -> torch.Tensor:
        return torch.tensor(self.tables[seq], dtype=torch.long, device=self.device)

    def runs(self, seq, n_tokens: int) -> tuple[tuple[int, int], ...]:
        """The slots of positions [0, n_tokens) of `seq` as (first slot, length) runs, in order."""
        bs, out = self.block_size, []
        table = self.tables[seq]
        for i in range(self.blocks_for(n_tokens)):
            n = min(bs, n_tokens - i * bs)
            if out and out[-1][0] + out[-1][1] == table[i] * bs:
                out[-1][1] += n
            else:
                out.append([table[i] * bs, n])
        return tuple((a, n) for a, n in out)

    def slots(self, seq, positions: torch.Tensor) -> torch.Tensor:
        """Slot mapping of logical `positions` (a long tensor on the cache's device)."""
        table = self.table_tensor(seq)
        bs = self.block_size
        return table[positions // bs] * bs + positions % bs

    # ---- data movement ----------------------------------------------------------------------
    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [kv_heads, num_blocks * block_size, head_dim] (slot-indexed)."""
        kvh, hd = self.kv_heads, self.head_dim
        return self.k[layer].view(kvh, -1, hd), self.v[layer].view(kvh, -1, hd)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [N, kv_heads, head_dim] at `slots` [N]."""
        ks, vs = self.layer_views(layer)
        ks.index_copy_(1, slots, k.transpose(0, 1).to(self.dtype))
        vs.index_copy_(1, slots, v.transpose(0, 1).to(self.dtype))

    def gather_blocks(
        self, layer: int, blocks: torch.Tensor, out_k: torch.Tensor, out_v: torch.Tensor
    ) -> None:
        """Copy whole blocks [M] into out_* [kv_heads, M, block_size, head_dim] (contiguous)."""
        torch.index_select(self.k[layer], 1, blocks, out=out_k)
        torch.index_select(self.v[layer], 1, blocks, out=out_v)

    def gather_slots(
        self, layer: int, slots: torch.Tensor, out_k: torch.Tensor, out_v: torch.Tensor
    ) -> None:
        """Copy single slots [M] into out_* [kv_heads, M, head_dim] (contiguous)."""
        ks, vs = self.layer_views(layer)
        torch.index_select(ks, 1, slots, out=out_k)
        torch.index_select(vs, 1, slots, out=out_v)

    def check_no_leak(self) -> None:
        """Assert every block except the null block is back in the free list."""
        if self.tables or len(self._free) != self.capacity_blocks:
            raise AssertionError(
                f"{self.capacity_blocks - len(self._free)} blocks still held by "
                f"{len(self.tables)} sequences"
            )


class Workspace:
    """Grow-only scratch buffers reused across forwards (fresh large allocations on CPU cost page
    faults that dwarf the copy itself)."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n:
            # headroom: shapes grow by a token per cycle; do not reallocate every cycle
            size = max(n + n // 2, 1 << 16) if buf is not None else max(n + n // 8, 1 << 12)
            buf = torch.empty(size, device=self.device, dtype=self.dtype)
            self._bufs[name] = buf
        return buf[:n].view(shape)

    def clear(self) -> None:
        self._bufs.clear()
