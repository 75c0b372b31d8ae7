"""Query-aware pages on vLLM's KV cache: where this engine keeps keys, each request's key
bounds, and the page choice of a draft cycle.

Where a layer's keys live depends on the attention backend (compat.KEY_READERS). It is found
once per engine, before any bound is read: the first cycle with a query-aware row drafts on the
plans' own pages (`probing`), keeping the key layer 0 writes at that forward, and the key read
back through each reader names the one that fits. A cache no reader fits turns query-aware pages
off for every request, with the reason."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kapc.runtime.vllm import compat
from kapc.runtime.vllm.compat import UnsupportedAttention


class KeyPages:
    def __init__(self, vllm_config, layout: compat.AttentionLayout):
        self.vllm_config, self.layout = vllm_config, layout
        self.reader = ""  # a name of compat.KEY_READERS, once found
        self.unreadable: str | None = None  # why query-aware pages are off on this engine
        self.probing = False  # the next forward's layer-0 key is kept, to find the reader
        self._probe: torch.Tensor | None = None
        self._bounds: BlockBounds | None = None
        self.router = None  # the page choice of the draft forward running now, if any

    @property
    def known(self) -> bool:
        """Whether this engine's key layout has been looked for (found, or found unreadable)."""
        return bool(self.reader) or self.unreadable is not None

    def before_attention(self, layer: int, query, key) -> None:
        if layer == 0 and self.probing:
            self._probe, self.probing = key[0].detach().clone(), False
        if self.router is not None:
            self.router.apply(layer, query)

    def found_at(self, slot: int) -> str | None:
        """After a probing forward that wrote layer 0's key at `slot`: find the reader. Returns
        why keys cannot be read (query-aware pages off from now on), or None."""
        attn = compat.attention_modules(self.vllm_config, self.layout)[0]
        probe, self._probe, self.probing = self._probe, None, False
        try:
            if probe is None:
                raise UnsupportedAttention(
                    "no key was seen in the draft forward: query-aware pages are off"
                )
            self.reader = compat.find_key_reader(
                self.vllm_config, self.layout, slot, probe.view(-1, attn.head_size)
            )
        except UnsupportedAttention as exc:
            self.unreadable = str(exc)
        return self.unreadable

    @property
    def bounds(self) -> BlockBounds:
        """Key bounds by KV block, for every request that reads a block another has read."""
        if self._bounds is None:
            cfg, layout, reader = self.vllm_config, self.layout, self.reader
            self._bounds = BlockBounds(
                lambda blocks: compat.key_bounds(cfg, layout, reader, blocks),
                lambda blocks: compat.block_stamps(cfg, layout, reader, blocks),
                compat.cache_blocks(cfg, layout, reader),
            )
        return self._bounds

    def table_router(self, rows):
        """The page choice of a cycle's query-aware rows (kapc.runtime.planner.Candidate), over
        their key bounds (checked against the cache once per request, the first time it drafts,
        and again after the engine moved its blocks)."""
        from kapc.runtime.selection import KeySummaries, TableRouter, row_masks

        store = self.bounds
        for r in rows:
            s = r.session
            if s.bounds is None:
                s.bounds = store.read([int(b) for b in r.blocks[: s.tail_block]])
        summ = KeySummaries.from_store(store.kmin, store.kmax, [r.session.bounds for r in rows])
        views = [r.session.view for r in rows]
        forced, preferred, quota = row_masks(
            summ.valid, [(v.forced, v.preferred, v.quota) for v in views]
        )
        attn = compat.attention_modules(self.vllm_config, self.layout)[0]
        return TableRouter(
            summ,
            forced,
            keep=[v.keep for v in views],
            heads=attn.num_heads,
            head_dim=attn.head_size,
            scale=float(attn.impl.scale),
            preferred=preferred,
            quota=quota,
        )


class BlockBounds:
    """Key bounds of the engine's KV blocks, by block id, read once for every request that holds
    the block.

    Requests that share a prefix (a system prompt, a document several questions read) hold the
    same blocks in vLLM's prefix cache, and each needs the whole prompt's bounds the first time it
    drafts: eight questions over one 8K document need the same 254 blocks eight times, inside an
    engine step. Held by block id, they are read once and never copied per request: a draft cycle
    gathers one layer's bounds of its rows when it chooses that layer's pages
    (`KeySummaries.layer`). A block's bounds are kept with its stamp, the last layer's keys of its
    first and last token (`compat.layer_block_stamps`), read again when a request first uses the
    block: a freed block the engine filled with other tokens reads anew. A request keeps its
    blocks while it runs, so bounds checked once stay its own until its blocks move
    (`PlanSession.check_blocks`).

    `read_bounds(blocks)` gives [layers, kv_heads, len(blocks), head_dim] minima and maxima,
    `read_stamps(blocks)` one stamp per block. The store has room for all `blocks` of the cache
    (a minimum and a maximum key per block: 1/block_size of the KV cache's size), allocated at
    the first read and uninitialised: on a CPU only the pages of blocks read take memory; on a
    GPU the whole store is reserved then, beside vLLM's own budget."""

    def __init__(
        self,
        read_bounds: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]],
        read_stamps: Callable[[list[int]], torch.Tensor],
        blocks: int,
    ):
        self._read_bounds, self._read_stamps = read_bounds, read_stamps
        self.blocks = int(blocks)
        self.kmin: torch.Tensor | None = None  # [layers, kv_heads, blocks, head_dim]
        self.kmax: torch.Tensor | None = None
        self._stamps: torch.Tensor | None = None  # [blocks, 2, kv_heads, head_dim]
        self._known: torch.Tensor | None = None  # [blocks] bool: bounds and stamp held
        self.blocks_read = 0  # blocks whose bounds were read from the cache
        self.blocks_reused = 0

    def read(self, pool: list[int]) -> torch.Tensor:
        """Make `pool`'s bounds current in the store; returns `pool` as a tensor of block ids."""
        stamps = self._read_stamps(pool)
        index = torch.tensor(pool, dtype=torch.long, device=stamps.device)
        if self._known is None:
            self._stamps = torch.empty(
                self.blocks, *stamps.shape[1:], dtype=stamps.dtype, device=stamps.device
            )
            self._known = torch.zeros(self.blocks, dtype=torch.bool, device=stamps.device)
        held = self._known.index_select(0, index)
        held &= (self._stamps.index_select(0, index) == stamps).flatten(1).all(dim=1)
        missing = (~held).nonzero().flatten()
        if missing.numel():
            blocks = index.index_select(0, missing)
            lo, hi = self._read_bounds(blocks.tolist())
            if self.kmin is None:
                L, kvh, _, hd = lo.shape
                self.kmin = torch.empty(L, kvh, self.blocks, hd, dtype=lo.dtype, device=lo.device)
                self.kmax = torch.empty_like(self.kmin)
            self.kmin.index_copy_(2, blocks, lo)
            self.kmax.index_copy_(2, blocks, hi)
            self._stamps.index_copy_(0, blocks, stamps.index_select(0, missing))
            self._known.index_fill_(0, blocks, True)
        self.blocks_read += int(missing.numel())
        self.blocks_reused += len(pool) - int(missing.numel())
        return index
