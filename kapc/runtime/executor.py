"""The reference executor: full-context decoding and selected-KV self-speculative plan decoding,
batched, over the paged KV cache.

One decoding *cycle* for a batch:

1. **Proposal** (rows in plan mode): the same model runs k draft steps, ONE batched forward per
   step for all plan rows. Each row attends over its compact view: the plan's visible prompt
   positions plus every committed generated token, mapped through the row's own block table, at
   their TRUE logical positions. The compact K/V is gathered from the pool once per cycle (per
   layer, at draft step 0) into a private scratch buffer; each draft step appends its own K/V to
   that buffer. Drafts never touch the pool, so committed state cannot be corrupted.
2. **Verification** (every active row): ONE full-context forward over the carry token plus the
   row's drafts writes their K/V into the row's own slots (positions c .. c+k) and scores them.
   A prefix of drafts is accepted (`greedy`: equal to the full-context argmax, lossless;
   `topN`: within the full-context top N), the full-context argmax after that prefix is emitted
   too (bonus/correction), and the committed length advances past the carry and the accepted
   drafts, whose K/V that same pass wrote. K/V written for rejected drafts lies past the committed
   length and is overwritten by the next verification before anything reads it.

Full-context decoding is the same loop with no proposal (a verification of the carry alone).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kapc.lower.kapb import Plan, PlanMismatch, prompt_hash
from kapc.policy import AccessPolicy, accepted_prefix, parse_accept
from kapc.runtime import attention, selection
from kapc.runtime.model import RuntimeModel
from kapc.runtime.paged_kv import NULL_BLOCK, PagedKVCache, Workspace
from kapc.runtime.session import EngineRules, PlanSession, RequestOptions, RunReport

__all__ = ["Executor", "Request", "RequestResult", "BatchStats", "parse_accept", "PlanMismatch"]


@dataclass
class Request:
    prompt_ids: object  # sequence of ints / int array
    plan: Plan | None = None
    max_tokens: int = 128
    accept: str | None = None  # overrides the plan's rule
    k: int | None = None  # overrides the plan's proposal length
    req_id: object = None
    ignore_eos: bool = False  # decode exactly max_tokens (benchmarks compare equal lengths)
    access: AccessPolicy | None = None  # overrides the plan's access policy


@dataclass
class RequestResult:
    """A decoded request: its tokens and the executor's figures, with its plan's `RunReport`
    (`report`), whose fields read through (as the full-context view where the plan never ran)."""

    req_id: object
    tokens: list[int]
    finish_reason: str  # "eos" or "length"
    cycles: int  # decoding cycles after prefill
    decode_tokens: int  # tokens emitted by the cycles (all tokens but the prefill's)
    prefill_s: float
    report: RunReport

    @property
    def mode(self) -> str:
        """ "plan" (ran the plan, possibly falling back midway) or "full"."""
        return "plan" if self.report.ran else "full"

    @property
    def fallback_reason(self) -> str | None:
        return self.report.reason

    @property
    def prompt_tokens(self) -> int:
        return self.report.prompt_tokens

    @property
    def visible_prompt_tokens(self) -> int:
        return self.report.visible_prompt_tokens if self.report.ran else self.prompt_tokens

    @property
    def retained_ratio(self) -> float | None:
        """The executed s (visible prompt tokens / prompt tokens) of a plan that ran."""
        return self.report.retained_ratio if self.report.ran else None

    @property
    def plan_retained_ratio(self) -> float | None:
        return self.report.plan_retained_ratio

    @property
    def accept(self) -> str | None:
        return self.report.accept

    @property
    def k(self) -> int:
        return self.report.k

    @property
    def proposed(self) -> int:
        return self.report.proposed

    @property
    def accepted(self) -> int:
        return self.report.accepted

    @property
    def plan_cycles(self) -> int:
        """Cycles that ran a proposal."""
        return self.report.draft_cycles

    @property
    def speedup_predicted(self) -> float | None:
        return self.report.speedup_predicted

    @property
    def accepted_per_pos(self) -> list[int]:
        """Cycles accepting at least j+1 drafts, per j."""
        return self.report.accepted_per_pos

    @property
    def access(self) -> str:
        """The access policy the proposal ran under."""
        return self.report.access if self.report.ran else "static"

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tokens_per_cycle(self) -> float | None:
        return self.decode_tokens / self.cycles if self.cycles else None


@dataclass
class BatchStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    proposal_s: float = 0.0
    verify_s: float = 0.0
    gather_s: float = 0.0  # K/V gathers (inside proposal and verification)
    select_s: float = 0.0  # query-aware page choice (inside proposal): scoring and routing
    select_calls: int = 0  # layer choices made (one per layer per cycle with dynamic rows)
    # proxy quality: per layer, [true-query picks the proxy also picked, true-query picks]
    overlap: dict = field(default_factory=dict)
    cycles: int = 0
    draft_forwards: int = 0
    verify_forwards: int = 0
    decode_tokens: int = 0

    @property
    def other_s(self) -> float:
        return max(0.0, self.decode_s - self.proposal_s - self.verify_s)

    def overlap_by_layer(self) -> dict[int, float]:
        return {layer: hit / total for layer, (hit, total) in sorted(self.overlap.items()) if total}

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["overlap"] = self.overlap_by_layer()
        d["other_s"] = self.other_s
        d["decode_tok_per_s"] = self.decode_tokens / self.decode_s if self.decode_s else None
        return d


@dataclass
class _Seq:
    sid: int
    req: Request
    prompt: torch.Tensor  # long [P] on device
    P: int
    max_tokens: int
    plan: PlanSession
    visible_slots: torch.Tensor | None = None  # compact prompt slots (plan rows)
    c: int = 0  # committed KV length
    carry: int = -1  # last emitted token, not yet in the KV cache
    out: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str = "length"
    cycles: int = 0
    prefill_s: float = 0.0

    @property
    def drafting(self) -> bool:
        return self.plan.drafting


class Executor:
    """Batched decoding over a paged KV cache. `block_size` must equal the plans' block size."""

    def __init__(
        self,
        model: RuntimeModel,
        block_size: int = 16,
        kv_blocks: int | None = None,
        kv_cache_gib: float = 2.0,
        prefill_chunk: int = 512,
        prefix_cache: bool = False,
        honor_predicted_loss: bool = True,
        on_mismatch: str = "raise",
    ):
        self.m = model
        self.block_size = block_size
        if kv_blocks is None:
            per_block = model.kv_bytes_per_token() * block_size
            kv_blocks = max(4, int(kv_cache_gib * 2**30 // per_block))
        self.cache = PagedKVCache(
            model.num_layers,
            model.kv_heads,
            model.head_dim,
            block_size,
            kv_blocks,
            model.device,
            model.dtype,
        )
        self.ws = Workspace(model.device, model.dtype)
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = prefix_cache
        self.honor_predicted_loss = honor_predicted_loss
        if on_mismatch not in ("raise", "fallback"):
            raise ValueError("on_mismatch is 'raise' or 'fallback'")
        self.on_mismatch = on_mismatch
        self._ids = itertools.count(1)
        self._prefixes: dict[str, tuple[int, int]] = {}  # prompt hash -> (cache sid, first token)
        self.groups = model.num_heads // model.kv_heads
        self._gather_s = 0.0
        self.measure_overlap = False  # also choose from the true query, to score proxies
        self._stacked: tuple[tuple[int, ...], selection.KeySummaries] | None = None
        self.rules = EngineRules(
            block_size=block_size, layers=model.num_layers, fingerprint=lambda: model.fingerprint
        )

    # ---- public API ---------------------------------------------------------------------------
    def generate(self, requests: list[Request]) -> tuple[list[RequestResult], BatchStats]:
        """Decode a batch: requests with a plan run it (or fall back), others full-context."""
        stats = BatchStats()
        seqs = [self._admit(r, i) for i, r in enumerate(requests)]
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                self._prefill_all(seqs)
                stats.prefill_s = time.perf_counter() - t0
                self._decode(seqs, stats)
        finally:
            for s in seqs:
                if s.sid in self.cache.tables:
                    self.cache.free(s.sid)
        return [self._result(s) for s in seqs], stats

    def full(self, prompts, max_tokens: int = 128):
        """Full-context greedy decoding of token-id prompts (the baseline)."""
        return self.generate([Request(prompt_ids=p, max_tokens=max_tokens) for p in prompts])

    def clear_prefix_cache(self) -> None:
        for sid, _ in self._prefixes.values():
            self.cache.free(sid)
        self._prefixes.clear()

    # ---- admission ----------------------------------------------------------------------------
    def _admit(self, r: Request, i: int) -> _Seq:
        ids = np.asarray(r.prompt_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("empty prompt")
        if r.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if r.req_id is None:
            r.req_id = i
        P = int(ids.size)
        session = PlanSession(tag=str(r.req_id), prompt_tokens=P)
        s = _Seq(
            sid=next(self._ids),
            req=r,
            prompt=torch.from_numpy(ids.copy()).to(self.m.device),
            P=P,
            max_tokens=r.max_tokens,
            plan=session,
        )
        if r.plan is None:
            return s
        opts = RequestOptions(
            honor_predicted_loss=self.honor_predicted_loss, k=r.k, accept=r.accept, access=r.access
        )
        session.admit(r.plan, ids, opts, self.rules)
        if session.error is not None and self.on_mismatch == "raise":
            raise session.error
        return s

    # ---- prefill ------------------------------------------------------------------------------
    def _prefill_all(self, seqs: list[_Seq]) -> None:
        """Chunked prefill, batched: each forward packs prompt chunks of several requests up to
        `prefill_chunk` tokens. With the prefix cache on, a prompt seen before is forked."""
        t0 = time.perf_counter()
        dev = self.m.device
        pending, dups, keys = [], [], set()
        for s in seqs:
            self.cache.add(s.sid)
            key = (
                prompt_hash(s.prompt.cpu().numpy().astype(np.int32)) if self.prefix_cache else None
            )
            if key is not None and key in self._prefixes:
                src, first = self._prefixes[key]
                self.cache.fork(src, s.sid, s.P)
                self._started(s, first, t0)
            elif key is not None and key in keys:
                dups.append((s, key))
            else:
                keys.add(key)
                self.cache.ensure(s.sid, self._lifetime(s))
                s.c = 0
                pending.append((s, key))
        C = self.prefill_chunk
        while pending:
            chosen, total = [], 0
            for s, key in pending:
                q = min(C, s.P - s.c)
                if chosen and total + q > C:
                    break
                chosen.append((s, key, q))
                total += q
            rows, ids, pos, last, off = [], [], [], [], 0
            for s, _, q in chosen:
                rows.append((s.sid, s.c, q))
                ids.append(s.prompt[s.c : s.c + q])
                pos.append(torch.arange(s.c, s.c + q, device=dev))
                if s.c + q == s.P:
                    last.append(off + q - 1)
                off += q
            logits = self.m.forward(
                torch.cat(ids),
                torch.cat(pos),
                self._full_meta(rows),
                logits_index=torch.tensor(last, dtype=torch.long, device=dev),
            )
            firsts = logits.argmax(-1).tolist()
            done = set()
            for s, key, q in chosen:
                s.c += q
                if s.c == s.P:
                    first = firsts.pop(0)
                    if key is not None:
                        csid = next(self._ids)
                        self.cache.fork(s.sid, csid, s.P)
                        self._prefixes[key] = (csid, first)
                    self._started(s, first, t0)
                    done.add(s.sid)
            pending = [(s, k) for s, k in pending if s.sid not in done]
        for s, key in dups:
            src, first = self._prefixes[key]
            self.cache.fork(src, s.sid, s.P)
            self._started(s, first, t0)

    def _lifetime(self, s: _Seq) -> int:
        """The KV positions a request can use: reserved at once, so that its context is one run
        of the pool (two for a forked prompt) that attention reads in place."""
        return s.P + s.max_tokens + s.plan.k + 1

    def _started(self, s: _Seq, first: int, t0: float) -> None:
        self.cache.ensure(s.sid, self._lifetime(s))
        s.c = s.P
        s.carry = first
        s.out.append(first)
        if s.drafting:
            plan, bs = s.plan, self.block_size
            if plan.access is None:
                blocks = np.append(plan.selected, plan.tail_block)
                pos = (blocks[:, None] * bs + np.arange(bs)).ravel()
                pos = torch.from_numpy(pos[pos < s.P]).to(self.m.device)
                s.visible_slots = self.cache.slots(s.sid, pos)
            else:
                # the tail is always read; the full blocks before it are chosen per cycle
                tail = (s.P - 1) // self.block_size
                dev = self.m.device
                s.visible_slots = self.cache.slots(
                    s.sid, torch.arange(tail * self.block_size, s.P, device=dev)
                )
                pool = torch.tensor(self.cache.tables[s.sid][:tail], dtype=torch.long, device=dev)
                plan.bounds = (*selection.KeySummaries.of_blocks(self.cache.k, pool), pool)
        self._check_stop(s)
        s.prefill_s = time.perf_counter() - t0

    def _check_stop(self, s: _Seq) -> None:
        if s.out and s.out[-1] in self.m.eos_ids and not s.req.ignore_eos:
            s.finished, s.finish_reason = True, "eos"
        elif len(s.out) >= s.max_tokens:
            s.finished, s.finish_reason = True, "length"

    # ---- decoding loop ------------------------------------------------------------------------
    def _decode(self, seqs: list[_Seq], stats: BatchStats) -> None:
        """Propose, verify, commit, until every row has finished."""
        t_start = time.perf_counter()
        for s in seqs:
            if s.finished:
                self.cache.free(s.sid)
        while active := [s for s in seqs if not s.finished]:
            stats.cycles += 1
            drafts = self._propose_for(active, stats)
            toks = [[s.carry] + drafts.get(s.sid, []) for s in active]
            target, top = self._verify(active, toks, stats)
            off = 0
            for s, tt in zip(active, toks):
                self._commit(
                    s,
                    tt[1:],
                    target[off : off + len(tt)],
                    top[off : off + len(tt)] if top is not None else None,
                    stats,
                )
                off += len(tt)
        stats.decode_s = time.perf_counter() - t_start

    def _propose_for(self, active: list[_Seq], stats: BatchStats) -> dict[int, list[int]]:
        """Drafts of the rows running a plan, each up to its k (and what it may still emit)."""
        plan_rows = [
            (s, kb)
            for s in active
            if s.drafting
            for kb in [min(s.plan.k, s.max_tokens - len(s.out) - 1)]
            if kb >= 1
        ]
        if not plan_rows:
            return {}
        t0, g0 = time.perf_counter(), self._gather_s
        drafts = self._propose(plan_rows, stats)
        stats.proposal_s += time.perf_counter() - t0
        stats.gather_s += self._gather_s - g0
        return drafts

    def _verify(self, active: list[_Seq], toks: list[list[int]], stats: BatchStats):
        """One full-context forward over every row's carried token and drafts. Returns the
        full-context argmax per query token, and the top-N candidates when a row accepts top-N."""
        t0 = time.perf_counter()
        dev = self.m.device
        rows = []
        for s, tt in zip(active, toks):
            self.cache.ensure(s.sid, s.c + len(tt))
            rows.append((s.sid, s.c, len(tt)))
        ids = torch.tensor([t for tt in toks for t in tt], dtype=torch.long, device=dev)
        pos = torch.tensor(
            [p for s, tt in zip(active, toks) for p in range(s.c, s.c + len(tt))],
            dtype=torch.long,
            device=dev,
        )
        logits = self.m.forward(ids, pos, self._in_place_attention(rows))
        maxn = max(s.plan.topn for s in active)
        if maxn > 1:
            top = logits.topk(maxn, dim=-1).indices.cpu()
            target = top[:, 0].tolist()
        else:
            top, target = None, logits.argmax(-1).cpu().tolist()
        stats.verify_s += time.perf_counter() - t0
        stats.verify_forwards += 1
        return target, top

    def _commit(self, s: _Seq, drafts: list[int], target: list[int], top, stats: BatchStats):
        """Emit the accepted prefix of `drafts` and the full-context token after it; record
        acceptance, fall back when the plan is losing, stop at EOS or the length limit."""
        topn = s.plan.topn
        cands = [[t] for t in target[: len(drafts)]] if topn == 1 else top[: len(drafts)].tolist()
        a = accepted_prefix(drafts, cands, topn)
        s.cycles += 1
        if drafts:
            s.plan.drafted(len(drafts))
            s.plan.verified(a)  # may fall back: the plan is losing
        s.c += a + 1
        n0 = len(s.out)
        for t in drafts[:a] + [target[a]]:
            s.out.append(t)
            self._check_stop(s)
            if s.finished:
                break
        stats.decode_tokens += len(s.out) - n0
        s.carry = s.out[-1]
        if s.finished:
            self.cache.free(s.sid)

    # ---- proposal -----------------------------------------------------------------------------
    def _propose(
        self, plan_rows: list[tuple[_Seq, int]], stats: BatchStats
    ) -> dict[int, list[int]]:
        """k draft steps for the plan rows, one batched forward per step over each row's compact
        view. A row's view, in columns: the prompt blocks its dynamic policy chose this cycle
        (`D` columns, the same for all rows, masked past the row's own count), the fixed part
        (static: the plan's prompt tokens; dynamic: the tail) and its generated tokens, padding,
        then one column per draft step."""
        dev = self.m.device
        B = len(plan_rows)
        kmax = max(kb for _, kb in plan_rows)
        dyn = [b for b, (s, _) in enumerate(plan_rows) if s.plan.access is not None]
        keepmax = max((plan_rows[b][0].plan.view.keep for b in dyn), default=0)
        index, valid, D = self._compact_views([s for s, _ in plan_rows], keepmax, kmax)
        Tc, W = valid.shape[1], index.shape[1]
        route = self._router([plan_rows[b][0] for b in dyn], keepmax, stats) if dyn else None
        dyn_t = torch.tensor(dyn, dtype=torch.long, device=dev)
        bidx = torch.arange(B, device=dev)
        kvh, hd, g = self.m.kv_heads, self.m.head_dim, self.groups
        scale = self.m.scaling
        cache, ws = self.cache, self.ws
        step = {"j": 0, "mask": None}

        def attend(layer, q, k, v):
            j = step["j"]
            ck = ws.get(f"ck{layer}", (kvh, B * W, hd))
            cv = ws.get(f"cv{layer}", (kvh, B * W, hd))
            if j == 0:
                idx = index
                if route is not None:
                    idx = index.clone()
                    idx[dyn_t, :D] = route.slots(layer, q.index_select(0, dyn_t))
                t0 = time.perf_counter()
                cache.gather_slots(layer, idx.view(-1), ck, cv)
                self._gather_s += time.perf_counter() - t0
            ck4, cv4 = ck.view(kvh, B, W, hd), cv.view(kvh, B, W, hd)
            ck4[:, bidx, Tc + j] = k.transpose(0, 1).to(ck.dtype)
            cv4[:, bidx, Tc + j] = v.transpose(0, 1).to(cv.dtype)
            T = Tc + j + 1
            K = ck4[:, :, :T].permute(1, 0, 2, 3)
            V = cv4[:, :, :T].permute(1, 0, 2, 3)
            Q = q.reshape(B, kvh, g, hd)
            o = F.scaled_dot_product_attention(Q, K, V, attn_mask=step["mask"], scale=scale)
            return o.reshape(B, kvh * g * hd)

        tokens = torch.tensor([s.carry for s, _ in plan_rows], dtype=torch.long, device=dev)
        base = torch.tensor([s.c for s, _ in plan_rows], dtype=torch.long, device=dev)
        hook = route.hook(base.index_select(0, dyn_t), dyn_t) if route is not None else None
        out = []
        for j in range(kmax):
            step["j"] = j
            allowed = torch.cat([valid, valid.new_ones(B, j + 1)], dim=1)  # [B, T]
            mask = torch.zeros(B, 1, 1, Tc + j + 1, dtype=self.m.dtype, device=dev)
            mask.masked_fill_(~allowed[:, None, None, :], float("-inf"))
            step["mask"] = mask
            logits = self.m.forward(tokens, base + j, attend, layer_hook=hook if j == 0 else None)
            tokens = logits.argmax(-1)
            out.append(tokens)
            stats.draft_forwards += 1
        drafts = torch.stack(out, 1).cpu().tolist()  # [B, kmax]
        return {s.sid: drafts[b][:kb] for b, (s, kb) in enumerate(plan_rows)}

    def _compact_views(self, rows: list[_Seq], keepmax: int, kmax: int):
        """The rows' compact views as pool slots: `index` [B, W] (the chosen blocks' `D`
        columns, left for the router; the fixed part; padding reading slot 0, the null block;
        `kmax` draft columns) and `valid` [B, W - kmax], the columns a row may attend to."""
        dev, bs = self.m.device, self.block_size
        D = keepmax * bs
        fixed = []
        for s in rows:
            gen = self.cache.slots(s.sid, torch.arange(s.P, s.c, device=dev)) if s.c > s.P else None
            fixed.append(s.visible_slots if gen is None else torch.cat([s.visible_slots, gen]))
        Tc = D + max(f.numel() for f in fixed)
        index = torch.zeros(len(rows), Tc + kmax, dtype=torch.long, device=dev)
        valid = torch.zeros(len(rows), Tc, dtype=torch.bool, device=dev)
        for b, (s, f) in enumerate(zip(rows, fixed)):
            index[b, D : D + f.numel()] = f
            valid[b, D : D + f.numel()] = True
            if s.plan.view is not None:
                valid[b, : s.plan.view.keep * bs] = True
        return index, valid, D

    def _router(self, rows: list[_Seq], keep: int, stats: BatchStats) -> selection.Router:
        """The page choice of this cycle's dynamic rows (their key summaries stacked once for as
        long as the same rows draft together)."""
        plans = [s.plan for s in rows]
        key = tuple(s.sid for s in rows)
        if self._stacked is None or self._stacked[0] != key:
            self._stacked = (key, selection.KeySummaries.stack([p.bounds for p in plans]))
        summ = self._stacked[1]
        forced, preferred, quota = selection.row_masks(
            summ.valid, [(p.view.forced, p.view.preferred, p.view.quota) for p in plans]
        )
        return selection.Router(
            self.m,
            [p.access for p in plans],
            summ,
            forced,
            keep,
            self.block_size,
            stats,
            self.measure_overlap,
            preferred,
            quota,
        )

    # ---- full-context attention -----------------------------------------------------------------
    def _in_place_attention(self, rows: list[tuple[int, int, int]]):
        """Attention over each row's whole context where it lies in the pool, for packed query
        tokens: row (sid, c, q) has q new tokens at positions c .. c+q-1 (written first)."""
        dev, bs, cache = self.m.device, self.block_size, self.cache
        wslots, ctx, off = [], [], 0
        for sid, c, q in rows:
            table = cache.tables[sid]
            wslots.extend(table[p // bs] * bs + p % bs for p in range(c, c + q))
            ctx.append(attention.RowContext(offset=off, c=c, q=q, runs=cache.runs(sid, c + q)))
            off += q
        wslots = torch.tensor(wslots, dtype=torch.long, device=dev)
        scale, groups, masks = self.m.scaling, self.groups, {}

        def attend(layer, q, k, v):
            cache.write(layer, wslots, k, v)
            k_pool, v_pool = cache.layer_views(layer)
            return attention.in_place(q, k_pool, v_pool, ctx, scale, groups, masks)

        return attend

    def _full_meta(self, rows: list[tuple[int, int, int]]):
        """Attention over each row's whole block table, for packed query tokens: row (sid, c, q)
        has q new tokens at positions c .. c+q-1 (written into the pool first)."""
        dev, bs = self.m.device, self.block_size
        B = len(rows)
        qmax = max(q for _, _, q in rows)
        nbmax = max(self.cache.blocks_for(c + q) for _, c, q in rows)
        T = nbmax * bs
        blocks = torch.full((B, nbmax), NULL_BLOCK, dtype=torch.long)
        wslots, pack = [], []
        for b, (sid, c, q) in enumerate(rows):
            table = self.cache.tables[sid]
            nb = self.cache.blocks_for(c + q)
            blocks[b, :nb] = torch.tensor(table[:nb])
            for p in range(c, c + q):
                wslots.append(table[p // bs] * bs + p % bs)
            pack.extend(range(b * qmax, b * qmax + q))
        blocks = blocks.view(-1).to(dev)
        wslots = torch.tensor(wslots, dtype=torch.long, device=dev)
        need_pack = len(pack) != B * qmax
        pack_t = torch.tensor(pack, dtype=torch.long, device=dev) if need_pack else None
        # mask[b, 0, g*qmax + i, t] = 0 where t <= c_b + i, else -inf; padded query rows see col 0
        g = self.groups
        c_t = torch.tensor([c for _, c, _ in rows], dtype=torch.long)
        q_t = torch.tensor([q for _, _, q in rows], dtype=torch.long)
        i = torch.arange(qmax)
        t = torch.arange(T)
        allowed = t[None, None, :] <= (c_t[:, None] + i[None, :])[:, :, None]  # [B, qmax, T]
        padrow = i[None, :] >= q_t[:, None]  # [B, qmax]
        allowed = torch.where(padrow[:, :, None], t[None, None, :] == 0, allowed)
        mask = torch.zeros(B, qmax, T, dtype=self.m.dtype)
        mask.masked_fill_(~allowed, float("-inf"))
        mask = mask[:, None, None].expand(B, 1, g, qmax, T).reshape(B, 1, g * qmax, T).to(dev)
        kvh, hd, nh = self.m.kv_heads, self.m.head_dim, self.m.num_heads
        cache, ws, scale = self.cache, self.ws, self.m.scaling

        def attend(layer, q, k, v):
            cache.write(layer, wslots, k, v)
            kb = ws.get("fk", (kvh, B * nbmax, bs, hd))
            vb = ws.get("fv", (kvh, B * nbmax, bs, hd))
            t0 = time.perf_counter()
            cache.gather_blocks(layer, blocks, kb, vb)
            self._gather_s += time.perf_counter() - t0
            K = kb.view(kvh, B, T, hd).permute(1, 0, 2, 3)
            V = vb.view(kvh, B, T, hd).permute(1, 0, 2, 3)
            if pack_t is not None:
                qp = q.new_zeros(B * qmax, nh, hd).index_copy_(0, pack_t, q)
            else:
                qp = q
            Q = qp.view(B, qmax, kvh, g, hd).permute(0, 2, 3, 1, 4).reshape(B, kvh, g * qmax, hd)
            o = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, scale=scale)
            o = o.view(B, kvh, g, qmax, hd).permute(0, 3, 1, 2, 4).reshape(B * qmax, nh * hd)
            if pack_t is not None:
                o = o.index_select(0, pack_t)
            return o

        return attend

    # ---- results ------------------------------------------------------------------------------
    def _result(self, s: _Seq) -> RequestResult:
        s.plan.steps = s.cycles + 1 if s.out else 0  # the prefill's step emitted a token too
        return RequestResult(
            req_id=s.req.req_id,
            tokens=list(s.out),
            finish_reason=s.finish_reason,
            cycles=s.cycles,
            decode_tokens=len(s.out) - 1 if s.out else 0,
            prefill_s=s.prefill_s,
            report=s.plan.report(),
        )
