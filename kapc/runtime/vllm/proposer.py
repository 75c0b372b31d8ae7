"""The proposer vLLM loads through `speculative_config={"method": "custom_class", ...}`.

It runs in the worker process, inside `GPUModelRunner.propose_draft_token_ids` (after the step's
verification forward and bookkeeping, under inference mode). For every request whose
SamplingParams carry a `.kapb` plan (`extra_args["kapc_plan"]`), or a prior the worker compiles
(`extra_args["kapc_prior"]`, kapc.runtime.vllm.admission), it drafts up to k tokens with the
TARGET model's own forward over a compact block table:

    [real block of each selected full prompt block] + [real blocks from the one holding the last
    prompt token to the one holding the current position]

so the attention kernel, which reads a table row as one contiguous sequence, sees only the
selected prompt KV plus everything generated so far, with `seq_lens` = visible tokens and the
TRUE logical positions (rotary embeddings were applied before the keys were cached). All plan
rows of the step share one batched forward per draft step.

Draft KV is written into the request's own slots for the positions it drafts (P .. P+k-1, P the
position of the newest sampled token). Those slots hold nothing committed: the next verification
rewrites P .. P+k before anything reads them. The scheduler subclass in
`kapc.runtime.vllm.scheduler` reserves k lookahead slots so that those positions lie inside the
request's allocated blocks; a row whose next draft position would fall outside them stops
drafting there (it never writes through stale block-table entries).

What is not about tensors lives elsewhere: each request's admission and bookkeeping in its
`PlanSession` (kapc.runtime.session), which rows draft in the `StepPlanner`
(kapc.runtime.planner), the engine's one-time setup in `EngineSetup`, query-aware pages in
`KeyPages`. A failure inside the hook costs the requests it touched their plans (the reason in
their reports, one log line per kind), never the engine step.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch

from kapc.runtime.planner import Candidate, DraftCost, Ends, StepPlanner
from kapc.runtime.session import (
    OPTS_KEY,
    PLAN_KEY,
    PRIOR_KEY,
    TAG_KEY,
    EngineRules,
    PlanSession,
    RunReport,
    ServedTotals,
    failure,
    finished_line,
    remember,
)
from kapc.runtime.vllm import compat, engine_kind
from kapc.runtime.vllm.admission import (
    PlanCompiler,
    admit_request,
    compile_early,
    start_compiling,
)
from kapc.runtime.vllm.compat import UnsupportedAttention
from kapc.runtime.vllm.draft_inputs import DraftInputs, StepInputs, routed_rows
from kapc.runtime.vllm.engine_setup import EngineSetup, check_model
from kapc.runtime.vllm.keys import KeyPages
from kapc.runtime.vllm.scheduler import step_arrivals, step_load
from kapc.runtime.vllm.views import compact_row, draft_budget, view_blocks

# under vLLM's logger, so the lines reach the server's log with its format and level
log = logging.getLogger("vllm.kapc")

__all__ = ["KapProposer", "PLAN_KEY", "PRIOR_KEY", "TAG_KEY", "OPTS_KEY"]

# ES proxies project an earlier layer's state through this layer's query weights; vLLM's fused
# decoder layers hand a forward pre-hook only the layer's own query
PROXY_PROBLEM = (
    "EarlySelectKV proxies need each layer's input or post-attention state, which vLLM's "
    "fused forward does not expose to kapc's hook; use proxy=query here (the reference "
    "executor computes es-in, es-mid and es-mix)"
)
NOT_YET = "not yet known (set at the first proposal)"
NOT_SET_UP = {"attention_kernel": NOT_YET, "draft_weights": NOT_YET, "kernel_choices": {}}


class KapProposer:
    """vLLM `custom_class` proposer driven by kapc plans. Never name an attribute `model`: vLLM
    would then treat this object as a separate draft model."""

    def __init__(self, vllm_config):
        check_model(vllm_config)
        self.vllm_config = vllm_config
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self._target = None
        self._runner = None
        self.setup: EngineSetup | None = None
        self.keys: KeyPages | None = None
        self.planner = StepPlanner()
        self.sessions: dict[str, PlanSession] = {}  # by vLLM request id
        # reports of requests no longer in the batch, by tag; bounded (session.KEPT_FINISHED)
        self.finished: OrderedDict[str, RunReport] = OrderedDict()
        self.totals = ServedTotals()  # over every finished request, for /metrics
        # priors' plans, compiled in a process of their own from each request's arrival
        model, threads = str(vllm_config.model_config.model), torch.get_num_threads()
        self._compiler = PlanCompiler(model, self.block_size, engine_kind(), threads=threads)
        self._compiler.warm()
        compile_early(self._compiler)
        self._failures: set[tuple[str, str]] = set()  # (what failed, exception type), logged

    # ---- vLLM interface ---------------------------------------------------------------------
    def load_model(self, target_model) -> None:
        self._target = target_model

    def bind(self, runner) -> None:
        """Top-N tolerant acceptance, through vLLM's own rejection sampler: before it runs, a
        draft token of a top-N row that lies within the target's top N at its position gets its
        target logit raised above the row's maximum, so the greedy comparison accepts it and
        emits it. Greedy rows and the bonus positions are left untouched (lossless stays
        lossless); the first rejected position still yields the target's own argmax. Sampled
        rows are never raised: their drafts are accepted by rejection sampling
        (`kapc.policy.SAMPLED`)."""
        self._runner = runner
        compat.before_rejection_sampling(runner, self._raise_tolerated)
        compat.sampled_verification_on_cpu()

    def _raise_tolerated(self, draft_rows, logits) -> None:
        if not any(s.topn > 1 for s in self.sessions.values()):
            return
        req_ids = compat.batch_request_ids(self._runner)
        for row, li, drafts in draft_rows:
            s = self.sessions.get(req_ids[row]) if row < len(req_ids) else None
            if s is None or s.topn <= 1:
                continue
            d = drafts.to(torch.long)
            target = logits[li].float()
            within = (target.topk(s.topn, dim=-1).indices == d[:, None]).any(-1)
            if bool(within.any()):
                li, d = li[within], d[within]
                logits[li, d] = (target[within].max(-1).values + 1.0).to(logits.dtype)

    def _get_runner(self):
        if self._runner is None:  # a server never calls kapc_bind: bind on the first proposal
            self.bind(compat.find_runner(self, depth=3))
        return self._runner

    def _setup(self, runner) -> None:
        if self.setup is not None:
            return
        layout = compat.attention_layout(runner)
        self.keys = KeyPages(self.vllm_config, layout)
        self.setup = EngineSetup(
            self.vllm_config, runner, self.keys.before_attention, self.planner.kernel_step
        )
        self.block_size = self.setup.block_size
        profile = self.setup.find_profile()
        self.setup.check_profile(profile)
        self.planner.use(profile)

    def use_profile(self, source: str = "auto", online: bool = True) -> str | None:
        """Decide steps with a profile: "auto" (this machine's calibration for the model, if
        any), "none" (each plan's own rules only) or a profile file's path, which must be for
        this model. `online`: scale the profile by the step times this engine measures; off, its
        figures decide as written. Returns the profile's key, or None. Applies to requests
        admitted from now."""
        self._setup(self._get_runner())
        profile = self.setup.load_profile(source)
        self.planner.use(profile, online)
        return profile.key if profile is not None else None

    # ---- admission --------------------------------------------------------------------------
    def _session_for(self, req_id: str, req) -> PlanSession:
        """The request's session, admitted at its first step (or, its prior's plan compiling
        then, at the first step after the plan is ready)."""
        s = self.sessions.get(req_id)
        if s is not None and not s.compiled:
            return s
        sp = req.sampling_params
        extra = (sp.extra_args or {}) if sp else {}
        if s is None:
            s = self.sessions[req_id] = PlanSession(tag=str(extra.get(TAG_KEY, req_id)))
            s.prompt_tokens = len(req.prompt_token_ids or ())
            s.end_tokens, s.stop_ids = compat.request_ends(sp, s.prompt_tokens)
        try:
            self._admit_request(s, req, extra)
        except Exception as exc:  # noqa: BLE001 - one request's plan must not stop the engine
            self._hook_failed("admitting a plan", exc)
            s.refuse(f"plan refused: {failure('admission', exc)}")
        return s

    def _admit_request(self, s: PlanSession, req, extra: dict) -> None:
        ids, sp = req.prompt_token_ids, req.sampling_params
        admit_request(s, extra, ids, self._rules, lambda: self._compiler, sp)

    def _rules(self) -> EngineRules:
        return EngineRules(
            block_size=self.block_size,
            layers=len(self.setup.layout.layer_names),
            fingerprint=self.setup.fingerprint,
            k=self.k,
            workspace_blocks=-(-self.max_model_len // self.block_size),
            profiled=self.planner.profile is not None,
            proxy_problem=PROXY_PROBLEM,
            keys_unreadable=self.keys.unreadable,
        )

    # ---- statistics -------------------------------------------------------------------------
    def _prune(self, runner) -> None:
        live = compat.live_request_ids(runner)
        for rid in [r for r in self.sessions if r not in live]:
            report = self.sessions.pop(rid).report()
            remember(self.finished, report.tag, report)
            self.totals.count(report)
            if report.source is not None:
                log.info(finished_line(report))

    def stats(self, pop: bool = False, tag: str | None = None) -> dict:
        """Per-request reports by tag (only `tag`'s when given), the hook's timings, the step
        policy in force and `live`: the requests the proposer holds sessions for (those in the
        engine's batch)."""
        reports = dict(self.finished)
        reports.update((s.tag, s.report()) for s in self.sessions.values())
        if tag is not None:
            reports = {tag: reports[tag]} if tag in reports else {}
        if pop:
            self.finished.clear()
        return {
            "requests": {t: r.as_dict() for t, r in reports.items()},
            **self.planner.stats(pop=pop),
            "live": len(self.sessions),
            **(self.setup.report() if self.setup else NOT_SET_UP),
        }

    # ---- the proposal -----------------------------------------------------------------------
    def propose(
        self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_
    ):
        called = time.perf_counter()
        runner = self._get_runner()
        self._setup(runner)
        self._prune(runner)
        n = len(sampled_token_ids)
        req_ids = compat.batch_request_ids(runner)[:n]
        contexts = [int(num_tokens_no_spec[row]) for row in range(n)]
        self.planner.step_done(called, req_ids, [len(t) for t in sampled_token_ids])
        step = compat.step_schedule()
        start_compiling(*compat.new_request_args(step))  # plans compile during their prefill
        rows, ends = self._candidates(runner, req_ids, sampled_token_ids, contexts)
        if rows:
            drafting = {r.row for r in rows}
            others = [c for row, c in enumerate(contexts) if row not in drafting]
            rows = self.planner.plan(rows, others, step_load(step), step_arrivals(step), ends)
        rows, drafts, cost = self._draft_rows(rows, token_ids_cpu)
        out: list[list[int]] = [[] for _ in range(n)]
        for r, d in zip(rows, drafts):
            out[r.row] = d
        written = {r.row: len(d) for r, d in zip(rows, drafts)}
        self.planner.call_done(called, time.perf_counter(), req_ids, contexts, rows, written, cost)
        return out

    def _candidates(self, runner, req_ids, sampled, contexts) -> tuple[list[Candidate], Ends]:
        """Book what the last step emitted for every request; return the rows that may draft
        now, each with the most drafts the engine allows, and the requests it began and ended."""
        rows, firsts, lasts = [], 0, 0
        for row, rid in enumerate(req_ids):
            req = compat.batch_request(runner, rid)
            if req is None:
                continue
            s = self._session_for(rid, req)
            s.sampled(len(sampled[row]))
            firsts += s.steps == 1 and bool(sampled[row])
            lasts += s.ends_with(sampled[row], contexts[row])
            position = contexts[row] - 1  # of the newest sampled token
            if not s.drafting or not sampled[row] or position < s.prompt_tokens:
                continue
            blocks = req.block_ids[0]
            budget = draft_budget(
                s.k, len(blocks), self.block_size, position, self.max_model_len, s.end_tokens
            )
            if budget >= 1 and s.check_blocks(blocks):
                rows.append(Candidate(row, s, position, budget, blocks))
        return rows, Ends(firsts, lasts)

    def _draft_rows(self, rows: list[Candidate], token_ids_cpu):
        """Draft `rows`; a failure costs them their plans (the engine step goes on)."""
        cost = DraftCost()
        if not rows:
            return rows, [], cost
        try:
            drafts = self._draft(rows, token_ids_cpu, cost)
        except Exception as exc:  # noqa: BLE001 - a failed draft costs its rows their plans
            self.keys.router, self.keys.probing = None, False
            self._hook_failed("drafting", exc)
            for r in rows:
                r.session.fall_back(failure("drafting", exc))
            return [], [], cost
        for r, d in zip(rows, drafts or ()):
            r.session.drafted(len(d))
        return (rows, drafts, cost) if drafts is not None else ([], [], cost)

    def _draft(self, rows: list[Candidate], token_ids_cpu, cost: DraftCost) -> list | None:
        """Up to `drafts` drafts per row, one batched forward per draft step for every row still
        drafting, each over its own compact view; inputs built once and advanced on the device
        (draft_inputs), drafts read back once. None: a newcomer stopped the cycle (its drafts so
        far dropped: StepPlanner.stops_for_arrival), the forwards counting as the hook's work."""
        dyn = [i for i, r in enumerate(rows) if r.session.access is not None]
        # where this engine keeps keys is found from the first draft forward of a query-aware
        # row, before any bound is read: that cycle drafts on the plans' own pages
        probing = bool(dyn) and not self.keys.known
        self.keys.probing = probing
        router = self._router([rows[i] for i in dyn]) if dyn and not probing else None
        cost.select_predicted = self.planner.page_choice([rows[i] for i in dyn])
        began = time.perf_counter()
        inputs = self._draft_inputs(rows, token_ids_cpu, static=probing)
        routed, routed_for = None, None
        for step in range(max(r.drafts for r in rows)):
            if step and self.planner.stops_for_arrival(rows):
                return None
            live = inputs.live(step)
            if router is not None and live != routed_for:  # built again only as rows stop
                routed, routed_for = routed_rows(live, dyn, self._runner.device), live
            x = inputs.at(step)
            inputs.advance(step, self._draft_step(x, step, router, routed))
            cost.predicted += self.planner.draft_forward(
                len(live), sum(x.seq_lens_host) / len(live)
            )
            if probing and step == 0:
                self._found_keys(inputs.first_slots[0])
        drafts = inputs.drafts()
        cost.forward_s = time.perf_counter() - began
        if router is not None:
            cost.select_s = router.seconds
            self.planner.timings.select_choices += router.choices
        return drafts

    def _draft_inputs(self, rows: list[Candidate], token_ids_cpu, static: bool) -> DraftInputs:
        """A cycle's inputs: each row's compact table at its last draft position, and the
        slots its drafts write (`static`: every row reads its plan's own pages)."""
        tables, seq_lens, slots = [], [], []
        for r in rows:
            selected, tail = view_blocks(r.session, static=static), r.session.tail_block
            steps = [
                compact_row(selected, r.blocks, tail, r.position + j, self.block_size)
                for j in range(r.drafts)
            ]
            tables.append(steps[-1][0])
            seq_lens.append(steps[0][1])
            slots.append([slot for _, _, slot in steps])
        return DraftInputs(
            tables=tables,
            seq_lens=seq_lens,
            positions=[r.position for r in rows],
            slots=slots,
            tokens=[int(token_ids_cpu[r.row, r.position]) for r in rows],
            device=self._runner.device,
        )

    def _draft_step(self, x: StepInputs, step: int, router, routed):
        """One batched draft forward at draft step `step`; `routed`: the index tensors of the
        rows whose pages `router` chooses (`_routed`). Returns its drafts, on the device."""
        bind = None
        if routed is not None:
            bind = lambda t: router.bind(t, *routed)  # noqa: E731
        self.keys.router = router if bind is not None else None
        try:
            logits = compat.draft_logits(
                self._runner,
                self.vllm_config,
                self.setup.layout,
                x,
                step=step,
                on_block_table=bind,
                weights=self.setup.draft_copies,
            )
        finally:
            self.keys.router = None
        self.planner.timings.draft_forwards += 1
        self.planner.timings.draft_rows += len(x.seq_lens_host)
        return logits.argmax(dim=-1)

    # ---- query-aware pages ------------------------------------------------------------------
    def _router(self, rows: list[Candidate]):
        """The page choice of a cycle's query-aware rows, or None when their keys cannot be
        read (they draft on their plans' own pages)."""
        try:
            return self.keys.table_router(rows)
        except UnsupportedAttention as exc:  # a cache kapc cannot read: static pages
            self._keys_unreadable(str(exc))
        except Exception as exc:  # noqa: BLE001 - these rows draft on their plans' pages
            self._hook_failed("reading key bounds", exc)
            for r in rows:
                r.session.static_again(failure("key bounds", exc))
        return None

    def _found_keys(self, slot: int) -> None:
        why = self.keys.found_at(slot)
        if why is not None:
            self._keys_unreadable(why)

    def _keys_unreadable(self, why: str) -> None:
        """Query-aware pages off on this engine: every request drafts on its plan's pages."""
        self.keys.unreadable = why
        for s in self.sessions.values():
            s.static_again(why)

    def _hook_failed(self, doing: str, exc: Exception) -> None:
        """One log line (with the traceback) per kind of failure inside the hook: the engine
        keeps serving, and each request it touched says why in its report."""
        key = (doing, type(exc).__name__)
        if key not in self._failures:
            self._failures.add(key)
            log.exception("kapc: %s failed; the requests it touched decode without it", doing)
