"""Query-aware pages on vLLM's KV cache: where this engine keeps keys, each request's key
bounds, and the page choice of a draft cycle.

Where a layer's keys live depends on the attention backend (compat.KEY_READERS). It is found
once per engine, before any bound is read: the first cycle with a query-aware row drafts on the
plans' own pages (`probing`), keeping the key layer 0 writes at that forward, and the key read
back through each reader names the one that fits. A cache no reader fits turns query-aware pages
off for every request, with the reason."""

from __future__ import annotations

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
        self._stacked = None  # (rows' serials, KeySummaries) while the same rows draft together
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
                lo, hi = compat.key_bounds(self.vllm_config, self.layout, self.reader, pool)
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
