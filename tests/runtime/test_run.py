"""`run_plan_file`, what `kapc run plan.kapb` calls, on a real plan file and the real model."""

from __future__ import annotations

import json

import pytest

from kapc.lower.kapb import FallbackPolicy, encode_plan, write_plan
from kapc.runtime.planning import plan_from_blocks
from kapc.runtime.prompts import build_prompt
from kapc.runtime.run import format_report, run_plan_file

from .conftest import BLOCK

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def plan_file(model, tmp_path_factory):
    p = build_prompt(model.path, 3, max_own_tokens=300)
    plan = plan_from_blocks(
        model,
        p.token_ids,
        [0] + p.gold_blocks(BLOCK) + p.question_blocks(BLOCK),
        block_size=BLOCK,
        k=4,
        pays=True,
        fallback=FallbackPolicy(max_retained=0.95, min_acceptance=0.0),
    )
    path = tmp_path_factory.mktemp("plans") / "q3.kapb"
    write_plan(
        path, encode_plan(plan.header, plan.prompt_token_ids, plan.selected_blocks, plan.positions)
    )
    return path, plan


def test_run_plan_file_compare_full(model, plan_file):
    path, plan = plan_file
    r = run_plan_file(path, max_tokens=12, compare_full=True, model=model)
    for key in (
        "text",
        "retained_ratio",
        "acceptance_rate",
        "tokens_per_cycle",
        "speedup_predicted",
        "identical_to_full",
        "speedup_measured",
    ):
        assert key in r
    assert r["mode"] == "plan" and r["fallback_reason"] is None
    assert r["identical_to_full"] is True and r["text"] == r["full_text"]
    assert r["retained_ratio"] == pytest.approx(plan.header.retained_ratio)
    assert r["speedup_predicted"] == plan.header.cost.speedup
    assert r["generated_tokens"] <= 12 and r["text"]
    json.dumps(r)  # --json
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(format_report(r))
    out = console.export_text()
    assert "acceptance" in out and "identical" in out


def test_run_plan_file_overrides(model, plan_file):
    path, _ = plan_file
    r = run_plan_file(path, accept="top3", k=2, max_tokens=6, model=model)
    assert r["accept"] == "top3" and r["k"] == 2 and "identical_to_full" not in r
