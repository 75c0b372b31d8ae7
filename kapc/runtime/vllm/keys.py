"""Query-aware pages on vLLM's KV cache: where this engine keeps keys, each request's key
bounds, and the page choice of a draft cycle.

Where a layer's keys live depends on the attention backend (compat.KEY_READERS). It is found
once per engine, before any bound is read: the first cycle with a query-aware row drafts on the
plans' own pages (`probing`), keeping the key layer 0 writes at that forward, and the key read
back through each reader names the one that fits. A cache no reader fits turns query-aware pages
off for every request, with the reason."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from kapc.runtime.session import remember
from kapc.runtime.vllm import compat
from kapc.runtime.vllm.compat import UnsupportedAttention


class KeyPages:
    def __init__(self, vllm_config, layout: compat.AttentionLayout):
        self.vllm_config, self.layout = vllm_config, layout
        self.reader = ""  # a name of compat.KEY_READERS, once found
        self.unreadable: str | None = None  # why query-aware pages are off on this engine
        self.probing = False  # the next forward's layer-0 key is kept, to find the reader
        self._probe: torch.Tensor | None = None
        self._stacked = None  # (rows' serials, KeySummaries) while the same rows draft together
        self._shared: SharedBounds | None = None
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
    def shared(self) -> SharedBounds:
        """Key bounds by KV block, for every request that reads a block another has read."""
        if self._shared is None:
            cfg, layout, reader = self.vllm_config, self.layout, self.reader
            self._shared = SharedBounds(
                lambda blocks: compat.key_bounds(cfg, layout, reader, blocks),
                lambda blocks: compat.block_stamps(cfg, layout, reader, blocks),
            )
        return self._shared

    def table_router(self, rows):
        """The page choice of a cycle's query-aware rows (kapc.runtime.planner.Candidate): their
        key bounds (read from the cache once per request, the first time it drafts, and again
        after the engine moved its blocks) stacked once for as long as the same rows draft
        together."""
        from kapc.runtime.selection import KeySummaries, TableRouter, row_masks

        for r in rows:
            s = r.session
            if s.bounds is None:
                pool = [int(b) for b in r.blocks[: s.tail_block]]
                lo, hi = self.shared.of(pool)
                s.bounds = (lo, hi, torch.tensor(pool, dtype=torch.long))
        key = tuple((r.session.serial, r.session.block_moves) for r in rows)
        if self._stacked is None or self._stacked[0] != key:
            self._stacked = (key, KeySummaries.stack([r.session.bounds for r in rows]))
        summ = self._stacked[1]
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


class SharedBounds:
    """Key bounds of KV blocks by block id, read once for every request that holds the block.

    Requests that share a prefix (a system prompt, a document several questions read) hold the
    same blocks in vLLM's prefix cache, and each read the whole prompt's bounds the first time it
    drafted: eight questions over one 8K document read the same 254 blocks eight times, at 40-130
    ms each inside an engine step. A block's bounds are kept with its stamp, the last layer's keys
    of its first and last token (`compat.layer_block_stamps`), and used again only while the
    block's stamp is unchanged: a freed block the engine fills with other tokens reads anew.
    `read_bounds(blocks)` gives [layers, kv_heads, len(blocks), head_dim] minima and maxima,
    `read_stamps(blocks)` one stamp per block; the newest `capacity` blocks are kept."""

    def __init__(
        self,
        read_bounds: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]],
        read_stamps: Callable[[list[int]], torch.Tensor],
        capacity: int = 2048,
    ):
        self._read_bounds, self._read_stamps = read_bounds, read_stamps
        self.capacity = int(capacity)
        self._blocks: OrderedDict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = (
            OrderedDict()
        )
        self.blocks_read = 0  # blocks whose bounds were read from the cache
        self.blocks_reused = 0

    def of(self, pool: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Bounds of `pool`'s blocks, in order: [layers, kv_heads, len(pool), head_dim] each."""
        stamps = self._read_stamps(pool)
        kept = [self._blocks.get(b) for b in pool]
        missing = [i for i, e in enumerate(kept) if e is None or not torch.equal(e[0], stamps[i])]
        if missing:
            lo, hi = self._read_bounds([pool[i] for i in missing])
            for j, i in enumerate(missing):
                kept[i] = (stamps[i].clone(), lo[:, :, j].clone(), hi[:, :, j].clone())
        for b, e in zip(pool, kept):  # every entry filled now
            remember(self._blocks, b, e, keep=self.capacity)
        self.blocks_read += len(missing)
        self.blocks_reused += len(pool) - len(missing)
        return torch.stack([e[1] for e in kept], dim=2), torch.stack([e[2] for e in kept], dim=2)
