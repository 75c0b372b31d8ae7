"""One request's plan, whatever engine runs it: admission, acceptance bookkeeping and the report.

Both runtimes (the reference executor and vLLM's hook) hold a `PlanSession` per request and ask
it the same questions: does the plan run, on which engine blocks and pages, with which k and
acceptance rule; what did its drafts do. The engine's part is only what it lets a plan do
(`EngineRules`: its block size, the most drafts a cycle may write, the proxies it computes, ...),
stated once where the engine starts, so that an exception to a plan's own rules is an explicit
rule here, never a branch in one runtime. The session is torch-free: its tests run without an
engine (tests/runtime/test_session.py).

A request's statistics leave the session as one `RunReport`, which `kapc run`, `kapc bench`, the
benchmarks and the server's `/kapc/stats` all read.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kapc.errors import KapcError, bounded
from kapc.lower.kapb import Plan, check_plan_matches, decode_plan
from kapc.policy import (
    AcceptanceMonitor,
    AccessPolicy,
    AccessView,
    DraftRow,
    PolicyError,
    access_problem,
    access_view,
    admit,
    engine_blocks,
    estimated_p,
    moved_blocks,
    parse_accept,
    visible_tokens,
)

# The keys of a request's options where an engine carries them (vLLM: SamplingParams.extra_args;
# the OpenAI server: `vllm_xargs`)
PLAN_KEY = "kapc_plan"  # the .kapb bytes (base64 text through the OpenAI server)
PRIOR_KEY = "kapc_prior"  # the frontend's prior, compiled by the engine's worker
TAG_KEY = "kapc_tag"  # a caller-chosen name the request's report is filed under
OPTS_KEY = "kapc_opts"  # RequestOptions, as an object or its JSON text

KEPT_FINISHED = 10_000  # finished requests' reports a long-running engine keeps, oldest dropped


class RequestOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What a request may change of its plan's rules. `k` (None or 0: the plan's) and `accept`
    ("greedy", "topN") override the plan's (k=0: no drafts); `honor_predicted_loss=False` drafts where the cost
    model predicts a loss (to measure it); `min_acceptance=False` turns the plan's acceptance
    floor off; `access` replaces the plan's access policy; `max_view_blocks` caps the draft
    view's width in blocks (an engine whose draft path is captured for a fixed width)."""

    honor_predicted_loss: bool = True
    k: int | None = None
    min_acceptance: bool = True
    accept: str | None = None
    access: AccessPolicy | None = None
    max_view_blocks: int | None = None


def request_options(value) -> RequestOptions:
    """A request's options: an object, or (through the OpenAI server's `vllm_xargs`, which carry
    strings) its JSON text. Raises PolicyError naming what is wrong."""
    if value is None:
        return RequestOptions()
    if isinstance(value, RequestOptions):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise PolicyError(f"{OPTS_KEY} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise PolicyError(f"{OPTS_KEY} must be an object, not {type(value).__name__}")
    try:
        opts = msgspec.convert(value, RequestOptions)
    except msgspec.ValidationError as exc:
        raise PolicyError(f"{OPTS_KEY}: {bounded(str(exc))}") from None
    if opts.max_view_blocks is not None and opts.max_view_blocks < 1:
        raise PolicyError(f"{OPTS_KEY}: max_view_blocks must be a positive number of blocks")
    return opts


@dataclass(frozen=True)
class EngineRules:
    """What an engine lets a plan do, stated where the engine starts.

    `fingerprint` returns the engine model's fingerprint (raising PlanMismatch when it cannot be
    computed: a plan is refused, never admitted unchecked). `k` caps every plan's k (vLLM fixes
    the drafts per cycle at start); `workspace_blocks` is the widest draft view the engine holds
    for a request (None: no limit). `profiled`: a calibration profile prices every step, so the
    plan's compile-time loss prediction and acceptance floor, set for the batch it was compiled
    for, do not decide; the step planner does, with the real batch. `proxy_problem`: why the
    engine cannot compute EarlySelectKV proxies (None: it can), and `keys_unreadable` why it
    cannot read keys for query-aware pages at all (those plans then read their static pages)."""

    block_size: int
    layers: int
    fingerprint: Callable[[], str]
    k: int | None = None
    workspace_blocks: int | None = None
    profiled: bool = False
    proxy_problem: str | None = None
    keys_unreadable: str | None = None

    def workspace(self, opts: RequestOptions) -> int | None:
        caps = [c for c in (self.workspace_blocks, opts.max_view_blocks) if c is not None]
        return min(caps) if caps else None


class RunReport(msgspec.Struct, kw_only=True):
    """One request's plan run, as every runtime and the server report it.

    `status`: "plan" (drafting, or ran to the end drafting), "fallback" (decodes with the full
    context: `reason`), "refused" (the plan cannot apply: `reason`), "none" (no plan), "off"
    (a plan sent to an engine started without kapc's hook), "compiling" (its prior's plan was
    not compiled yet: it decodes with the full context until it is, or to the end). `ran`: the
    plan was admitted to draft (a later fallback keeps it True). `proposed` and `accepted` count
    verified drafts; `draft_cycles` the cycles that drafted, `steps` the engine steps that emitted
    tokens for the request (its prefill's included); `held` the steps the step planner kept it
    from drafting; `block_moves` the times the engine moved its prompt's KV blocks under the
    plan (preempted and recomputed it)."""

    tag: str
    status: str = "none"
    reason: str | None = None
    note: str | None = None  # what the runtime adapted (another block size), not a fallback
    plan: str | None = None
    source: str | None = None  # "kapb" or "prior" (compiled by the engine's worker)
    ran: bool = False
    prompt_tokens: int = 0
    visible_prompt_tokens: int = 0
    retained_ratio: float | None = None  # what the drafts read of the prompt
    plan_retained_ratio: float | None = None
    accept: str | None = None
    k: int = 0
    access: str = "static"
    proposed: int = 0
    accepted: int = 0
    acceptance_rate: float | None = None
    accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    draft_cycles: int = 0
    steps: int = 0
    held: int = 0
    block_moves: int = 0
    speedup_predicted: float | None = None
    compile_s: float | None = None  # seconds the request waited for its prior's plan
    compile_cached: bool = False

    def as_dict(self) -> dict:
        return msgspec.structs.asdict(self)


_serials = itertools.count(1)


@dataclass
class PlanSession:
    """A request's plan in one runtime: what admission decided and what its drafts did since."""

    tag: str
    prompt_tokens: int = 0
    # tokens the request holds when its length limit stops it (None: none known): drafts past
    # the last token it may emit are forwards spent for nothing
    end_tokens: int | None = None
    # token ids that end it when sampled (its EOS unless ignored, its stop token ids)
    stop_ids: frozenset[int] = frozenset()
    status: str = "none"
    reason: str | None = None
    note: str | None = None
    error: KapcError | None = None  # why the plan was refused, for runtimes that raise it
    source: str | None = None
    plan: Plan | None = None
    ran: bool = False
    selected: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    tail_block: int = 0  # the engine block holding the last prompt token
    static_visible: int = 0  # prompt tokens the plan's own pages show
    visible_prompt_tokens: int = 0
    retained_ratio: float | None = None
    accept: str | None = None
    topn: int = 1  # 1: greedy (lossless); N > 1: a draft within the target's top N is accepted
    k: int = 0
    forced: bool = False  # drafts whenever it can, against the cost model's advice
    prior_p: float = 0.0  # the plan's predicted per-draft acceptance
    access: AccessPolicy | None = None  # a dynamic or hybrid policy (None: static pages)
    view: AccessView | None = None  # the blocks a dynamic or hybrid view reads
    # the prompt's full blocks' key bounds (query-aware): the reference executor's (min, max,
    # pool blocks), vLLM's hook the pool blocks whose bounds it checked in its store
    bounds: Any = None
    prompt_blocks: list[int] | None = None  # the engine's blocks of its prompt, last seen
    block_moves: int = 0
    monitor: AcceptanceMonitor | None = None
    proposed: int = 0
    accepted: int = 0
    tried: int = 0  # drafts verified that could have been accepted (up to the first rejection)
    draft_cycles: int = 0
    steps: int = 0
    held: int = 0
    last_drafted: int = 0  # drafts of the newest cycle, not verified yet
    per_pos: list[int] = field(default_factory=list)
    compile_s: float | None = None
    compile_cached: bool = False
    compiling_plan: Any = None  # the compile of its prior, while it runs (a Future)
    serial: int = field(default_factory=lambda: next(_serials))  # unique for the process

    def ends_with(self, sampled: Sequence[int], tokens: int) -> bool:
        """Whether a step that sampled `sampled` for it, leaving it `tokens` long, ends it: a
        stop token among them, or its length limit reached (stop strings, matched on text
        later, are not seen here)."""
        if not sampled:
            return False
        hit_limit = self.end_tokens is not None and tokens >= self.end_tokens
        return hit_limit or not self.stop_ids.isdisjoint(sampled)

    # ---- admission ---------------------------------------------------------------------------
    def refuse(self, reason: str, error: KapcError | None = None) -> None:
        self.status, self.reason, self.error = "refused", reason, error

    def compiling(self, pending) -> None:
        """Its prior's plan is being compiled off the engine's step (`pending`, a Future): it
        decodes with the full context until the plan is admitted."""
        self.status, self.reason = "compiling", "its prior's plan is being compiled"
        self.compiling_plan = pending

    @property
    def compiled(self) -> bool:
        """Whether the compile it waits for has finished (admit it now)."""
        return self.compiling_plan is not None and self.compiling_plan.done()

    def admit(
        self,
        plan: Plan | bytes,
        prompt_ids,
        opts: RequestOptions,
        engine: EngineRules,
        *,
        random_sampling: bool = False,
    ) -> None:
        """Check the plan against the engine and the request, and decide whether it drafts
        (kapc.policy.admit); a plan that cannot apply is refused with the reason."""
        try:
            self._admit(plan, prompt_ids, opts, engine, random_sampling)
        except KapcError as exc:
            self.refuse(f"plan refused: {exc}", exc)

    def _admit(
        self, plan, prompt_ids, opts: RequestOptions, engine: EngineRules, random_sampling: bool
    ) -> None:
        if not isinstance(plan, Plan):
            plan = decode_plan(bytes(plan), "<request plan>")
        ids = np.asarray(prompt_ids, dtype=np.int32).reshape(-1)
        check_plan_matches(plan, model_fingerprint=engine.fingerprint(), prompt_token_ids=ids)
        h, P, bs = plan.header, int(ids.size), engine.block_size
        self.plan, self.prompt_tokens = plan, P
        # a plan compiled for another block size runs on the engine's blocks (kapc.policy)
        blocks = engine_blocks(plan.positions, P, bs)
        self.selected, self.tail_block = blocks[:-1], int(blocks[-1])
        self.visible_prompt_tokens = self.static_visible = visible_tokens(blocks, P, bs)
        self._admit_access(opts.access or h.access, blocks, engine)
        self.retained_ratio = self.visible_prompt_tokens / P
        verdict = admit(
            h,
            retained=self.retained_ratio,
            k=opts.k,
            engine_k=engine.k,
            accept=opts.accept,
            honor_predicted_loss=opts.honor_predicted_loss and not engine.profiled,
            random_sampling=random_sampling,
            view_blocks=self.view.keep + 1 if self.view is not None else len(blocks),
            workspace_blocks=engine.workspace(opts),
        )
        self.accept, self.topn, self.k = verdict.accept, verdict.topn, verdict.k
        if h.block_size != bs:
            self.noted(
                f"plan compiled for block size {h.block_size}, run on the engine's {bs} "
                f"(s {h.retained_ratio:.3f} -> {self.retained_ratio:.3f})"
            )
        asked = opts.accept or h.accept
        if random_sampling and parse_accept(asked) > 1:
            self.noted(
                f"{asked} off: a sampled request's drafts are verified by rejection sampling, "
                f"which keeps the model's distribution"
            )
        self.forced = not opts.honor_predicted_loss
        self.prior_p = float(h.cost.p) if h.cost.p is not None else float(h.cost.h)
        fb = h.fallback
        floor = fb.min_acceptance if opts.min_acceptance and not engine.profiled else 0.0
        self.monitor = AcceptanceMonitor(floor, fb.acceptance_window)
        if verdict.runs:
            self.status, self.ran, self.per_pos = "plan", True, [0] * self.k
        else:
            self.status, self.reason = "fallback", verdict.reason

    def noted(self, text: str) -> None:
        """Add to the request's note (what its run changed of the plan, and why)."""
        self.note = f"{self.note}; {text}" if self.note else text

    def _admit_access(self, access: AccessPolicy, blocks: np.ndarray, engine: EngineRules):
        """A dynamic or hybrid access policy: the blocks its view reads (kapc.policy)."""
        if access.mode == "static":
            return
        problem = access_problem(access, engine.layers)
        if problem:
            raise PolicyError(problem)
        if access.proxy != "query" and engine.proxy_problem:
            raise PolicyError(f"access proxy {access.proxy}: {engine.proxy_problem}")
        if engine.keys_unreadable:
            self.noted(f"static pages: {engine.keys_unreadable}")
            return
        self.access = access
        self.view = access_view(access, blocks, self.prompt_tokens, engine.block_size)
        self.visible_prompt_tokens = self.view.visible

    def static_again(self, why: str) -> None:
        """Query-aware pages off for this request (keys unreadable, page choice failed): it
        drafts on its plan's own pages from now on."""
        if self.access is None:
            return
        self.access = self.view = self.bounds = None
        self.visible_prompt_tokens = self.static_visible
        self.retained_ratio = self.visible_prompt_tokens / self.prompt_tokens
        self.noted(f"static pages: {why}")

    # ---- drafting ----------------------------------------------------------------------------
    @property
    def drafting(self) -> bool:
        return self.status == "plan"

    def fall_back(self, reason: str) -> None:
        """Plain decoding from now on: the drafts of the newest cycle are never verified."""
        self.status, self.reason, self.last_drafted = "fallback", reason, 0

    def check_blocks(self, blocks) -> bool:
        """Check where the engine keeps the request's prompt now (`blocks`: its block table,
        prompt first) and return whether the plan still drafts. When the prompt's blocks moved
        since they were last seen (the engine preempted the request and recomputed it elsewhere),
        the key bounds read from the old blocks are dropped, to be read again, and past
        `kapc.policy.moved_blocks`'s limit the plan falls back."""
        now = list(blocks[: self.tail_block + 1])  # a list slice: checked at every draft
        before, self.prompt_blocks = self.prompt_blocks, now
        if before is not None and before != now:
            self.block_moves += 1
            self.bounds = None
            reason = moved_blocks(self.block_moves)
            if reason and self.drafting:
                self.fall_back(reason)
        return self.drafting

    def draft_row(self, drafts: int, context: int) -> DraftRow:
        """This request as the step planner weighs it: up to `drafts` drafts over a full context
        of `context` tokens, at the acceptance it has shown so far."""
        return DraftRow(
            p=estimated_p(self.prior_p, self.accepted, self.tried),
            k=drafts,
            s=self.retained_ratio or 1.0,
            context=context,
            chooses_pages=self.access is not None,
            tolerant=self.topn > 1,
        )

    def drafted(self, n: int) -> None:
        """A cycle proposed `n` drafts, verified at the request's next step."""
        self.last_drafted = n
        self.proposed += n
        self.draft_cycles += 1

    def verified(self, accepted: int) -> None:
        """Book the verification of the newest cycle's drafts, `accepted` of them accepted: the
        counts (per position too) and the acceptance monitor's verdict."""
        d, self.last_drafted = self.last_drafted, 0
        if not d:
            return
        a = max(0, min(d, accepted))
        self.accepted += a
        self.tried += min(d, a + 1)
        for j in range(a):
            self.per_pos[j] += 1
        reason = self.monitor.record(d, a) if self.monitor is not None else None
        if reason and self.status == "plan":
            self.status, self.reason = "fallback", reason

    def sampled(self, tokens: int) -> None:
        """An engine step emitted `tokens` tokens for the request (vLLM's view: every token but
        the last of a verified cycle is an accepted draft)."""
        if tokens:
            self.steps += 1
        self.verified(accepted_of(self.last_drafted, tokens))

    # ---- the report --------------------------------------------------------------------------
    def report(self) -> RunReport:
        # drafts of the newest cycle are not verified yet (or never will be, when the request
        # finished at that step): they count neither as proposed nor as accepted
        proposed = self.proposed - self.last_drafted
        h = self.plan.header if self.plan is not None else None
        return RunReport(
            tag=self.tag,
            status=self.status,
            reason=self.reason,
            note=self.note,
            plan=h.name if h else None,
            source=self.source,
            ran=self.ran,
            prompt_tokens=self.prompt_tokens,
            visible_prompt_tokens=self.visible_prompt_tokens,
            retained_ratio=self.retained_ratio,
            plan_retained_ratio=float(h.retained_ratio) if h else None,
            accept=self.accept,
            k=self.k,
            access=self.access.mode if self.access is not None else "static",
            proposed=proposed,
            accepted=self.accepted,
            acceptance_rate=self.accepted / proposed if proposed else None,
            accepted_per_pos=list(self.per_pos),
            draft_cycles=self.draft_cycles,
            steps=self.steps,
            held=self.held,
            block_moves=self.block_moves,
            speedup_predicted=float(h.cost.speedup) if h else None,
            compile_s=self.compile_s,
            compile_cached=self.compile_cached,
        )


def accepted_of(drafted: int, sampled: int) -> int:
    """Drafts accepted in a step that sampled `sampled` tokens for a row that drafted `drafted`:
    every sampled token but the last (the bonus or the correction) is an accepted draft."""
    return max(0, min(drafted, sampled - 1))


def remember(finished: OrderedDict, tag: Hashable, report, keep: int = KEPT_FINISHED) -> None:
    """File a finished request's report under its tag (or any value under its key), newest last,
    keeping the newest `keep`: a server runs for weeks."""
    finished[tag] = report
    finished.move_to_end(tag)
    while len(finished) > keep:
        finished.popitem(last=False)


def finished_line(r: RunReport) -> str:
    """One log line of a finished request's figures, filed under its tag."""
    parts = [f"kapc request {r.tag}: {r.status}"]
    if r.source:
        parts.append(f"plan from {r.source}")
    if r.compile_s is not None:
        parts.append("compile cached" if r.compile_cached else f"compile {r.compile_s:.3f}s")
    if r.retained_ratio is not None:
        parts.append(f"s {r.retained_ratio:.3f}")
    if r.k:
        parts.append(f"k {r.k} {r.accept}")
    parts.append(f"proposed {r.proposed} accepted {r.accepted}")
    if r.reason:
        parts.append(f"reason: {r.reason}")
    return ", ".join(parts)


# Why plans stop or never start, as few labels as a metrics system wants (first match wins)
FALLBACK_CAUSES = (
    ("predicts no gain", "cost_model"),
    ("retained ratio", "retained_ratio"),
    ("prior confidence", "prior_confidence"),
    ("workspace", "workspace"),
    ("metadata stability", "metadata_stability"),
    ("observed acceptance", "acceptance"),
    ("hook failed", "hook_failure"),
    ("proposal length", "no_drafts"),
)


def fallback_cause(reason: str | None) -> str:
    """A fallback's reason as one of a few labels (`FALLBACK_CAUSES`, else "other")."""
    return next((label for text, label in FALLBACK_CAUSES if text in (reason or "")), "other")


class ServedTotals(msgspec.Struct):
    """What an engine's plans did since it started, summed over the requests that have left its
    batch: what a server exports to Prometheus (`/metrics`)."""

    requests: dict[str, int] = msgspec.field(default_factory=dict)  # by final status
    fallbacks: dict[str, int] = msgspec.field(default_factory=dict)  # by cause (fallback_cause)
    proposed: int = 0
    accepted: int = 0
    draft_cycles: int = 0
    held_steps: int = 0
    compiles: int = 0  # priors compiled (not taken from the cache)
    compile_s: float = 0.0

    def count(self, r: RunReport) -> None:
        self.requests[r.status] = self.requests.get(r.status, 0) + 1
        if r.status == "fallback":
            cause = fallback_cause(r.reason)
            self.fallbacks[cause] = self.fallbacks.get(cause, 0) + 1
        self.proposed += r.proposed
        self.accepted += r.accepted
        self.draft_cycles += r.draft_cycles
        self.held_steps += r.held
        if r.compile_s is not None and not r.compile_cached:
            self.compiles += 1
            self.compile_s += r.compile_s


def failure(where: str, exc: Exception) -> str:
    """A request's reason for losing its plan to a failure inside a runtime, at a readable
    length."""
    text = str(exc)
    text = text if len(text) <= 200 else text[:200] + f"... ({len(text)} characters)"
    return f"kapc's hook failed in {where} ({type(exc).__name__}: {text})"
