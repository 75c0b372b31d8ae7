"""The plan session without an engine (as vLLM tests its ngram proposer): admission under an
engine's rules, the bookkeeping of drafts, and the report both runtimes return. Real plans of a
real HotpotQA prompt for the real model's fingerprint; no weights are loaded."""

from __future__ import annotations

import numpy as np
import pytest

from kapc.lower.kapb import FallbackPolicy, encode_plan
from kapc.policy import MAX_BLOCK_MOVES, AccessPolicy
from kapc.runtime.planning import PlanTarget, plan_from_blocks
from kapc.runtime.session import (
    EngineRules,
    PlanSession,
    RequestOptions,
    RunReport,
    fallback_cause,
)

BLOCK = 16


@pytest.fixture(scope="module")
def prompt(ctx):
    from kapc.runtime.prompts import build_prompt

    return build_prompt(ctx.assets.path, 0, max_own_tokens=1000).token_ids


@pytest.fixture(scope="module")
def target(ctx):
    return PlanTarget(ctx.assets)


def plan_of(target, prompt, **kw):
    blocks = list(range(0, len(prompt) // BLOCK, 5))  # every fifth block: s about 0.2
    return plan_from_blocks(target, prompt, blocks, block_size=BLOCK, **{"pays": True, **kw})


def rules(target, **kw) -> EngineRules:
    return EngineRules(
        block_size=kw.pop("block_size", BLOCK),
        layers=30,
        fingerprint=lambda: target.fingerprint,
        **kw,
    )


def admitted(target, prompt, opts=None, plan=None, **kw) -> PlanSession:
    s = PlanSession(tag="t")
    s.admit(plan or plan_of(target, prompt), prompt, opts or RequestOptions(), rules(target, **kw))
    return s


def test_a_matching_plan_drafts_on_its_engine_blocks(target, prompt):
    plan = plan_of(target, prompt, k=5)
    s = admitted(target, prompt, plan=plan)
    assert s.status == "plan" and s.ran and s.reason is None and s.k == 5 and s.topn == 1
    assert s.tail_block == (len(prompt) - 1) // BLOCK
    assert list(s.selected) == sorted(set(plan.positions // BLOCK) - {s.tail_block})
    assert s.retained_ratio == pytest.approx(len(plan.positions) / len(prompt))
    assert s.note is None  # the plan's own block size: nothing adapted
    # .kapb bytes are decoded and admitted alike
    data = encode_plan(plan.header, plan.prompt_token_ids, plan.selected_blocks, plan.positions)
    again = admitted(target, prompt, plan=data)
    assert again.report().as_dict() == s.report().as_dict()


def test_a_coarser_engine_block_reads_a_superset_and_says_so(target, prompt):
    s = admitted(target, prompt, block_size=2 * BLOCK)
    assert s.status == "plan" and "block size 16, run on the engine's 32" in s.note
    assert s.retained_ratio >= admitted(target, prompt).retained_ratio


def test_what_cannot_apply_is_refused_with_the_reason(target, prompt):
    other = admitted(target, prompt[:-1] + [prompt[-1] + 1], plan=plan_of(target, prompt))
    assert other.status == "refused" and "another prompt" in other.reason and not other.ran
    assert other.error is not None  # the reference executor raises it when asked to
    wrong = EngineRules(block_size=BLOCK, layers=30, fingerprint=lambda: "sha256:" + "1" * 64)
    model = PlanSession(tag="m")
    model.admit(plan_of(target, prompt), prompt, RequestOptions(), wrong)
    assert model.status == "refused" and "another model" in model.reason
    bad = admitted(target, prompt, RequestOptions(access=AccessPolicy(mode="dynamic", budget=2)))
    assert bad.status == "refused" and "access budget 2" in bad.reason
    torn = PlanSession(tag="x")
    torn.admit(b"KAPB-not-really", prompt, RequestOptions(), rules(target))
    assert torn.status == "refused" and torn.reason.startswith("plan refused:")


def test_an_engine_without_proxies_refuses_them_never_substitutes(target, prompt):
    es = RequestOptions(access=AccessPolicy(mode="hybrid", budget=0.3, proxy="es-in"))
    said = "fused forward hides earlier layers"
    s = admitted(target, prompt, es, proxy_problem=said)
    assert s.status == "refused" and "access proxy es-in" in s.reason and said in s.reason
    query = RequestOptions(access=AccessPolicy(mode="hybrid", budget=0.3))
    ok = admitted(target, prompt, query, proxy_problem=said)
    assert ok.status == "plan" and ok.access.proxy == "query" and ok.view.keep > 0
    assert admitted(target, prompt, es).status == "plan"  # an engine that computes them


def test_unreadable_keys_leave_static_pages_with_a_note(target, prompt):
    hybrid = RequestOptions(access=AccessPolicy(mode="hybrid", budget=0.3))
    s = admitted(target, prompt, hybrid, keys_unreadable="no reader fits")
    assert s.status == "plan" and s.access is None and s.note == "static pages: no reader fits"
    live = admitted(target, prompt, hybrid)
    assert live.access is not None and live.retained_ratio == pytest.approx(
        live.view.visible / len(prompt)
    )
    live.bounds = object()
    live.static_again("key bounds failed")
    assert live.access is None and live.bounds is None and live.view is None
    assert live.retained_ratio == pytest.approx(live.static_visible / len(prompt))
    assert live.report().access == "static" and "key bounds failed" in live.note


def test_the_engines_exceptions_to_the_plans_rules_are_explicit(target, prompt):
    losing = plan_of(target, prompt, pays=False)
    # the plan's own cost model says no gain: plain decoding, unless the request insists ...
    s = admitted(target, prompt, plan=losing)
    assert s.status == "fallback" and "predicts no gain" in s.reason and not s.ran
    forced = admitted(target, prompt, RequestOptions(honor_predicted_loss=False), plan=losing)
    assert forced.status == "plan" and forced.forced
    # ... or a profile prices every step instead (the step planner decides, not the header)
    assert admitted(target, prompt, plan=losing, profiled=True).status == "plan"
    floor = FallbackPolicy(min_acceptance=0.5, acceptance_window=8)
    assert (
        admitted(
            target, prompt, plan=plan_of(target, prompt, fallback=floor)
        ).monitor.min_acceptance
        == 0.5
    )
    profiled = admitted(target, prompt, plan=plan_of(target, prompt, fallback=floor), profiled=True)
    assert profiled.monitor.min_acceptance == 0.0
    # the engine's k caps the plan's; a request's k and rule override it
    assert admitted(target, prompt, plan=plan_of(target, prompt, k=6), k=4).k == 4
    top = admitted(target, prompt, RequestOptions(k=2, accept="top3"))
    assert (top.k, top.topn, top.accept) == (2, 3, "top3")
    assert admitted(target, prompt, RequestOptions(k=0)).status == "fallback"
    sampled = PlanSession(tag="s")
    sampled.admit(
        plan_of(target, prompt),
        prompt,
        RequestOptions(accept="top3"),
        rules(target),
        random_sampling=True,
    )
    # drafted, verified by rejection sampling; the asked tolerance is off and the report says so
    assert sampled.drafting and (sampled.accept, sampled.topn) == ("sampled", 1)
    assert "top3" in sampled.note and "rejection sampling" in sampled.note
    narrow = admitted(target, prompt, RequestOptions(max_view_blocks=2), workspace_blocks=64)
    assert narrow.status == "fallback" and narrow.reason.startswith("workspace:")


def test_drafts_are_booked_until_the_plan_stops_paying(target, prompt):
    floor = FallbackPolicy(min_acceptance=0.5, acceptance_window=8)
    s = admitted(target, prompt, plan=plan_of(target, prompt, k=4, fallback=floor))
    row = s.draft_row(4, len(prompt) + 1)
    assert row.k == 4 and row.p == pytest.approx(0.85) and not row.chooses_pages
    s.drafted(4)
    assert s.report().proposed == 0  # not verified yet
    s.verified(3)
    s.drafted(4)
    s.verified(4)
    assert s.report().accepted_per_pos == [2, 2, 2, 1]
    # the plan's 0.85, worth 16 tries, moved by 7 of 8 tried
    assert s.tried == 8 and s.draft_row(4, 99).p == pytest.approx((16 * 0.85 + 7) / 24)
    s.drafted(4)
    s.verified(0)
    assert s.status == "plan"  # 7 of 12: still above the floor over the last 8
    s.drafted(4)
    s.verified(0)
    assert s.status == "fallback" and "below the plan's min_acceptance" in s.reason
    r = s.report()
    assert isinstance(r, RunReport) and r.ran and r.proposed == 16 and r.accepted == 7
    assert r.draft_cycles == 4 and r.acceptance_rate == pytest.approx(7 / 16)
    s.fall_back("drafting failed")
    assert s.last_drafted == 0 and s.reason == "drafting failed"


def test_blocks_the_engine_moved_drop_their_key_bounds_and_then_the_plan(target, prompt):
    """A preempted request comes back in other KV blocks: what was read from the old ones (key
    bounds) is read again, and a request moved too often decodes plainly (metadata stability)."""
    s = admitted(target, prompt)
    table = np.arange(100, 100 + s.tail_block + 3)  # the prompt's blocks, then decode blocks
    assert s.check_blocks(table) and s.block_moves == 0
    s.bounds = "read from the first blocks"
    grown = np.concatenate([table, [7]])  # decoding adds blocks past the prompt: no move
    assert s.check_blocks(grown) and s.bounds is not None and s.block_moves == 0
    for move in range(1, MAX_BLOCK_MOVES + 1):
        s.bounds = "read again"
        assert s.check_blocks(table + 1000 * move)
        assert s.bounds is None and s.block_moves == move and s.status == "plan"
    assert not s.check_blocks(table)
    r = s.report()
    assert r.status == "fallback" and r.block_moves == MAX_BLOCK_MOVES + 1
    assert r.reason.startswith("metadata stability") and r.ran
    assert fallback_cause(r.reason) == "metadata_stability"


def test_a_session_without_a_plan_reports_plain_decoding(prompt):
    r = PlanSession(tag="plain", prompt_tokens=len(prompt)).report()
    assert (r.status, r.ran, r.plan, r.k, r.proposed, r.acceptance_rate) == (
        "none",
        False,
        None,
        0,
        0,
        None,
    )
    assert np.asarray(PlanSession(tag="x").selected).size == 0
