"""kapc.policy on hand-computed cases: acceptance rules, admission, the cost model (memory-bound
and profiled), k=auto and break-even; and the compiler using a profile."""

from __future__ import annotations

import math
import os

import msgspec
import numpy as np
import pytest

from kapc.lower.kapb import CostPrediction, FallbackPolicy, PlanHeader
from kapc.policy import (
    COMPARE_EVERY,
    COMPARE_STEPS,
    AcceptanceMonitor,
    DraftRow,
    PolicyError,
    StepClock,
    acceptance_rate,
    accepted_prefix,
    admit,
    critical_context,
    engine_blocks,
    engine_step,
    estimated_p,
    padded_view,
    parse_accept,
    plan_speedup,
    plan_step,
    predict,
    predicted_speedup,
    profile_pays_from,
    run_forecast,
    step_cost,
    step_forecast,
    step_tokens,
    tokens_per_cycle,
    unplanned_step,
    visible_tokens,
)
from kapc.profile import (
    AcceptanceFit,
    Profile,
    StepFit,
    StepSample,
    find_profile,
    fit_acceptance,
    fit_steps,
    load_profile,
    machine_cpu,
    save_profile,
)


def test_acceptance_rules():
    assert parse_accept("greedy") == 1 and parse_accept("top3") == 3 and parse_accept("top9") == 9
    for bad in ("top1", "top10", "top03", "Top3", "", "top"):
        with pytest.raises(PolicyError):
            parse_accept(bad)
    # the longest accepted prefix; greedy compares with the argmax only
    assert accepted_prefix([5, 6, 7], [[5], [6], [8]], 1) == 2
    assert accepted_prefix([5, 6, 7], [[9, 5], [6, 1], [8, 7]], 1) == 0
    assert accepted_prefix([5, 6, 7], [[9, 5], [6, 1], [8, 7]], 2) == 3
    assert accepted_prefix([], [], 1) == 0


def test_acceptance_model_and_memory_bound_cost():
    assert tokens_per_cycle(0.5, 3) == pytest.approx(1.875)
    assert acceptance_rate(0.5, 3) == pytest.approx(0.875 / 3)
    assert acceptance_rate(1.0, 4) == 1.0 and acceptance_rate(0.0, 4) == 0.0
    # W=100, KV=50, batch 1, s=0.2, h=0.5, k=2: base (1+1)(150)=300, plan 2(100+10)+150=370
    assert predicted_speedup(100, 50, 1, 0.2, 0.5, 2) == pytest.approx(300 / 370)
    # a batch of 4 shares W: (1+1)(25+50)=150 over 2(25+10)+75=145
    assert predicted_speedup(100, 50, 4, 0.2, 0.5, 2) == pytest.approx(150 / 145)


def test_acceptance_monitor():
    m = AcceptanceMonitor(min_acceptance=0.5, window=4)
    assert m.record(2, 0) is None  # window not full yet
    reason = m.record(2, 1)
    assert reason and "0.25" in reason and "0.50" in reason
    ok = AcceptanceMonitor(min_acceptance=0.5, window=4)
    assert ok.record(4, 2) is None  # 0.5 is not below 0.5
    assert AcceptanceMonitor(0.0, 1).record(5, 0) is None  # a floor of 0 never falls back


def _header(**kw) -> PlanHeader:
    base = dict(
        name="p",
        kapc_version="0",
        model="m",
        model_fingerprint="sha256:a",
        tokenizer_fingerprint="sha256:b",
        template_fingerprint="sha256:c",
        block_size=16,
        prompt_tokens=100,
        prompt_hash="sha256:d",
        visible_prompt_tokens=20,
        retained_ratio=0.2,
        padded_blocks=2,
        k=4,
        accept="greedy",
        fallback=FallbackPolicy(),
        cost=CostPrediction(
            weight_bytes=1, kv_bytes=1, batch=1, s=0.2, h=0.8, k=4, speedup=1.5, pays=True
        ),
    )
    base.update(kw)
    return PlanHeader(**base)


def test_admission_rules_in_order():
    h = _header()
    assert admit(h, retained=0.2).runs
    assert admit(h, retained=0.2, k=2).k == 2 and admit(h, retained=0.2, engine_k=3).k == 3
    # a sampled request drafts, verified by rejection sampling: never with a tolerance
    sampled = admit(h, retained=0.2, accept="top3", random_sampling=True)
    assert sampled.runs and (sampled.accept, sampled.topn) == ("sampled", 1)
    assert not admit(h, retained=0.6, random_sampling=True).runs  # the other rules still hold
    assert "k=0" in admit(h, retained=0.2, k=0).reason
    assert "max_retained" in admit(h, retained=0.6).reason  # the ratio the engine will read
    loses = _header(cost=msgspec.structs.replace(h.cost, pays=False, speedup=0.8))
    assert "predicts no gain" in admit(loses, retained=0.2).reason
    assert admit(loses, retained=0.2, honor_predicted_loss=False).runs
    assert admit(h, retained=0.2, accept="top3").topn == 3
    with pytest.raises(PolicyError):
        admit(h, retained=0.2, accept="top99")


def test_engine_blocks_map_any_block_size():
    P = 100
    positions = np.concatenate([np.arange(0, 16), np.arange(48, 64), np.arange(96, 100)])
    # coarser (32): blocks 0 and 1 hold the plan's tokens, block 3 is the tail
    assert engine_blocks(positions, P, 32).tolist() == [0, 1, 3]
    assert visible_tokens(np.array([0, 1, 3]), P, 32) == 32 + 32 + 4
    # finer (8): exactly the plan's tokens
    assert engine_blocks(positions, P, 8).tolist() == [0, 1, 6, 7, 12]
    # nonsense positions past the prompt are dropped; the tail is always there
    assert engine_blocks(np.array([5, 5, 500]), P, 16).tolist() == [0, 6]


def test_the_paper_fallback_conditions_at_admission():
    """Workspace capacity and prior confidence refuse a plan with their reason; a plan inside
    both runs."""
    h = _header()
    # workspace: a view of 5 blocks pads to 8; an engine that holds 6 per request cannot take it
    assert padded_view(5) == 8 and padded_view(8) == 8 and padded_view(1) == 1
    reason = admit(h, retained=0.2, view_blocks=5, workspace_blocks=6).reason
    assert reason.startswith("workspace:") and "pads to 8" in reason and "6 blocks" in reason
    assert admit(h, retained=0.2, view_blocks=5, workspace_blocks=8).runs
    assert admit(h, retained=0.2, view_blocks=500).runs  # no workspace named: no limit
    # prior confidence: priors that hardly set the kept passages apart
    flat = _header(prior_separation=0.01, fallback=FallbackPolicy(min_separation=0.05))
    reason = admit(flat, retained=0.2).reason
    assert reason.startswith("prior confidence:") and "0.010" in reason and "0.050" in reason
    # forcing a plan past the cost model does not force it past a guess
    assert not admit(flat, retained=0.2, honor_predicted_loss=False).runs
    assert admit(
        _header(prior_separation=0.3, fallback=FallbackPolicy(min_separation=0.05)), retained=0.2
    ).runs
    # nothing dropped (None), or a plan made before the rule (no floor): no refusal
    assert admit(_header(prior_separation=None), retained=0.2).runs


def test_pays_from_is_the_papers_kv_crit():
    """On the memory-bound model a plan with h > s pays from W/B (1 - h) / (h - s) bytes of KV;
    the search finds that length within 1%, shares W across the batch, and says None where h <= s
    never pays."""
    w, per_token, s, k, p = 1e9, 1e4, 0.1, 4, 0.8
    h = acceptance_rate(p, k)

    def at(batch, ss=s, pp=p):
        return critical_context(
            lambda n: plan_speedup(
                s=ss, p=pp, k=k, batch=batch, context=n, weight_bytes=w, kv_bytes=per_token * n
            ),
            10**7,
        )

    for batch in (1, 8):
        expect = w / batch * (1 - h) / (h - s) / per_token
        assert expect <= at(batch) <= expect * 1.011
    assert at(8) < at(1)
    assert at(1, ss=0.7, pp=0.5) is None  # h = 0.47 < s: it never pays
    assert critical_context(lambda n: 2.0, 4096) == 256  # pays from the shortest length asked
    assert critical_context(lambda n: n / 5000, 4096) is None
    assert 5000 <= critical_context(lambda n: n / 5000, 32768) <= 5050


def test_profile_states_where_plans_pay_per_batch():
    """With measured step times that grow with the context, a plan pays from a length that falls
    as the batch grows, and never where drafts cost as much as plain steps."""
    grow = StepFit(features=("1", "B", "BV"), coef=(0.010, 0.002, 2e-7), rel_error=0, samples=3)
    prof = msgspec.structs.replace(
        known_profile(),
        fits={
            **known_profile().fits,
            "plain": grow,
            "draft": StepFit(
                features=("1", "B", "BV"), coef=(0.008, 0.002, 2e-8), rel_error=0, samples=3
            ),
            "verify": StepFit(
                features=("1", "B", "Bq", "BV", "BqV"),
                coef=(0.012, 0.002, 0.001, 2e-7, 0),
                rel_error=0,
                samples=5,
            ),
        },
    )
    one, eight = profile_pays_from(prof, 1, 0.1), profile_pays_from(prof, 8, 0.1)
    assert one is not None and eight is not None and 256 < eight < one
    best = max(
        plan_speedup(s=0.1, p=0.8, k=kk, batch=1, context=one, profile=prof) for kk in range(1, 9)
    )
    worse = max(
        plan_speedup(s=0.1, p=0.8, k=kk, batch=1, context=int(one * 0.97), profile=prof)
        for kk in range(1, 9)
    )
    assert best > 1.0 >= worse
    # a draft over s = 0.1 of the context that costs what a plain step over all of it does
    as_plain = StepFit(features=("1", "B", "BV"), coef=(0.010, 0.002, 2e-6), rel_error=0, samples=3)
    costly = msgspec.structs.replace(prof, fits={**prof.fits, "draft": as_plain})
    assert profile_pays_from(costly, 1, 0.1) is None


def known_profile(fingerprint: str = "sha256:" + "0" * 64) -> Profile:
    """plain 10 ms, draft 3 ms, no proposer overhead, verify 12 ms + 1 ms per query token."""
    return Profile(
        engine="vllm-cpu",
        engine_version="test",
        model="m",
        model_fingerprint=fingerprint,
        dtype="float32",
        device="cpu",
        threads=2,
        block_size=32,
        created="now",
        fits={
            "plain": StepFit(features=("1", "B", "BV"), coef=(0.010, 0, 0), rel_error=0, samples=3),
            "draft": StepFit(features=("1", "B", "BV"), coef=(0.003, 0, 0), rel_error=0, samples=3),
            "propose": StepFit(features=("1", "B"), coef=(0, 0), rel_error=0, samples=2),
            "verify": StepFit(
                features=("1", "B", "Bq", "BV", "BqV"),
                coef=(0.012, 0, 0.001, 0, 0),
                rel_error=0,
                samples=5,
            ),
        },
        acceptance={"greedy": AcceptanceFit(a=math.log(4), b=0.0)},
    )  # p = 0.8


def test_profiled_prediction_k_auto_and_break_even():
    prof = known_profile()
    pred = predict(s=0.1, p=0.8, k=None, batch=1, context=4096, profile=prof)
    # speedup(k) = (1 + 0.8 + ... + 0.8^k) * 10 / (3k + 12 + (k+1)): k=3 gives 29.52/25
    assert pred.k == 3
    assert pred.speedup == pytest.approx(29.52 / 25)
    assert pred.by_k[:4] == pytest.approx((18 / 17, 24.4 / 21, 29.52 / 25, 33.616 / 29), abs=1e-4)
    # break-even at k=3: 1 + p + p^2 + p^3 = 2.5, so h = 1.5 / 3
    assert pred.break_even == pytest.approx(0.5, abs=1e-3)
    assert pred.basis == prof.key
    never = predict(
        s=0.1,
        p=0.8,
        k=8,
        batch=1,
        context=4096,
        profile=known_profile().__class__(
            **{
                **msgspec.structs.asdict(prof),
                "fits": {
                    **prof.fits,
                    "draft": StepFit(
                        features=("1", "B", "BV"), coef=(0.2, 0, 0), rel_error=0, samples=3
                    ),
                },
            }
        ),
    )
    assert never.break_even is None and never.speedup < 1


def test_k_auto_stays_within_the_verifications_the_profile_timed():
    """Beyond the longest verification a profile timed, its verify model extrapolates; k=auto
    does not choose there (an explicit k still predicts)."""
    prof = known_profile()
    assert predict(s=0.1, p=0.95, k=None, batch=1, context=4096, profile=prof).k >= 7
    timed = msgspec.structs.replace(
        prof, samples=tuple(StepSample("verify", 1, q, 4096, 0.012 + 0.001 * q) for q in (2, 3))
    )
    assert timed.longest_verify == 3
    pred = predict(s=0.1, p=0.95, k=None, batch=1, context=4096, profile=timed)
    assert pred.k == 2 and pred.by_k[6] > pred.by_k[1]
    assert predict(s=0.1, p=0.95, k=6, batch=1, context=4096, profile=timed).k == 6


def test_a_plan_is_priced_against_its_own_engine_without_plans():
    """kapc's engine decodes unplanned requests on its own attention kernel (`resting`): a plan
    must beat that, not the slower plain engine, so the same cycle predicts less and can lose."""
    prof = known_profile()
    faster = Profile(
        **{
            **msgspec.structs.asdict(prof),
            "fits": {
                **prof.fits,
                "resting": StepFit(
                    features=("1", "B", "BV"), coef=(0.007, 0, 0), rel_error=0, samples=3
                ),
            },
        }
    )
    assert unplanned_step(prof, 1, 4096) == pytest.approx(0.010)  # no resting model: plain
    assert unplanned_step(faster, 1, 4096) == pytest.approx(0.007)
    # k=3 at p 0.8: 2.952 tokens per 25 ms cycle; 7 ms per token at rest
    pred = predict(s=0.1, p=0.8, k=3, batch=1, context=4096, profile=faster)
    assert pred.speedup == pytest.approx(2.952 * 7 / 25)
    assert (
        pred.speedup < 1 < predict(s=0.1, p=0.8, k=3, batch=1, context=4096, profile=prof).speedup
    )
    assert plan_step(faster, [DraftRow(p=0.8, k=4, s=0.1, context=4096)], []) == [0]
    assert step_forecast(faster, [], [4096]) == pytest.approx((0.007, 0.007))


def tolerant_profile(fingerprint: str = "sha256:" + "0" * 64) -> Profile:
    """known_profile, with top-N verification timed at 12 ms + 2 ms per query token, and top-3
    acceptance as greedy's (p = 0.8)."""
    prof = known_profile(fingerprint)
    return msgspec.structs.replace(
        prof,
        fits={
            **prof.fits,
            "verify_tolerant": StepFit(
                features=("1", "B", "Bq", "BV", "BqV"),
                coef=(0.012, 0, 0.002, 0, 0),
                rel_error=0,
                samples=5,
            ),
        },
        acceptance={**prof.acceptance, "top3": prof.acceptance["greedy"]},
    )


def test_top_n_verification_is_priced_from_its_own_step_model():
    """Top-N rows verify through a dearer path (a top-N over the vocabulary per draft position
    before vLLM's rejection sampler): a profile that timed it prices top-N plans and steps with
    it, and one that did not prices them as greedy."""
    prof, tol = known_profile(), tolerant_profile()
    # k=3, p=0.8: 29.52 plain ms of tokens per cycle; 3 drafts (9 ms) + verify of q=4:
    # greedy 12 + 4 = 16 ms, tolerant 12 + 8 = 20 ms
    assert predict(
        s=0.1, p=0.8, k=3, batch=1, context=4096, profile=tol, tolerant=True
    ).speedup == pytest.approx(29.52 / 29)
    assert predict(s=0.1, p=0.8, k=3, batch=1, context=4096, profile=tol).speedup == pytest.approx(
        29.52 / 25
    )
    assert predict(
        s=0.1, p=0.8, k=3, batch=1, context=4096, profile=prof, tolerant=True
    ).speedup == pytest.approx(29.52 / 25)
    # a step with any drafting top-N row is a tolerant verification of every row's queries
    top3, greedy = (
        DraftRow(p=0.8, k=3, s=0.1, context=4096, tolerant=True),
        DraftRow(p=0.8, k=3, s=0.1, context=4096),
    )
    assert step_cost(tol, [top3, greedy], []) == pytest.approx(0.009 + 0.012 + 0.002 * 8)
    assert step_cost(tol, [greedy, greedy], []) == pytest.approx(0.009 + 0.012 + 0.001 * 8)
    held = DraftRow(p=0.8, k=0, s=0.1, context=4096, tolerant=True)
    assert step_cost(tol, [held, greedy], []) == pytest.approx(0.009 + 0.012 + 0.001 * 5)
    assert engine_step(tol, [4, 1], [4096, 4096], tolerant=True) == pytest.approx(0.022)
    # the clock: a tolerant step follows verification's factor until one is timed
    clock = StepClock(tol, decay=0.95, prior=2.0)
    for _ in range(10):
        clock.record("verify", 0.034, 0.017)
    assert clock.factor("verify_tolerant") == pytest.approx(clock.factor("verify"))
    for _ in range(10):
        clock.record("verify_tolerant", 0.022, 0.022)
    assert clock.factor("verify_tolerant") < clock.factor("verify")


def test_query_aware_pages_pay_for_choosing_them_each_cycle():
    """A dynamic or hybrid plan chooses its pages once per cycle; a profile that measured that
    (`select`: 2 ms + 1 ms a row + 1 ms per 4096 tokens of a row's prompt) adds it to the cycle,
    and the compiler and the step policy both see it; a static plan, or a profile without it,
    does not pay it."""
    prof = known_profile()
    chooser = Profile(
        **{
            **msgspec.structs.asdict(prof),
            "fits": {
                **prof.fits,
                "select": StepFit(
                    features=("1", "B", "BV"),
                    coef=(0.002, 0.001, 0.001 / 4096),
                    rel_error=0,
                    samples=3,
                ),
            },
        }
    )
    # k=3 at p 0.8, batch 1: 2.952 tokens per 25 ms cycle, plus 2 + 1 + 1 = 4 ms of page choice
    assert predict(
        s=0.1, p=0.8, k=3, batch=1, context=4096, profile=chooser, chooses_pages=True
    ).speedup == pytest.approx(29.52 / 29)
    assert predict(
        s=0.1, p=0.8, k=3, batch=1, context=4096, profile=chooser
    ).speedup == pytest.approx(29.52 / 25)
    assert predict(
        s=0.1, p=0.8, k=3, batch=1, context=4096, profile=prof, chooses_pages=True
    ).speedup == pytest.approx(29.52 / 25)
    # in a step, only the rows that draft and choose pay: 2 + 2 * 1 + (4096 + 8192) / 4096 ms
    rows = [
        DraftRow(p=0.8, k=3, s=0.1, context=4096, chooses_pages=True),
        DraftRow(p=0.8, k=3, s=0.1, context=8192, chooses_pages=True),
        DraftRow(p=0.8, k=3, s=0.1, context=4096),
        DraftRow(p=0.8, k=0, s=0.1, context=4096, chooses_pages=True),
    ]
    assert step_cost(chooser, rows, []) - step_cost(prof, rows, []) == pytest.approx(0.007)
    # k=3 alone: 2.952 tokens in 29 ms, k=4: 3.3616 in 33; 4 ms more per cycle is worth a
    # longer proposal (1.9% over resting: within the default margin, so without it here)
    assert plan_step(
        chooser, [DraftRow(p=0.8, k=4, s=0.1, context=4096, chooses_pages=True)], [], margin=0.0
    ) == [4]
    assert plan_step(
        chooser, [DraftRow(p=0.8, k=4, s=0.1, context=4096, chooses_pages=True)], []
    ) == [0]
    assert plan_step(chooser, [DraftRow(p=0.8, k=4, s=0.1, context=4096)], []) == [3]


def test_step_policy_drafts_what_pays_for_the_batch():
    prof = known_profile()
    row = DraftRow(p=0.8, k=4, s=0.1, context=4096)
    # alone: k=3 gives 2.952 tokens in 25 ms, k=4 3.3616 in 29, none 1 in 10
    assert plan_step(prof, [row], []) == [3]
    assert plan_step(prof, [DraftRow(p=0.2, k=4, s=0.1, context=4096)], []) == [0]
    # plain and verification cost 10 and 12 ms per row: with rows at p 0.9 and 0.1 the best
    # is the first drafting 4 (5.0951 tokens in 42 ms) and the second held (both: 5.2062 in 46)
    per_row = Profile(
        **{
            **msgspec.structs.asdict(prof),
            "fits": {
                **prof.fits,
                "plain": StepFit(
                    features=("1", "B", "BV"), coef=(0, 0.010, 0), rel_error=0, samples=3
                ),
                "verify": StepFit(
                    features=("1", "B", "Bq", "BV", "BqV"),
                    coef=(0, 0.012, 0.001, 0, 0),
                    rel_error=0,
                    samples=5,
                ),
            },
        }
    )
    good, poor = (
        DraftRow(p=0.9, k=4, s=0.1, context=4096),
        DraftRow(p=0.1, k=4, s=0.1, context=4096),
    )
    assert plan_step(per_row, [good, poor], []) == [4, 0]
    assert plan_step(per_row, [poor, good], []) == [0, 4]
    # a row that must draft is paid for anyway: the good row then drafts too
    assert plan_step(per_row, [good], [], fixed=[poor]) == [4]
    # a row that cannot draft (`others`) still waits for the verification
    assert plan_step(per_row, [], [4096]) == []
    # the forecast of a step that ran: its seconds, and plain's for as many tokens
    assert step_forecast(prof, [DraftRow(p=0.8, k=3, s=0.1, context=4096)], []) == pytest.approx(
        (0.025, 0.02952)
    )
    assert step_forecast(prof, [], [4096, 4096]) == pytest.approx((0.010, 0.010))
    # acceptance estimate: the plan's p worth 16 tries, then what the row shows
    assert estimated_p(0.5, 10, 20) == pytest.approx(18 / 36)
    assert estimated_p(0.9, 0, 0) == 0.9


def test_the_step_policy_decides_on_the_step_times_it_measures():
    """The runtime times its own steps against the profile (a snapshot of a drifting machine)
    and decides on the profile scaled by what it saw: drafts three times dearer than profiled
    turn a row that paid (k=3: 2.952 tokens in 25 ms against 1 in 10) into one held."""
    prof = known_profile()
    row = DraftRow(p=0.8, k=4, s=0.1, context=4096)
    # an engine step: verification of every row's q tokens (12 ms + 1 ms per query token), or
    # resting when no row has drafts to check
    assert engine_step(prof, [4, 1], [4096, 4096]) == pytest.approx(0.017)
    assert engine_step(prof, [1, 1], [4096, 4096]) == pytest.approx(0.010)
    assert prof.scaled({"draft": 2.0}).seconds("draft", 1, 409) == pytest.approx(0.006)
    assert prof.scaled({"draft": 2.0}).seconds("plain", 1, 4096) == pytest.approx(0.010)

    clock = StepClock(prof, decay=0.95, prior=2.0)
    assert clock.factors() == {"plain": 1.0, "draft": 1.0, "propose": 1.0, "verify": 1.0}
    assert plan_step(clock.profile, [row], []) == [3]
    for _ in range(20):
        clock.tick()
        clock.record("draft", 0.009, 0.003)
    # 20 observations at 3x decayed by 0.95 weigh (1 - 0.95^20) / 0.05 = 12.83, the prior 2 at 1x
    n = (1 - 0.95**20) / 0.05
    assert clock.factor("draft") == pytest.approx((3 * n + 2) / (n + 2))
    assert clock.profile.seconds("draft", 1, 409) == pytest.approx(0.003 * clock.factor("draft"))
    assert plan_step(clock.profile, [row], []) == [0]
    # with no new observations a factor keeps what its steps last said: drafts three times
    # dearer stay held however many steps pass at rest, not handed back to the profile
    slow_drafts = clock.factor("draft")
    for _ in range(400):
        clock.tick()
    assert clock.factor("draft") == slow_drafts
    assert plan_step(clock.profile, [row], []) == [0]
    # newer observations replace them: drafts back at the profile's time draft again
    for _ in range(60):
        clock.record("draft", 0.003, 0.003)
    old, new = n * 0.95**60, (1 - 0.95**60) / 0.05
    assert clock.factor("draft") == pytest.approx((3 * old + new + 2) / (old + new + 2))
    assert plan_step(clock.profile, [row], []) == [3]

    # resting steps, rare where rows always draft, follow verification's factor until seen
    clock = StepClock(prof, decay=0.95, prior=2.0)
    for _ in range(10):
        clock.record("verify", 0.034, 0.017)
    # observations fade by newer ones of their kind: 10 at 2x weigh (1 - 0.95^10) / 0.05
    n = (1 - 0.95**10) / 0.05
    assert clock.factor("verify") == pytest.approx((2 * n + 2) / (n + 2))
    assert clock.factor("plain") == clock.factor("resting") == clock.factor("verify")
    for _ in range(10):
        clock.record("plain", 0.010, 0.010)
    assert clock.factor("plain") == pytest.approx((n + 2 * clock.factor("verify")) / (n + 2))
    # one step counts as at most 4x off the factor: a pause moves it little
    paused, slow = StepClock(prof), StepClock(prof)
    paused.record("verify", 0.017 * 100, 0.017)
    slow.record("verify", 0.017 * 4, 0.017)
    assert paused.factor("verify") == slow.factor("verify") == pytest.approx((4 + 2) / 3)


def test_resting_steps_seen_once_stay_the_baseline_while_rows_draft():
    """Where rows draft, a resting step runs one step in `sample_every` at most; what those say
    is the pace drafting is priced against, so it stays until newer resting steps replace it,
    where verification's factor fades with the steps. A resting factor that faded back to
    verification's (1.5 here, resting at 1.05) made a 15% loss a win."""
    prof = known_profile()
    clock = StepClock(prof, decay=0.95, prior=2.0)
    for _ in range(4):
        clock.record("plain", 0.0105, 0.010)
    for _ in range(60):  # drafting steps: verification 1.5x the profile's
        clock.tick()
        clock.record("verify", 0.0255, 0.017)
    n, v = (1 - 0.95**4) / 0.05, (1 - 0.95**60) / 0.05
    assert clock.factor("verify") == pytest.approx((1.5 * v + 2) / (v + 2))
    assert clock.factor("plain") == pytest.approx((1.05 * n + 2 * clock.factor("verify")) / (n + 2))
    assert clock.factor("plain") < 1.25
    # at rest's own pace (1 / 1.05 less the prior's pull), drafting at 0.8 of it loses
    clock.record_cycle(4, 0.050, 1, 0.010)  # 4 tokens in 5 resting steps' time
    assert clock.drafting_pays() is False
    # verification's factor would have called it a win
    assert 1 / clock.factor("verify") < 0.8 < 1 / clock.factor("plain")
    # a new resting step moves it, the old ones weighing 0.95 each
    clock.record("plain", 0.020, 0.010)
    m = n * 0.95 + 1
    expected = (0.0105 * n * 0.95 + 0.020 + 2 * 0.010 * clock.factor("verify")) / (0.010 * (m + 2))
    assert clock.factor("plain") == pytest.approx(expected)


def test_drafting_must_beat_resting_by_a_margin():
    """A gain smaller than the profile's own error is not worth a cycle: at p = 0.68 the best is
    k=2, 1 + 0.68 + 0.4624 = 2.1424 tokens in 21 ms, 2.0% more than resting's 1 in 10."""
    prof = known_profile()
    row = DraftRow(p=0.68, k=4, s=0.1, context=4096)
    assert plan_step(prof, [row], [], margin=0.0) == [2]
    assert plan_step(prof, [row], []) == [0]  # the default margin, 3%
    assert plan_step(prof, [row], [], margin=0.019) == [2]
    # past the margin, the best drafting still wins as before (k=3: 18% over resting)
    assert plan_step(prof, [DraftRow(p=0.8, k=4, s=0.1, context=4096)], []) == [3]


def test_the_clock_asks_for_a_resting_step_it_has_not_seen_for_a_while():
    """Where every step drafts, the clock never times a resting step; it asks for one every
    `sample_every` steps, counting from the last it saw (or first asked about)."""
    clock = StepClock(known_profile(), sample_every=4)
    assert not clock.wants_sample("plain")  # starts counting
    for _ in range(3):
        clock.tick()
        assert not clock.wants_sample("plain")
    clock.tick()
    assert clock.wants_sample("plain")
    assert not clock.wants_sample("plain")  # asked: the count starts again
    for _ in range(3):
        clock.tick()
    clock.record("plain", 0.010, 0.010)  # seen without asking: no need to ask soon
    clock.tick()
    assert not clock.wants_sample("plain")
    for _ in range(3):
        clock.tick()
    assert clock.wants_sample("plain")


def test_the_clock_compares_the_pace_of_steps_with_drafts_against_a_resting_step():
    """The forecast can favour drafting where the engine's steps say otherwise; the clock keeps
    each whole step's pace with drafts against the profile's resting step of its rows, decayed
    like the factors, and a resting step's pace is one over the resting factor."""
    clock = StepClock(known_profile())
    assert clock.drafting_pays() is None  # nothing seen
    for _ in range(10):
        clock.tick()
        clock.record_cycle(5, 0.060, 1, 0.010)  # 5 tokens in the time of 6 resting steps
    assert clock.drafting_pays() is False
    # recent cycles weigh more: 5 at 8 tokens a cycle after the 10 at 5, each decayed by 0.95 a
    # step, make 0.624 resting-step-tokens in 0.594 s: a pace of 1.05 against rest's 1.0
    for _ in range(5):
        clock.tick()
        clock.record_cycle(8, 0.060, 1, 0.010)
    assert clock.drafting_pays() is True
    # steps at rest (this profile's "plain") found 20% faster than profiled: rest's pace is
    # 1.25, above drafting's
    for _ in range(10):
        clock.record("plain", 0.8, 1.0)
    assert clock.drafting_pays() is False
    for _ in range(60):  # the cycles fade below one step's weight
        clock.tick()
    assert clock.drafting_pays() is None


def test_the_clock_compares_paces_not_tokens_a_second_across_batch_sizes():
    """Eight rows at rest deliver more tokens a second than one row drafting; that says nothing
    about drafting. Priced against the profile's resting step of their own rows, one row's cycle
    of 4 tokens in 2.5 resting steps keeps the faster pace, 8 rows' of 2 tokens each in 3.3
    resting steps the slower."""
    clock = StepClock(known_profile())
    clock.record_cycle(4, 0.025, 1, 0.010)  # 160 tokens/s, where 8 rows at rest make 267
    assert clock.drafting_pays() is True
    clock = StepClock(known_profile())
    clock.record_cycle(16, 0.100, 8, 0.030)  # 160 tokens/s at 8 rows
    assert clock.drafting_pays() is False


def _served(clock: StepClock, drafting: bool, steps: int, tokens: int, seconds: float) -> None:
    """`steps` engine steps of 8 rows, each emitting `tokens` in `seconds`, priced at a 0.2 s
    resting step, under the regime asked."""
    for _ in range(steps):
        clock.record_step(drafting, tokens, seconds, 8, 0.2)
        clock.tick()


def test_served_steps_compare_the_regimes_whole():
    """Steps counted whole, prefills and held steps included: drafting must keep a faster pace
    than resting by the margin, each side once it has REGIME_WEIGHT steps' weight."""
    clock = StepClock(known_profile())
    assert clock.served_pays() is None
    _served(clock, True, 16, 36, 1.0)  # 36 tokens a second drafting
    assert clock.served_pays() is None  # nothing at rest yet
    _served(clock, False, 10, 8, 0.2)
    assert clock.served_pays() is None  # 10 steps at 0.97 weigh 8.9
    _served(clock, False, 6, 8, 0.2)  # 40 tokens a second at rest
    assert clock.served_pays() is False
    clock = StepClock(known_profile())
    _served(clock, False, 16, 8, 0.2)
    _served(clock, True, 16, 8 * 5, 0.98)  # 40.8: within the margin of 40
    assert clock.served_pays() is False
    _served(clock, True, 30, 8 * 5, 0.9)  # 44.4: newer steps weigh more
    assert clock.served_pays() is True


def test_drafting_rests_to_compare_then_on_the_served_verdict():
    """Clean cycles can keep a pace ahead of clean resting steps while the server delivers
    less drafting (8K x 8: newcomers wait for verifications): once drafting has run long enough,
    it rests COMPARE_STEPS steps to time the resting side, then rests for as long as the served
    steps say it loses, though every clean cycle says it wins."""
    clock = StepClock(known_profile())
    rests = []
    for _ in range(400):
        clock.record_cycle(5, 0.03, 1, 0.010)  # clean cycles: 5 tokens in 3 resting steps
        resting = clock.drafting_rests()
        rests.append(resting)
        if resting:
            _served(clock, False, 1, 8, 0.2)  # 40 tokens a second at rest
        else:
            _served(clock, True, 1, 32, 0.9)  # 35.6 drafting, all told
    assert clock.drafting_pays() is True  # the clean cycles say it wins
    assert not any(rests[:15])  # drafting runs until it has REGIME_WEIGHT steps' weight
    assert all(rests[15 : 15 + COMPARE_STEPS])  # then rests to compare
    # then rests on the served verdict, twice as long each time drafting loses again
    assert COMPARE_STEPS == 16
    assert not any(rests[31:46]) and all(rests[46:62])  # drafting again, then a loss: 16
    assert not any(rests[62:77]) and all(rests[77:109])  # again, and again a loss: 32
    assert sum(rests) > 0.7 * len(rests)
    # where drafting wins served too, it rests only to compare: COMPARE_STEPS every
    # COMPARE_EVERY steps
    clock = StepClock(known_profile())
    rests = []
    for _ in range(1000):
        resting = clock.drafting_rests()
        rests.append(resting)
        assert not resting or clock.resting_to_compare  # never a loss's rest
        _served(clock, not resting, 1, 8 if resting else 48, 0.2 if resting else 0.9)
    assert 0 < sum(rests) <= COMPARE_STEPS * (1 + 1000 // COMPARE_EVERY)


def test_drafting_rests_longer_each_time_it_loses_again():
    clock = StepClock(known_profile())
    assert not clock.drafting_rests()  # nothing seen: the forecast decides
    rests = []
    for _ in range(3):
        clock.record_cycle(2, 0.100, 1, 0.010)  # drafting at a fifth of rest's pace
        steps = 0
        while clock.drafting_rests():
            clock.tick()
            steps += 1
        rests.append(steps)
    assert rests[0] >= 16 and rests[1] >= 2 * 16 and rests[2] >= 4 * 16
    clock.record_cycle(40, 0.100, 1, 0.010)  # a win: the next loss rests 16 steps again
    assert clock.drafting_pays() is True and not clock.drafting_rests()
    for _ in range(100):
        clock.tick()
    clock.record_cycle(1, 0.100, 1, 0.010)
    steps = 0
    while clock.drafting_rests():
        clock.tick()
        steps += 1
    assert 16 <= steps < 32


def test_acceptance_fit_has_a_context_term_only_across_context_lengths():
    """Prompts of one nominal length differ by a few percent; a slope fitted across them
    extrapolates to nonsense (top-3 p at 8K once fitted as 0.00 from 3910..4090-token prompts),
    so the context term needs lengths 1.5x apart."""
    near = fit_acceptance(
        [
            (0.1, 3910, 0.99, 100),
            (0.2, 3910, 0.99, 100),
            (0.1, 4090, 0.95, 100),
            (0.2, 4090, 0.97, 100),
        ]
    )
    assert near.c == 0.0 and near.p(0.1, 8192) == near.p(0.1, 4096) > 0.9
    apart = fit_acceptance(
        [
            (0.1, 4096, 0.95, 100),
            (0.2, 4096, 0.97, 100),
            (0.1, 8192, 0.90, 100),
            (0.2, 8192, 0.93, 100),
        ]
    )
    assert apart.c < 0 and apart.p(0.1, 8192) == pytest.approx(0.90, abs=0.01)


def test_fit_recovers_known_step_times():
    rng = np.random.default_rng(0)
    samples = []
    for B in (1, 4, 8, 16):
        for V in (1000, 4000, 8000):
            plain = 0.004 + 0.0005 * B + 2e-7 * B * V
            samples.append(StepSample("plain", B, 1, V, plain * (1 + 0.01 * rng.standard_normal())))
            for q in (2, 5, 8):
                v = 0.006 + 0.001 * B * q + 3e-7 * B * V + 1e-8 * B * q * V
                samples.append(StepSample("verify", B, q, V, v))
            # KV read whose cost per row falls as rows are added (measured so on the 2-core CPU)
            rest = 0.004 + 0.0005 * B + 1e-7 * B * V + 2e-7 * math.sqrt(B) * V
            samples.append(StepSample("resting", B, 1, V, rest))
    fits = fit_steps(samples)
    assert fits["plain"].rel_error < 0.03 and fits["verify"].rel_error < 1e-6
    assert fits["verify"].coef == pytest.approx((0.006, 0, 0.001, 3e-7, 1e-8), rel=1e-4, abs=1e-9)
    assert fits["resting"].features == ("1", "B", "BV", "sqrtBV")
    assert fits["resting"].coef == pytest.approx((0.004, 0.0005, 1e-7, 2e-7), rel=1e-4, abs=1e-9)


def test_forecast_error_is_what_a_fit_to_the_other_samples_misses():
    """Leave-one-out: exact where the model is the truth, the size of the noise where it is noisy,
    large where the model cannot express the times, and None with no sample to spare."""
    exact = [
        StepSample("draft", B, 1, V, 0.003 + 0.0002 * B + 1e-7 * B * V)
        for B in (1, 4, 8)
        for V in (1000, 8000)
    ]
    assert fit_steps(exact)["draft"].forecast_error == pytest.approx(0.0, abs=1e-6)
    rng = np.random.default_rng(1)
    noisy = [
        msgspec.structs.replace(x, seconds=x.seconds * (1 + 0.05 * rng.standard_normal()))
        for x in exact
    ]
    assert 0.02 < fit_steps(noisy)["draft"].forecast_error < 0.3
    # quadratic in the context, which no feature of a draft is: badly forecast
    curved = [
        StepSample("draft", B, 1, V, 1e-11 * B * V * V)
        for B in (1, 4, 8)
        for V in (1000, 4000, 8000)
    ]
    fit = fit_steps(curved)["draft"]
    assert fit.forecast_error > fit.rel_error > 0.05
    just_enough = [
        StepSample("draft", B, 1, V, 0.001 * B + 1e-7 * V)
        for B, V in ((1, 1000), (4, 1000), (1, 8000))
    ]
    assert fit_steps(just_enough)["draft"].forecast_error is None


def test_page_choice_and_proposer_work_are_priced_per_draft_step():
    """A cycle's page choice scores blocks once but rewrites the block table at every draft step,
    whatever the batch, and the proposer's own work grows with its drafts too: timed at q = 2, 5
    and 9 (cycles of 1, 4 and 8 drafts), both are fitted with a q term and priced so; samples
    that never varied q (profiles measured before) are fitted without it, never with a term they
    cannot pin."""
    from kapc.policy import page_choice

    select = [
        StepSample("select", B, q, V, 0.017 + 0.001 * B + 6e-7 * B * V + 0.003 * q)
        for B in (1, 4)
        for V in (2048, 8192)
        for q in (2, 5, 9)
    ]
    propose = [
        StepSample("propose", B, q, 2048, 0.0003 + 0.0001 * B + 0.0002 * q)
        for B in (1, 4)
        for q in (2, 5, 9)
    ]
    fits = fit_steps(select + propose)
    assert fits["select"].features == ("1", "B", "BV", "q")
    assert fits["propose"].forecast_error == pytest.approx(0.0, abs=1e-6)
    prof = msgspec.structs.replace(known_profile(), fits={**known_profile().fits, **fits})
    short, long = (page_choice(prof, 4, 4 * 8192, q) for q in (2, 9))
    assert long - short == pytest.approx(0.003 * 7, rel=1e-3)
    old = [msgspec.structs.replace(x, query=1) for x in select]
    assert fit_steps(old)["select"].features == ("1", "B", "BV")


def test_show_against_reports_the_forecast_of_held_out_steps(tmp_path):
    """`kapc calibrate show P --against Q`: P's forecast of the steps Q measured, per kind; a
    profile of another engine or model is refused with both keys named."""
    from typer.testing import CliRunner

    from kapc.cli import app

    truth = lambda B, V: 0.004 + 0.0005 * B + 2e-7 * B * V  # noqa: E731
    fitted = [StepSample("plain", B, 1, V, truth(B, V)) for B in (1, 8) for V in (2000, 8000)]
    # the held-out steps run 10% slower than the truth at batch 16
    held = [StepSample("plain", 16, 1, V, 1.1 * truth(16, V)) for V in (2000, 4000)]
    base = known_profile()
    p = save_profile(
        msgspec.structs.replace(base, samples=tuple(fitted), fits=fit_steps(fitted)),
        tmp_path / "p.json",
    )
    q = save_profile(msgspec.structs.replace(base, samples=tuple(held)), tmp_path / "q.json")
    r = CliRunner().invoke(app, ["calibrate", "show", str(p), "--against", str(q)])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.strip().startswith("plain") and "worst" in x)
    assert "2 steps" in line and "worst -9.1%" in line and "B=16" in line
    other = save_profile(known_profile("sha256:" + "1" * 64), tmp_path / "o.json")
    r = CliRunner().invoke(app, ["calibrate", "show", str(p), "--against", str(other)])
    assert r.exit_code != 0 and "same engine, model" in str(r.exception)


def test_calibrate_measure_refuses_bad_options_before_starting_anything():
    from typer.testing import CliRunner

    from kapc.cli import app
    from kapc.errors import KapcError

    for args, says in (
        (["--grid", "huge"], "--grid takes quick, default, full"),
        (["--only", "plain,bogus"], "--only takes"),
        (["--contexts", "2048,abc"], "--contexts takes positive integers"),
        (["--batches", "0"], "--batches takes positive integers"),
        (["--engine", "tgi"], "--engine must be vllm or reference"),
    ):
        r = CliRunner().invoke(app, ["calibrate", "measure", *args])
        assert isinstance(r.exception, KapcError) and says in str(r.exception), (args, r.output)


def test_compact_uses_a_profile_and_chooses_k(ctx, tmp_path):
    from kapc.compiler import compile_module
    from tests.conftest import example_priors

    path = save_profile(known_profile(ctx.assets.fingerprint), tmp_path / "p.json")
    assert load_profile(path) == known_profile(ctx.assets.fingerprint)
    prior = example_priors()[0]
    m = compile_module(
        prior,
        "ground,align-spans,select{budget-ratio=0.2},resolve-pages,"
        f"compact{{k=auto,profile={path}}}",
        ctx,
    ).module
    assert m.verify.k == 3 and m.cost.k == 3
    assert m.cost.basis == known_profile(ctx.assets.fingerprint).key
    assert m.cost.p == pytest.approx(0.8) and m.cost.break_even == pytest.approx(0.5, abs=1e-3)
    assert m.fallback.min_acceptance == pytest.approx(0.5, abs=1e-3)  # raised to break-even
    fixed = compile_module(
        prior,
        "ground,align-spans,select{budget-ratio=0.2},resolve-pages,"
        f"compact{{k=5,profile={path}}}",
        ctx,
    ).module
    assert fixed.verify.k == 5
    # a top-3 plan is priced with the profile's top-N verification (12 ms + 2 ms a query token)
    tol = save_profile(tolerant_profile(ctx.assets.fingerprint), tmp_path / "tol.json")
    top3 = compile_module(
        prior,
        "ground,align-spans,select{budget-ratio=0.2},resolve-pages,"
        f"compact{{k=3,accept=top3,profile={tol}}}",
        ctx,
    ).module
    assert top3.cost.speedup == pytest.approx(29.52 / 29, abs=1e-4)
    # a profile of another model is refused by name
    other = save_profile(known_profile(), tmp_path / "other.json")
    from kapc.passes import PassError

    with pytest.raises(PassError, match="calibrated for another model"):
        compile_module(
            prior, f"ground,align-spans,select,resolve-pages,compact{{profile={other}}}", ctx
        )


def test_access_view_reads_the_sink_the_plans_best_share_and_the_tail():
    import numpy as np

    from kapc.policy import AccessPolicy, PolicyError, access_view

    # 1000 tokens of 16: blocks 0..61, tail block 62 (8 tokens); budget 0.2 = 200 tokens
    plan = np.array([0, 3, 4, 5, 6, 7, 8, 9, 10, 62])
    dyn = access_view(AccessPolicy(mode="dynamic", budget=0.2), plan, 1000, 16)
    assert dyn.forced.tolist() == [0] and dyn.preferred.size == 0 and dyn.quota == 0
    assert dyn.keep == (200 - 8) // 16 and dyn.visible == dyn.keep * 16 + 8 <= 200
    hyb = access_view(AccessPolicy(mode="hybrid", budget=0.2), plan, 1000, 16)
    assert hyb.preferred.tolist() == [3, 4, 5, 6, 7, 8, 9, 10]  # the sink is forced, not preferred
    assert hyb.quota == (hyb.keep - 1) // 2  # the plan's 8 pages exceed half of what is left
    with pytest.raises(PolicyError, match="budget"):
        access_view(AccessPolicy(mode="hybrid", budget=0.0), plan, 1000, 16)


def test_compact_predicts_query_aware_plans_from_their_own_acceptance_model(ctx, tmp_path):
    from kapc.compiler import compile_module
    from kapc.profile import acceptance_key
    from tests.conftest import example_priors

    # static pages accept p = 0.5 whatever s; query-chosen ones p = 0.5 at s = 0.1, rising with s
    prof = known_profile(ctx.assets.fingerprint)
    dyn = AcceptanceFit(a=math.log(9) - 2.0 * math.log(0.3), b=2.0)  # p(0.3) = 0.9, p(0.1) ~ 0.5
    prof = msgspec.structs.replace(
        prof,
        acceptance={
            "greedy": AcceptanceFit(a=0.0, b=0.0),
            acceptance_key("greedy", "dynamic"): dyn,
        },
    )
    assert acceptance_key("greedy", "hybrid") == acceptance_key("greedy", "dynamic") != "greedy"
    path = save_profile(prof, tmp_path / "p.json")
    prior = example_priors()[0]
    head = "ground,align-spans,select{budget-ratio=0.2},resolve-pages,"

    def cost(opts: str):
        return compile_module(prior, head + f"compact{{k=4,profile={path}{opts}}}", ctx).module

    static = cost(",access=static")
    assert static.cost.p == pytest.approx(0.5)
    hybrid = cost(",access=hybrid,access-budget=0.3")
    assert hybrid.cost.p == pytest.approx(0.9, abs=1e-6)  # the dynamic model at the budget
    assert hybrid.access.budget == pytest.approx(0.3)
    assert hybrid.cost.speedup > static.cost.speedup
    # budget "plan": the view reads as much as the plan's own pages
    matched = cost(",access=dynamic,access-budget=plan")
    assert matched.access.budget == pytest.approx(matched.pages.retained, abs=1e-6)
    assert matched.cost.p == pytest.approx(dyn.p(matched.pages.retained, matched.prompt.tokens))
    # no query-aware model in the profile: the plan's pages' model stands in
    only_static = save_profile(
        msgspec.structs.replace(prof, acceptance={"greedy": AcceptanceFit(a=0.0, b=0.0)}),
        tmp_path / "s.json",
    )
    m = compile_module(
        prior, head + f"compact{{k=4,profile={only_static},access=hybrid}}", ctx
    ).module
    assert m.cost.p == pytest.approx(0.5)


def test_the_clock_totals_each_kind_over_a_run_undecayed_and_unclipped():
    """What a run's forecast got wrong, kind by kind: the factors decay and clip a step at 4x
    (so that one pause moves them little); the totals are the plain sums, and reset on demand."""
    clock = StepClock(known_profile())
    clock.record("draft", 0.030, 0.020)
    clock.tick()
    clock.record("draft", 0.500, 0.020)  # a pause: 25x the prediction, clipped in the factor
    clock.record("verify", 0.100, 0.090)
    assert clock.factor("draft") < 4.0
    totals = clock.totals()
    assert totals["draft"] == pytest.approx({"observed_s": 0.530, "predicted_s": 0.040, "steps": 2})
    assert totals["verify"] == pytest.approx(
        {"observed_s": 0.100, "predicted_s": 0.090, "steps": 1}
    )
    assert clock.totals(reset=True) == totals
    assert clock.totals() == {}
    clock.record("draft", 0.010, 0.020)
    assert clock.totals()["draft"]["steps"] == 1


def test_a_step_is_expected_to_emit_each_drafting_rows_accepted_drafts_and_one_token_each():
    rows = [DraftRow(p=0.8, k=3, s=0.1, context=4096), DraftRow(p=0.5, k=2, s=0.1, context=4096)]
    assert step_tokens(rows, [4096, 4096]) == pytest.approx(
        tokens_per_cycle(0.8, 3) + tokens_per_cycle(0.5, 2) + 2
    )
    assert step_tokens([], [4096]) == 1


def test_a_runs_forecast_counts_the_steps_it_did_not_forecast_on_both_sides():
    # 10 s forecast for what 15 s of unplanned steps would emit: 1.5x; with a 2 s prefill that
    # both runs spend, (15 + 2) / (10 + 2)
    assert run_forecast(10.0, 15.0) == pytest.approx(1.5)
    assert run_forecast(10.0, 15.0, 2.0) == pytest.approx(17 / 12)
    # a predicted loss stays a loss, only nearer 1
    assert 1 > run_forecast(10.0, 8.0, 2.0) > run_forecast(10.0, 8.0)
    assert run_forecast(0.0, 5.0, 1.0) is None


def test_rows_features_of_uniform_rows_are_feature_values():
    from kapc.profile import feature_values, rows_features

    assert rows_features([5] * 8, [4096] * 8) == pytest.approx(feature_values(8, 5, 4096))
    # mixed rows: sums over rows, and sqrt(B) times the mean context
    mixed = rows_features([1, 3], [1000, 3000])
    assert mixed["Bq"] == 4 and mixed["BV"] == 4000 and mixed["BqV"] == 10000
    assert mixed["sqrtBV"] == pytest.approx(math.sqrt(2) * 2000)


def test_calibrate_refit_fits_a_profiles_own_samples_again(tmp_path):
    """`kapc calibrate refit` brings a profile fitted with older features up to this kapc's
    (FEATURES), from the samples it holds, measuring nothing."""
    from typer.testing import CliRunner

    from kapc.cli import app

    samples = tuple(
        StepSample("resting", B, 1, V, 0.004 + 0.0005 * B + 2e-7 * math.sqrt(B) * V)
        for B in (1, 4, 8)
        for V in (2000, 4000, 8000)
    )
    old = msgspec.structs.replace(
        known_profile(),
        samples=samples,
        fits={
            **known_profile().fits,
            "resting": StepFit(
                features=("1", "B", "BV"), coef=(0.01, 0, 1e-7), rel_error=0.1, samples=len(samples)
            ),
        },
    )
    path = save_profile(old, tmp_path / "p.json")
    r = CliRunner().invoke(app, ["calibrate", "refit", str(path)])
    assert r.exit_code == 0, r.output
    assert "fitted again" in r.output
    new = load_profile(path)
    assert new.samples == old.samples and new.created == old.created
    assert new.fits["resting"].features == ("1", "B", "BV", "sqrtBV")
    assert new.seconds("resting", 8, 8000) == pytest.approx(
        0.004 + 0.004 + 2e-7 * math.sqrt(8) * 8000
    )
    # kinds without samples keep their fits (the known profile's, written by hand)
    assert new.fits["draft"] == old.fits["draft"]


AVX2 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx fma avx2\n"
AVX512_BF16 = (
    "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512bw avx512_bf16\n"
)


def test_a_profile_names_the_cpu_by_model_and_the_instructions_that_price_its_steps():
    # cloud machines share a model name across CPUs with and without AVX-512
    assert machine_cpu(AVX2) == "AMD EPYC (avx2)"
    assert machine_cpu(AVX512_BF16) == "AMD EPYC (avx512_bf16)"
    assert machine_cpu(AVX2) != machine_cpu(AVX512_BF16)
    assert machine_cpu("") != ""  # elsewhere: the platform's names
    base = known_profile()
    keys = {msgspec.structs.replace(base, cpu=machine_cpu(t)).key for t in (AVX2, AVX512_BF16)}
    assert len(keys | {base.key}) == 3  # two CPUs' profiles never overwrite each other


def test_only_a_profile_of_this_cpu_or_of_none_named_is_found(tmp_path, monkeypatch):
    monkeypatch.setenv("KAPC_CACHE_DIR", str(tmp_path))
    fp = known_profile().model_fingerprint
    avx2, avx512 = machine_cpu(AVX2), machine_cpu(AVX512_BF16)
    save_profile(msgspec.structs.replace(known_profile(), cpu=avx2, created="avx2"))
    assert find_profile("vllm-cpu", fp, cpu=avx512) is None
    assert find_profile("vllm-cpu", fp, cpu=avx2).created == "avx2"
    # a profile from before profiles named their CPU is taken as this machine's
    save_profile(msgspec.structs.replace(known_profile(), created="unnamed"))
    assert find_profile("vllm-cpu", fp, cpu=avx512).created == "unnamed"


def test_a_profile_timed_with_the_workers_thread_count_is_found_before_a_newer_one(
    tmp_path, monkeypatch
):
    # a served worker computes on one core of two; a profile timed on both prices its steps
    # too fast, so the hook takes the one timed as it runs, wherever there is one
    monkeypatch.setenv("KAPC_CACHE_DIR", str(tmp_path))
    fp, cpu = known_profile().model_fingerprint, machine_cpu(AVX2)
    one = save_profile(msgspec.structs.replace(known_profile(), cpu=cpu, threads=1, created="1"))
    two = save_profile(msgspec.structs.replace(known_profile(), cpu=cpu, threads=2, created="2"))
    os.utime(one, (1, 1))  # the one-thread profile is the older
    assert one != two  # the thread count is part of the key: neither overwrites the other
    assert find_profile("vllm-cpu", fp, cpu=cpu, threads=1).created == "1"
    assert find_profile("vllm-cpu", fp, cpu=cpu, threads=2).created == "2"
    # no count given, or none timed with it: the newest
    assert find_profile("vllm-cpu", fp, cpu=cpu).created == "2"
    os.utime(two, (0, 0))
    assert find_profile("vllm-cpu", fp, cpu=cpu, threads=4).created == "1"


def test_a_compile_for_an_engine_prices_plans_with_the_profile_of_its_workers_threads(
    ctx, tmp_path, monkeypatch
):
    # a server's compile process names its worker's thread count, so a plan is priced with the
    # profile the hook decides its steps with, not a newer one timed in-process on every core
    from kapc.compiler import compile_module
    from kapc.passes import CompileContext
    from tests.conftest import example_priors

    monkeypatch.setenv("KAPC_CACHE_DIR", str(tmp_path))
    base = msgspec.structs.replace(known_profile(ctx.assets.fingerprint), cpu=machine_cpu())
    keys = {n: save_profile(msgspec.structs.replace(base, threads=n)).stem for n in (1, 2)}
    pipeline = "ground,align-spans,select{budget-ratio=0.2},resolve-pages,compact{k=auto}"
    for threads in (1, 2):
        served = CompileContext(assets=ctx.assets, engine="vllm-cpu", threads=threads)
        m = compile_module(example_priors()[0], pipeline, served).module
        assert m.cost.basis == keys[threads]
