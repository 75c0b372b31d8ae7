"""Which rows of an engine step draft, and how many tokens each: the step planner.

A runtime hands the planner, at every step, the rows that could draft (`Candidate`: the row, its
`PlanSession`, its position and the most drafts the engine allows it) and the contexts of the
rest of the batch. With a calibration profile the planner keeps the rows whose drafting pays for
the whole batch (kapc.policy.plan_step, on the profile scaled by the step times this engine
measures: kapc.policy.StepClock), and overrides that choice by two rules of the clock: one step
at rest now and then, timed, because a batch that always drafts never shows what drafting is
weighed against; and rest while drafting steps have lately delivered fewer tokens a second than
resting ones. Without a profile every candidate drafts (each plan's own rules decided at
admission). A batch larger than any the profile timed is not forecast (its step times would be
extrapolated): it decodes plainly until `kapc calibrate` has measured such batches. Rows the
caller marks `forced` draft whatever the profile says. With or without a
profile, forced or not, no row drafts before a step that prefills (the engine's `EngineLoad`:
kapc.policy.prefills_next) or in a step whose output begins or ends a request, and a cycle stops
drafting when a request arrives while it drafts (`stops_for_arrival`).

The planner also times each engine step against the profile (`step_done`), and keeps the hook's
timings (`HookTimings`) and one `StepRecord` per step for calibration. It is torch-free and
engine-free: tests/runtime/test_planner.py drives it with a real profile and no engine.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import msgspec

from kapc.policy import (
    EngineLoad,
    StepClock,
    engine_step,
    page_choice,
    plan_step,
    prefills_next,
    proposer_work,
    resting_kind,
    step_forecast,
    step_tokens,
    unplanned_step,
    verify_kind,
)
from kapc.runtime.session import PlanSession


@dataclass(frozen=True)
class Candidate:
    """A row that may draft this step: its index in the engine's batch, its session, the
    position of its newest token, the most drafts the engine allows it now, and what the engine
    needs to draft it (vLLM: the request's block ids)."""

    row: int
    session: PlanSession
    position: int
    drafts: int
    blocks: Any = None

    @property
    def context(self) -> int:
        return self.position + 1


class Ends(NamedTuple):
    """How many requests a step's output begins (carries their first token) and ends (their
    last: a stop token or the length limit)."""

    first: int = 0
    last: int = 0


NO_ENDS = Ends()


class HookTimings(msgspec.Struct):
    """What the hook's calls cost and what the profile expected of the steps they planned, summed
    since the statistics were last popped. `forecast_s`, `plain_forecast_s` and `forecast_tokens`
    are the profile's view of the steps that ran (at the acceptance it estimated) and of the
    engine's plain decoding of as many tokens; `forecast_from` is when the first of them began
    (time.monotonic), so a run's steps before it (its prefill's) count at what they took
    (kapc.policy.run_forecast)."""

    propose_s: float = 0.0  # inside the hook's calls
    calls: int = 0
    draft_forwards: int = 0
    draft_rows: int = 0  # rows over all draft forwards
    select_s: float = 0.0  # choosing query-aware pages, inside the draft forwards
    select_choices: int = 0  # layer choices made
    kernel_steps: int = 0  # engine forwards that ran kapc's attention kernel
    forecast_s: float = 0.0
    plain_forecast_s: float = 0.0
    forecast_tokens: float = 0.0
    forecast_from: float = 0.0
    rest_samples: int = 0  # steps held at rest to time a resting step
    held_by_rate: int = 0  # steps held because drafting steps delivered less lately
    held_to_compare: int = 0  # steps held at rest for the served steps' comparison
    held_by_prefill: int = 0  # steps held because the next step prefills (kapc.policy)
    # steps held, or draft cycles stopped and their drafts dropped, because a request arrived
    # after the step was scheduled and the next step will prefill it
    held_by_arrival: int = 0
    held_for_first_token: int = 0  # steps held because their output carries a first token
    held_for_last_token: int = 0  # steps held because their output ends a request
    held_beyond_profile: int = 0  # steps held because the batch is larger than the profile timed


class StepRecord(NamedTuple):
    """One engine step as the hook saw it, for calibration (kapc.runtime.calibrate.cycle_times):
    the time from one call's exit to the next call's entry is the rest of the step (verification
    forward, sampling, scheduling); a call less its forwards is the hook's own work."""

    entered: float
    left: float
    rows: int  # rows in the batch
    drafting: int  # rows that drafted
    steps: int  # draft forwards (the most drafts of a row)
    forward_s: float  # seconds inside those forwards
    select_s: float  # ... of which choosing query-aware pages


class _PendingStep(NamedTuple):
    """The engine step a call leaves behind, as far as the call knows it, to time against the
    profile at the next call."""

    called: float
    left: float
    req_ids: tuple
    queries: list[int]  # query tokens per row in the step (drafts + 1)
    contexts: list[int]
    tolerant: bool  # some row's drafts are checked by top-N acceptance


@dataclass
class DraftCost:
    """One call's draft forwards: seconds inside them and inside their page choice, and what the
    profile expected of both."""

    forward_s: float = 0.0
    select_s: float = 0.0
    predicted: float = 0.0
    select_predicted: float = 0.0


class StepPlanner:
    """The step policy of one engine (see the module's docstring)."""

    def __init__(self, profile=None, online: bool = True):
        self.timings = HookTimings()
        self.prefill_holds = 0  # steps held before a prefill since the engine started
        self.log: deque[StepRecord] = deque(maxlen=100_000)
        self._load: EngineLoad | None = None  # of the step last planned
        self._arrivals: Callable[[], int] | None = None
        self.use(profile, online)

    def use(self, profile, online: bool = True) -> None:
        """Decide with `profile` from now on (None: every candidate drafts), scaled by the step
        times this engine measures unless `online` is False."""
        self.profile = profile
        self.clock = StepClock(profile) if profile is not None and online else None
        self._pending: _PendingStep | None = None
        # whether the clock last let rows draft (the regime a step runs under, kept through the
        # steps held for prefills and first or last tokens); the last call's entry, the resting
        # step the profile prices its batch at, and the requests queued beside it
        self._drafting_regime = False
        self._last_call: tuple[float, float, int] | None = None

    @property
    def deciding(self):
        """The profile decisions are made on: scaled by the clock when it runs."""
        return self.clock.profile if self.clock is not None else self.profile

    def kernel_step(self) -> None:
        """An engine forward ran kapc's attention kernel."""
        self.timings.kernel_steps += 1

    def pop_timings(self) -> HookTimings:
        out, self.timings = self.timings, HookTimings()
        return out

    # ---- the plan of a step ------------------------------------------------------------------
    def plan(
        self,
        rows: list[Candidate],
        others: list[int],
        load: EngineLoad | None = None,
        arrivals: Callable[[], int] | None = None,
        ends: Ends = NO_ENDS,
    ) -> list[Candidate]:
        """The rows that draft this step, each capped at the drafts that pay (all of them
        without a profile), in batch order; `others` are the contexts of the rows that cannot
        draft, `load` what else the engine held when it scheduled the step, `arrivals()` how
        many requests it has received since (asked again as the rows draft:
        `stops_for_arrival`), `ends` the requests whose first or last token this step emits.
        Before a step that prefills no row drafts, nor in a step that emits a request's first or
        last token, forced or not (kapc.policy). Rows held back, but for those tokens, count a
        held step."""
        self._load, self._arrivals = load, arrivals
        if prefills_next(load):
            self.timings.held_by_prefill += 1
            self.prefill_holds += 1
            self._hold(rows)
            return []
        if self.stops_for_arrival(rows):
            return []
        if ends.first or ends.last:  # not held against the rows: every request has both
            if ends.first:
                self.timings.held_for_first_token += 1
            else:
                self.timings.held_for_last_token += 1
            return []
        if self.profile is None:
            return rows
        if len(rows) + len(others) > self.profile.largest_batch and self.profile.samples:
            # a batch the profile never timed: its forecast would be an extrapolation, and a
            # wrong one lands on every row; such a batch decodes plainly (forced rows draft)
            self.timings.held_beyond_profile += 1
            for r in rows:
                r.session.held += not r.session.forced
            return [r for r in rows if r.session.forced]
        if not self.timings.forecast_from:
            self.timings.forecast_from = time.monotonic()
        forced = [r for r in rows if r.session.forced]
        free = [r for r in rows if not r.session.forced]
        others = list(others)
        ks = plan_step(
            self.deciding,
            [r.session.draft_row(r.drafts, r.context) for r in free],
            others,
            fixed=[r.session.draft_row(r.drafts, r.context) for r in forced],
        )
        self._drafting_regime = bool(forced) or any(ks)
        if not forced and any(ks):
            ks = self._clock_rules(ks)
        kept = list(forced)
        for r, k in zip(free, ks):
            if k > 0:
                kept.append(replace(r, drafts=min(r.drafts, k)))
            else:
                r.session.held += 1
                others.append(r.context)
        kept.sort(key=lambda r: r.row)
        self._forecast([r.session.draft_row(r.drafts, r.context) for r in kept], others)
        return kept

    def stops_for_arrival(self, rows: list[Candidate]) -> bool:
        """Whether `rows`, about to draft or drafting, stop (their drafts made so far dropped):
        requests came in since the step `plan` planned was scheduled, and the next step will
        prefill one (kapc.policy.prefills_next)."""
        arrived = self._arrivals() if self._arrivals is not None else 0
        if not arrived or not prefills_next(self._load, arrived):
            return False
        self.timings.held_by_arrival += 1
        self.prefill_holds += 1
        self._hold(rows)
        return True

    @staticmethod
    def _hold(rows: list[Candidate]) -> None:
        for r in rows:
            r.session.held += 1

    def _clock_rules(self, ks: list[int]) -> list[int]:
        """The clock's overrides of a step the forecast would draft."""
        if self.clock is None:
            return ks
        if self.clock.wants_sample(resting_kind(self.profile)):
            self.timings.rest_samples += 1  # one step at rest, timed
            return [0] * len(ks)
        if self.clock.drafting_rests():
            # the forecast favours drafting, the steps lately did not: rest, longer each time
            # drafting loses again, then the forecast tries again (or rest to compare with)
            if self.clock.resting_to_compare:
                self.timings.held_to_compare += 1
            else:
                self.timings.held_by_rate += 1
            self._drafting_regime = False
            return [0] * len(ks)
        return ks

    def _forecast(self, drafting, others: list[int]) -> None:
        seconds, plain = step_forecast(self.profile, drafting, others)
        self.timings.forecast_s += seconds
        self.timings.plain_forecast_s += plain
        self.timings.forecast_tokens += step_tokens(drafting, others)

    # ---- what the profile expects of the draft forwards --------------------------------------
    def draft_forward(self, rows: int, mean_visible: float) -> float:
        return self.profile.seconds("draft", rows, mean_visible) if self.clock else 0.0

    def page_choice(self, rows: list[Candidate]) -> float:
        if self.clock is None or not rows:
            return 0.0
        return page_choice(
            self.profile,
            len(rows),
            sum(r.context for r in rows),
            max(r.drafts + 1 for r in rows),
        )

    # ---- timing the steps --------------------------------------------------------------------
    def step_done(self, entered: float, req_ids, sampled_counts: list[int]) -> None:
        """Time the engine step since the last call (verification or resting) against the
        profile, and the whole step since that call's entry against the tokens it emitted, when
        it ran just the rows that call left it: a step that also prefilled a new request, or
        lost one, is another kind of step."""
        if self.clock is None:
            return
        pending, self._pending = self._pending, None
        last, self._last_call = self._last_call, None
        if last is not None:  # every step, whole, for the served comparison
            held = len(req_ids) + last[2]
            self.clock.record_step(
                self._drafting_regime, sum(sampled_counts), entered - last[0], held, last[1]
            )
        self.clock.tick()
        if pending is None or tuple(req_ids) != pending.req_ids or not all(sampled_counts):
            return
        drafted = any(q > 1 for q in pending.queries)
        kind = (
            verify_kind(self.profile, pending.tolerant) if drafted else resting_kind(self.profile)
        )
        self.clock.record(
            kind,
            entered - pending.left,
            engine_step(self.profile, pending.queries, pending.contexts, pending.tolerant),
        )
        if drafted:
            rows = len(pending.contexts)
            self.clock.record_cycle(
                sum(sampled_counts),
                entered - pending.called,
                rows,
                unplanned_step(self.profile, rows, sum(pending.contexts) / max(1, rows)),
            )

    def call_done(
        self,
        called: float,
        left: float,
        req_ids,
        contexts: list[int],
        drafted: list[Candidate],
        drafts: dict[int, int],
        cost: DraftCost,
    ) -> None:
        """Book one call: its draft forwards against the profile, its own work, and the engine
        step it leaves behind (`drafts`: drafts written per batch row)."""
        t = self.timings
        t.propose_s += left - called
        t.calls += 1
        t.select_s += cost.select_s
        self.log.append(
            StepRecord(
                called,
                left,
                len(req_ids),
                len(drafted),
                max((r.drafts for r in drafted), default=0),
                cost.forward_s,
                cost.select_s,
            )
        )
        if self.clock is None:
            return
        if contexts:
            # requests admitted late are the cost of a regime too: counted beside the rows, so a
            # step's pace is per request the engine holds (running, waiting or just arrived)
            rows, load, self._load = len(contexts), self._load, None
            queued = load.waiting + load.arriving if load is not None else 0
            resting_s = unplanned_step(self.profile, rows, sum(contexts) / rows)
            self._last_call = (called, resting_s, queued)
        if drafted:
            self.clock.record("draft", cost.forward_s - cost.select_s, cost.predicted)
            self.clock.record("select", cost.select_s, cost.select_predicted)
            if "propose" in self.profile.fits:  # the call less its forwards
                work = proposer_work(self.profile, [r.drafts + 1 for r in drafted])
                self.clock.record("propose", left - called - cost.forward_s, work)
        tolerant = {r.row for r in drafted if r.session.topn > 1}
        self._pending = _PendingStep(
            called=called,
            left=left,
            req_ids=tuple(req_ids),
            queries=[drafts.get(row, 0) + 1 for row in range(len(req_ids))],
            contexts=list(contexts),
            tolerant=any(drafts.get(row) for row in tolerant),
        )

    # ---- statistics --------------------------------------------------------------------------
    def stats(self, pop: bool = False) -> dict:
        timings = msgspec.structs.asdict(self.pop_timings() if pop else self.timings)
        return {
            "timing": timings,
            "policy": f"step policy, profile {self.profile.key}"
            if self.profile is not None
            else "each plan's own rules",
            "profile_factors": self.clock.factors() if self.clock is not None else None,
            # observed against predicted seconds per step kind since the last pop
            "step_totals": self.clock.totals(reset=pop) if self.clock is not None else None,
        }
