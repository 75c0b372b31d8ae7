"""The step planner without an engine: which rows draft a step, the clock's rest and hold rules,
and the timing of steps against the profile. Profiles are a recorded calibration of this machine
(benchmarks/records) and, where a gain must exist to be chosen, the policy tests' profile with
known step times."""

from __future__ import annotations

from pathlib import Path

import pytest

from kapc.policy import EngineLoad, prefills_next
from kapc.profile import load_profile
from kapc.runtime.planner import (
    Candidate,
    DraftCost,
    Ends,
    HookTimings,
    StepPlanner,
    StepRecord,
)
from kapc.runtime.session import PlanSession
from tests.compiler.test_policy import known_profile

RECORDED = (
    Path(__file__).parents[2] / "benchmarks/records/calibration-grid-vllm-cpu/profile-default.json"
)


def session(p: float = 0.8, s: float = 0.1, k: int = 4, **kw) -> PlanSession:
    return PlanSession(tag="t", status="plan", k=k, prior_p=p, retained_ratio=s, **kw)


def rows(n: int, p: float = 0.8, context: int = 4096, **kw) -> list[Candidate]:
    return [Candidate(i, session(p, **kw), context - 1, 4) for i in range(n)]


def test_without_a_profile_every_candidate_drafts_and_nothing_is_forecast():
    planner = StepPlanner()
    batch = rows(3)
    assert planner.plan(batch, [100, 200]) == batch
    assert planner.timings == HookTimings()
    assert planner.stats()["policy"] == "each plan's own rules"


def test_rows_draft_where_the_profile_says_they_pay():
    planner = StepPlanner(known_profile(), online=False)
    kept = planner.plan(rows(1, p=0.8), [])
    # alone, k=3 pays best at p=0.8: 2.952 tokens in 25 ms against 1 in 10 (test_policy)
    assert [(r.row, r.drafts) for r in kept] == [(0, 3)]
    t = planner.timings
    assert (t.forecast_s, t.plain_forecast_s) == pytest.approx((0.025, 0.02952))
    assert t.forecast_tokens == pytest.approx(2.952)
    assert t.forecast_from > 0  # the first forecast step: the prefill before it is not forecast
    poor = rows(2, p=0.05)
    assert planner.plan(poor, [512]) == []
    assert [r.session.held for r in poor] == [1, 1]


def test_the_recorded_profile_of_this_machine_holds_every_row():
    """On vllm-cpu here a SmolLM2 draft costs nearly a plain step: no step pays to draft."""
    planner = StepPlanner(load_profile(RECORDED), online=False)
    batch = rows(4, p=0.9, context=6144)
    assert planner.plan(batch, []) == []
    assert all(r.session.held == 1 for r in batch)


def test_forced_rows_draft_whatever_the_forecast():
    planner = StepPlanner(load_profile(RECORDED), online=False)
    batch = rows(2, p=0.9, forced=True)
    assert planner.plan(batch, [100]) == batch


def test_a_batch_larger_than_the_profile_timed_is_not_forecast():
    """A step with more rows than the profile ever timed would be extrapolated, so it decodes
    plainly; forced rows still draft."""
    profile = load_profile(RECORDED)
    most = profile.largest_batch
    assert most == max(x.batch for x in profile.samples if x.kind == "verify") > 1
    planner = StepPlanner(profile, online=False)
    batch = rows(2, p=0.9) + [Candidate(2, session(0.9, forced=True), 4095, 4)]
    kept = planner.plan(batch, [4096] * (most - 2))  # most + 1 rows
    assert [r.row for r in kept] == [2] and [r.session.held for r in batch] == [1, 1, 0]
    assert planner.timings.held_beyond_profile == 1
    planner.plan(rows(2, p=0.9), [4096] * (most - 2))  # most rows: the profile's to decide
    assert planner.timings.held_beyond_profile == 1


def test_no_row_drafts_before_a_step_that_prefills():
    """A newcomer with a free seat, or a prompt part-way through its chunks, means the next step
    prefills: drafting would delay its first token, so no row drafts, profile or not, forced or
    not."""
    free_seat = EngineLoad(waiting=1, admissible=True, running=3, seats=8)
    assert prefills_next(free_seat) and prefills_next(EngineLoad(arriving=2, running=3, seats=8))
    assert prefills_next(EngineLoad(running=4, seats=4, prefilling=1))
    # nothing waits, the engine cannot tell, the newcomer has no seat to take, or it waits for
    # KV blocks: drafts pay
    assert not prefills_next(EngineLoad(running=3, seats=8)) and not prefills_next(None)
    assert not prefills_next(EngineLoad(waiting=5, admissible=True, arriving=1, running=8, seats=8))
    assert not prefills_next(EngineLoad(waiting=5, admissible=False, running=3, seats=8))
    for planner in (StepPlanner(), StepPlanner(known_profile(), online=False)):
        batch = rows(3, p=0.8) + [Candidate(3, session(0.8, forced=True), 4095, 4)]
        assert planner.plan(batch, [100], free_seat) == []
        assert [r.session.held for r in batch] == [1, 1, 1, 1]
        assert planner.timings.held_by_prefill == 1
        planner.plan(rows(2), [], EngineLoad(running=2, seats=8))
        assert planner.timings.held_by_prefill == 1  # that step was the profile's to decide
    free = StepPlanner().plan(rows(2), [], EngineLoad(running=2, seats=8))
    assert [r.row for r in free] == [0, 1]


def test_a_request_arriving_after_the_step_was_scheduled_stops_drafting():
    """The step's load was measured before a newcomer arrived: counted since, it holds rows
    about to draft and stops a cycle that drafts, forced or not, where a seat is free for it;
    with no seat, or with nothing new, drafting goes on."""
    quiet = EngineLoad(running=2, seats=8)
    assert not prefills_next(quiet) and prefills_next(quiet, arrived=1)
    assert not prefills_next(EngineLoad(running=8, seats=8), arrived=3)
    for planner in (StepPlanner(), StepPlanner(known_profile(), online=False)):
        batch = rows(1, p=0.8) + [Candidate(1, session(0.8, forced=True), 4095, 4)]
        assert planner.plan(batch, [], quiet, lambda: 1) == []
        assert [r.session.held for r in batch] == [1, 1]
        assert planner.timings.held_by_arrival == 1 and planner.timings.held_by_prefill == 0
        arrived = [0]
        drafting = planner.plan(rows(2, p=0.9), [], quiet, lambda a=arrived: a[0])
        assert drafting and not planner.stops_for_arrival(drafting)
        arrived[0] = 2  # while the rows draft
        assert planner.stops_for_arrival(drafting)
        planner.plan(rows(2, p=0.9), [], EngineLoad(running=8, seats=8), lambda: 1)
        assert not planner.stops_for_arrival(drafting)  # no seat: drafting goes on
        assert all(r.session.held == 1 for r in drafting)
        assert planner.timings.held_by_arrival == 2 and planner.prefill_holds == 2


def test_no_row_drafts_in_a_step_that_emits_a_first_token():
    """A step's tokens leave the engine once its drafts are made: while a row's first token is in
    the output, no row drafts, forced or not; the step after is the profile's to decide."""
    quiet = EngineLoad(running=3, seats=8)
    for planner in (StepPlanner(), StepPlanner(known_profile(), online=False)):
        batch = rows(2, p=0.9) + [Candidate(2, session(0.9, forced=True), 4095, 4)]
        assert planner.plan(batch, [100], quiet, ends=Ends(first=1)) == []
        assert [r.session.held for r in batch] == [0, 0, 0]  # every request has a first token
        assert planner.timings.held_for_first_token == 1
        assert planner.plan(batch, [100], quiet) != []
        assert planner.timings.held_for_first_token == 1


def test_no_row_drafts_in_a_step_that_ends_a_request():
    """A finished request's last token leaves with its step's output, after that step's drafts:
    drafting then delays it, and a client that sends its next request on it. While a request's
    last token is in the output no row drafts, forced or not, and no row is charged a hold."""
    quiet = EngineLoad(running=3, seats=8)
    for planner in (StepPlanner(), StepPlanner(known_profile(), online=False)):
        batch = rows(2, p=0.9) + [Candidate(2, session(0.9, forced=True), 4095, 4)]
        assert planner.plan(batch, [100], quiet, ends=Ends(last=1)) == []
        assert [r.session.held for r in batch] == [0, 0, 0]
        assert planner.timings.held_for_last_token == 1
        assert planner.timings.held_for_first_token == 0
        assert planner.plan(batch, [100], quiet) != []
        assert planner.timings.held_for_last_token == 1


def test_a_request_ends_on_a_stop_token_or_at_its_length_limit():
    s = PlanSession(tag="r", prompt_tokens=100, end_tokens=148, stop_ids=frozenset({2, 7}))
    assert not s.ends_with([5], 120)
    assert s.ends_with([5, 7], 122)  # a stop token among a cycle's accepted tokens
    assert s.ends_with([5], 148) and s.ends_with([5, 6], 149)
    assert not s.ends_with([], 148)  # no output this step (a chunk of its prompt)
    unlimited = PlanSession(tag="u", prompt_tokens=100)  # no limit, no stop ids
    assert not unlimited.ends_with([2], 10_000)


def test_the_clock_rests_one_step_in_sixteen_and_holds_while_drafting_loses():
    planner = StepPlanner(known_profile())
    drafted = []
    for _ in range(40):
        drafted.append(len(planner.plan(rows(1), [])))
        planner.clock.tick()
    # a step at rest, timed, once the clock has waited sample_every steps
    assert planner.timings.rest_samples == 2 and drafted.count(0) == 2 and drafted[0] == 1
    for _ in range(30):  # whole steps with drafts: 2 tokens in the time of 10 resting steps
        planner.clock.tick()
        planner.clock.record_cycle(2, 1.0, 1, 0.1)
    # (the first may be the step at rest the clock is due; the next is held by the rates)
    assert planner.plan(rows(1), []) == [] and planner.plan(rows(1), []) == []
    assert planner.timings.held_by_rate >= 1


def test_an_engine_step_is_timed_when_it_ran_the_rows_the_call_left():
    planner = StepPlanner(known_profile())
    kept = planner.plan(rows(1), [])
    cost = DraftCost(forward_s=0.02, select_s=0.0, predicted=0.009)
    planner.call_done(1.0, 1.03, ["a", "b"], [4096, 4096], kept, {0: 3}, cost)
    assert list(planner.log) == [StepRecord(1.0, 1.03, 2, 1, 3, 0.02, 0.0)]
    planner.step_done(1.1, ["a", "b"], [4, 1])  # verification took 0.07 s
    totals = planner.stats()["step_totals"]
    assert totals["verify"]["observed_s"] == pytest.approx(0.07)
    assert totals["verify"]["predicted_s"] == pytest.approx(0.012 + (4 + 1) * 0.001)
    assert totals["draft"]["observed_s"] == pytest.approx(0.02)
    # a step that admitted a new row is another kind of step: not timed
    planner.call_done(2.0, 2.01, ["a", "b"], [4100, 4100], [], {}, DraftCost())
    planner.step_done(2.5, ["a", "b", "c"], [1, 1, 1])
    assert "resting" not in planner.stats()["step_totals"]
    assert planner.timings.calls == 2 and planner.timings.propose_s == pytest.approx(0.04)
    popped = planner.stats(pop=True)
    assert popped["timing"]["calls"] == 2 and planner.timings.calls == 0


def test_every_step_counts_whole_under_the_regime_it_ran_in():
    """Each step from one call's entry to the next, prefills and newcomers included, counts
    toward the regime the clock was in when the call planned it: drafting allowed, kept through
    steps held for a first token, or resting."""
    planner = StepPlanner(known_profile())
    quiet = EngineLoad(running=2, seats=8)
    kept = planner.plan(rows(2, p=0.9), [], quiet)
    assert kept  # drafting allowed
    planner.call_done(1.0, 1.03, ["a", "b"], [4096, 4096], kept, {0: 3, 1: 3}, DraftCost())
    planner.step_done(1.2, ["a", "b"], [4, 3])
    assert planner.plan(rows(2, p=0.9), [], quiet, ends=Ends(first=1)) == []  # held, same regime
    planner.call_done(1.2, 1.21, ["a", "b"], [4100, 4100], [], {}, DraftCost())
    planner.step_done(1.5, ["a", "b", "c"], [1, 1, 1])  # a newcomer prefilled: counted too
    t, seconds, n = planner.clock._regimes[True]
    resting = 0.010  # the profile's resting step at 4K
    assert n == pytest.approx(1 + 0.97)
    assert seconds == pytest.approx(0.2 * 0.97 + 0.3)
    assert t == pytest.approx(7 / 2 * resting * 0.97 + 3 / 3 * resting)
    assert planner.clock._regimes[False][2] == 0
    # a step the forecast leaves at rest counts as resting
    planner.plan(rows(2, p=0.1), [], quiet)
    planner.call_done(2.0, 2.01, ["a", "b"], [4100, 4100], [], {}, DraftCost())
    planner.step_done(2.1, ["a", "b"], [1, 1])
    assert planner.clock._regimes[False][2] == pytest.approx(1)


def test_requests_waiting_for_a_seat_count_against_the_step():
    """A step's pace is per request the engine holds: two waiting beside a batch of two halve
    it, so a regime that keeps newcomers waiting is not judged on its smaller batches alone."""
    planner = StepPlanner(known_profile())
    for waiting, at in ((0, 1.0), (2, 2.0)):
        load = EngineLoad(waiting=waiting, running=2, seats=2)
        kept = planner.plan(rows(2, p=0.9), [], load)
        planner.call_done(at, at + 0.01, ["a", "b"], [4096, 4096], kept, {}, DraftCost())
        planner.step_done(at + 0.1, ["a", "b"], [1, 1])
    t, seconds, n = planner.clock._regimes[True]
    resting = 0.010
    assert t == pytest.approx(1 * resting * 0.97 + 2 / 4 * resting)
