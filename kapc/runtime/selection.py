"""Query-aware page selection (EarlySelectKV over Quest's K-summaries), for both runtimes.

- **K-summaries.** For every full prompt block of a request, per layer and KV head, the element-wise
  min and max of its keys (`KeySummaries`, built once after prefill). For a query q,
  `sum_d max(q_d * min_d, q_d * max_d)` bounds q.k from above for every key in the block (Quest).
  Only prompt blocks need summaries: every block from the one holding the last prompt token onwards
  (the tail, and all generated tokens) is in every view anyway.
- **Scoring.** Each query head's bounds are turned into a softmax over the row's blocks (how much
  of that head's attention a block could draw), and the heads' shares are summed: a block that
  matters to any head ranks high.
- **Choosing.** `choose` keeps the forced blocks (the attention sink), then the query's best of a
  hybrid plan's own blocks up to its quota (kapc.policy.access_view), and fills the budget with
  the best-scoring others.
- **Proxy queries.** `proxy_query` builds the next layer's query from an earlier hidden state
  (ES-In: the layer's input; ES-Mid: after its attention), through the next layer's norm, query
  projection and rotary embedding at the true position, so the next layer's pages can be chosen one
  layer ahead.

Everything is batched over the rows of a draft cycle. `Router` serves the reference executor
(which gathers each layer's chosen K/V); `TableRouter` the vLLM hook (which edits the block table
vLLM's kernel reads).
"""

from __future__ import annotations

import time

import torch

from kapc.runtime.model import rotate_half


class KeySummaries:
    """Per-block key bounds of the dynamic rows of a draft cycle. `kmin`, `kmax` [layers, kv_heads,
    slots, head_dim] hold bounds by slot: an engine's own KV block ids (vLLM: requests on one
    prefix hold the same blocks, so their bounds are held once, `from_store`) or the rows' blocks
    laid end to end (`stack`). `index` [rows, blocks] is the slot of each row's block, `valid`
    [rows, blocks] marks a row's real blocks (rows have different prompt lengths) and `tables`
    [rows, blocks] their pool blocks. `layer(i)` gathers one layer's bounds per row, so a cycle
    copies one layer at a time, when it is chosen, never every row's every layer up front."""

    def __init__(self, kmin, kmax, index, valid, tables):
        self.kmin, self.kmax, self.index, self.valid, self.tables = kmin, kmax, index, valid, tables

    @staticmethod
    def of_blocks(k_pool: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """min and max keys of pool `blocks` [n]: k_pool [layers, kv_heads, pool_blocks, block,
        head_dim] -> two [layers, kv_heads, n, head_dim]."""
        kb = k_pool.index_select(2, blocks)
        return kb.amin(dim=3), kb.amax(dim=3)

    @staticmethod
    def _rows(pools: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows' pool blocks padded to the longest (with block 0) and the mask of real ones."""
        n = max(t.numel() for t in pools)
        tables = torch.zeros(len(pools), n, dtype=torch.long, device=device)
        valid = torch.zeros(len(pools), n, dtype=torch.bool, device=device)
        for b, t in enumerate(pools):
            tables[b, : t.numel()], valid[b, : t.numel()] = t, True
        return tables, valid

    @classmethod
    def from_store(cls, kmin: torch.Tensor, kmax: torch.Tensor, pools: list[torch.Tensor]):
        """Rows whose bounds lie in `kmin`, `kmax` by pool block id (each row's pool blocks
        [n_row])."""
        tables, valid = cls._rows(pools, kmin.device)
        return cls(kmin, kmax, tables, valid, tables)

    @classmethod
    def stack(cls, per_row: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
        """Rows' own (kmin, kmax, pool blocks), laid end to end."""
        tables, valid = cls._rows([t for _, _, t in per_row], per_row[0][0].device)
        index = torch.zeros_like(tables)
        start = 0
        for b, (_, _, t) in enumerate(per_row):
            index[b, : t.numel()] = torch.arange(start, start + t.numel(), device=index.device)
            start += t.numel()
        kmin = torch.cat([lo for lo, _, _ in per_row], dim=2)
        kmax = torch.cat([hi for _, hi, _ in per_row], dim=2)
        return cls(kmin, kmax, index, valid, tables)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s bounds of every row's blocks: two [kv_heads, rows, blocks, head_dim]
        (a padded block reads slot 0; `valid` masks it)."""
        rows, n = self.index.shape
        flat = self.index.reshape(-1)
        lo = self.kmin[layer].index_select(1, flat)
        hi = self.kmax[layer].index_select(1, flat)
        return lo.view(lo.shape[0], rows, n, -1), hi.view(hi.shape[0], rows, n, -1)


def block_scores(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [rows, heads, head_dim] against one layer's summaries kmin, kmax [kv_heads, rows, blocks,
    head_dim] (`KeySummaries.layer`) -> [rows, blocks]: the attention share each block could
    draw, summed over heads."""
    B, nh, hd = q.shape
    kvh = kmin.shape[0]
    Q = q.view(B, kvh, nh // kvh, hd).transpose(0, 1)  # [kvh, B, g, hd]
    # max(q*lo, q*hi) = q+ * hi + q- * lo, summed over head_dim: two batched matmuls
    ub = torch.matmul(Q.clamp(min=0), kmax.transpose(-1, -2)) + torch.matmul(
        Q.clamp(max=0), kmin.transpose(-1, -2)
    )  # [kvh, B, g, blocks]
    ub = ub.mul_(scale).masked_fill_(~valid[None, :, None, :], float("-inf"))
    return torch.softmax(ub, dim=-1).sum(dim=(0, 2))


def choose(
    scores: torch.Tensor,
    forced: torch.Tensor,
    valid: torch.Tensor,
    keep: int,
    preferred: torch.Tensor | None = None,
    quota: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indices [rows, keep] of the blocks each row keeps, best first: every forced block
    (`forced` [rows, blocks], at most `keep` per row), then the `quota[row]` best-scoring of the
    row's `preferred` blocks (a hybrid plan's own pages), then the best-scoring others. Rows with
    fewer than `keep` real blocks repeat one (harmless: the caller masks by count)."""
    s = scores.masked_fill(~valid, float("-inf"))
    if preferred is not None and quota is not None and int(quota.max()) > 0:
        q = min(int(quota.max()), s.shape[1])
        top = s.masked_fill(~preferred, float("-inf")).topk(q, dim=1)
        wanted = (torch.arange(q, device=s.device)[None, :] < quota[:, None]) & torch.isfinite(
            top.values
        )
        forced = forced | torch.zeros_like(forced).scatter_(1, top.indices, wanted)
    s = s.masked_fill(forced, float("inf"))
    return s.topk(min(keep, s.shape[1]), dim=1).indices


def row_masks(valid: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row (forced blocks, preferred blocks, quota) as numpy index arrays and an int ->
    the forced and preferred masks [rows, blocks] and the quota tensor [rows]."""
    forced = torch.zeros_like(valid)
    preferred = torch.zeros_like(valid)
    for b, (f, p, _) in enumerate(rows):
        forced[b, torch.from_numpy(f).to(valid.device)] = True
        if p is not None and len(p):
            preferred[b, torch.from_numpy(p).to(valid.device)] = True
    quota = torch.tensor([q for _, _, q in rows], dtype=torch.long, device=valid.device)
    return forced, preferred, quota


def proxy_query(
    layer,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    head_dim: int,
    qk_norm: bool,
) -> torch.Tensor:
    """The query `layer` (a Hugging Face decoder layer) would form from hidden state h [N, hidden]:
    its input norm, query projection (and q-norm) and the rotary embedding at the true positions
    (cos, sin [N, 1, head_dim]) -> [N, heads, head_dim]."""
    a = layer.self_attn
    q = a.q_proj(layer.input_layernorm(h)).view(h.shape[0], heads, head_dim)
    if qk_norm:
        q = a.q_norm(q)
    return q * cos + rotate_half(q) * sin


def overlap(chosen: torch.Tensor, truth: torch.Tensor, free: torch.Tensor) -> tuple[int, int]:
    """How many of `truth`'s free (not forced) picks `chosen` also picked, and how many there were,
    summed over rows: the proxy-quality measure of EarlySelectKV. `free` [rows, keep] marks the
    truth's picks that were not forced."""
    hit = (truth[:, :, None] == chosen[:, None, :]).any(-1) & free
    return int(hit.sum()), int(free.sum())


def query_sources(access, num_layers: int) -> list[str]:
    """Per layer, what a policy chooses that layer's pages from: "query" (its own query), or the
    previous layer's "in" (input) or "mid" (post-attention) state, made into a proxy query."""
    proxy = access.proxy
    if proxy == "query":
        return ["query"] * num_layers
    if proxy == "es-mix":
        per = list(access.mix)
    else:
        per = ["in" if proxy == "es-in" else "mid"] * num_layers
    return ["query"] + per[1:num_layers]  # layer 0 has no earlier layer to look ahead from


class Router:
    """One draft cycle's page choice for its dynamic rows: `hook` (a model layer hook) builds the
    proxy queries one layer ahead; `slots(layer, q)` returns the pool slots of each row's chosen
    blocks [rows, keep * block_size]. Time spent and proxy quality go to `stats` (the executor's
    BatchStats: select_s, select_calls, overlap)."""

    def __init__(
        self,
        model,
        rows_access: list,
        summ: KeySummaries,
        forced: torch.Tensor,
        keep: int,
        block_size: int,
        stats,
        measure_overlap: bool = False,
        preferred: torch.Tensor | None = None,
        quota: torch.Tensor | None = None,
    ):
        L = model.num_layers
        self.m, self.summ, self.forced, self.keep, self.bs = model, summ, forced, keep, block_size
        self.preferred, self.quota = preferred, quota
        self.stats, self.measure = stats, measure_overlap
        per_row = [query_sources(a, L) for a in rows_access]
        # per layer: {"in": rows, "mid": rows} whose proxy comes from that earlier state
        self.src = [
            {
                st: torch.tensor(
                    [b for b, r in enumerate(per_row) if r[layer] == st],
                    dtype=torch.long,
                    device=forced.device,
                )
                for st in ("in", "mid")
                if any(r[layer] == st for r in per_row)
            }
            for layer in range(L)
        ]
        self.proxies: dict[int, torch.Tensor] = {}
        self.offsets = torch.arange(block_size, device=forced.device)

    def hook(self, positions: torch.Tensor, rows: torch.Tensor):
        """A `layer_hook` for the first draft step: at layer i, the proxies for layer i+1 from the
        dynamic rows (`rows` of the packed batch, at `positions`)."""
        m = self.m
        if not any(self.src):
            return None
        h0 = torch.zeros(1, 1, m.hidden, dtype=m.dtype, device=positions.device)
        cos, sin = m.rotary(h0, positions[None])
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)

        def on_layer(i: int, stage: str, h: torch.Tensor) -> None:
            nxt = i + 1
            if nxt >= m.num_layers or stage not in self.src[nxt]:
                return
            t0 = time.perf_counter()
            sub = self.src[nxt][stage]
            hq = proxy_query(
                m.layers[nxt],
                h.index_select(0, rows.index_select(0, sub)),
                cos.index_select(0, sub),
                sin.index_select(0, sub),
                m.num_heads,
                m.head_dim,
                m.has_qk_norm,
            )
            if nxt not in self.proxies:
                self.proxies[nxt] = torch.empty(
                    rows.numel(), m.num_heads, m.head_dim, dtype=hq.dtype, device=hq.device
                )
            self.proxies[nxt][sub] = hq
            self.stats.select_s += time.perf_counter() - t0

        return on_layer

    def _choose(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        s = self.summ
        scores = block_scores(q, *s.layer(layer), s.valid, self.m.scaling)
        return choose(scores, self.forced, s.valid, self.keep, self.preferred, self.quota)

    def slots(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Pool slots of the blocks each dynamic row reads at `layer`, given the rows' true queries
        q [rows, heads, head_dim] (used where a row's policy says "query", or to score proxies)."""
        t0 = time.perf_counter()
        proxy = self.proxies.pop(layer, None)
        qsel = q
        if proxy is not None:
            qsel = q.clone()
            for sub in self.src[layer].values():
                qsel[sub] = proxy[sub]
        chosen = self._choose(layer, qsel)
        if self.measure and proxy is not None:
            truth = self._choose(layer, q)
            free = ~self.forced.gather(1, truth)
            hit, total = overlap(chosen, truth, free)
            acc = self.stats.overlap.setdefault(layer, [0, 0])
            acc[0] += hit
            acc[1] += total
        pool = self.summ.tables.gather(1, chosen)  # [rows, keep]
        out = (pool[:, :, None] * self.bs + self.offsets).reshape(pool.shape[0], -1)
        self.stats.select_s += time.perf_counter() - t0
        self.stats.select_calls += 1
        return out


class TableRouter:
    """Page choice written into a paged-attention block table, for engines whose kernel reads the
    table (the vLLM hook): before each layer's attention, `apply(layer, query)` chooses the dynamic
    rows' blocks from that layer's true query at the cycle's first draft step and writes the
    chosen pool blocks into the first `keep[row]` columns of their table rows (the rest of a row
    is its tail); later steps of the cycle write the same choice again (the table is rebuilt
    every step)."""

    def __init__(
        self,
        summ: KeySummaries,
        forced: torch.Tensor,
        keep: list[int],
        heads: int,
        head_dim: int,
        scale: float,
        preferred: torch.Tensor | None = None,
        quota: torch.Tensor | None = None,
    ):
        self.summ, self.forced, self.keep = summ, forced, list(keep)
        self.preferred, self.quota = preferred, quota
        self.widest = max(self.keep)
        self.heads, self.head_dim, self.scale = heads, head_dim, scale
        self.chosen: dict[int, torch.Tensor] = {}  # layer -> pool blocks [rows, keep]
        self.table: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None  # this step's table rows of the dynamic rows
        self.present: torch.Tensor | None = None  # which dynamic rows draft this step
        self.seconds = 0.0
        self.choices = 0

    def bind(self, table: torch.Tensor, rows: torch.Tensor, present: torch.Tensor) -> None:
        """This step's block table, the table row of each present dynamic row, and which of the
        dynamic rows are present (rows stop drafting at their own k)."""
        self.table, self.rows, self.present = table, rows, present

    def apply(self, layer: int, query: torch.Tensor) -> None:
        t0 = time.perf_counter()
        if layer not in self.chosen:
            # the first step has every dynamic row present, in order
            q = query.view(-1, self.heads, self.head_dim).index_select(0, self.rows)
            s = self.summ
            scores = block_scores(q.to(s.kmin.dtype), *s.layer(layer), s.valid, self.scale)
            idx = choose(scores, self.forced, s.valid, self.widest, self.preferred, self.quota)
            self.chosen[layer] = s.tables.gather(1, idx).to(self.table.dtype)
            self.choices += 1
        chosen = self.chosen[layer]
        if all(k == self.widest for k in self.keep):
            self.table[self.rows, : self.widest] = chosen.index_select(0, self.present)
        else:  # best first: a row that keeps fewer takes the head of its choice
            for r, d in zip(self.rows.tolist(), self.present.tolist()):
                self.table[r, : self.keep[d]] = chosen[d, : self.keep[d]]
        self.seconds += time.perf_counter() - t0
