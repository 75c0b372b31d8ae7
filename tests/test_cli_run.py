"""`kapc run` through the command line, on the real model: the JSON fields the issue names, and the
lossless law as the user sees it."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kapc.cli import app
from tests.conftest import EXAMPLES

runner = CliRunner()


def test_run_json_compare_full(tmp_path):
    plan = tmp_path / "plan.kapb"
    prior = EXAMPLES / "hotpotqa" / "q0000-700.prior.json"
    r = runner.invoke(
        app,
        [
            "compile",
            str(prior),
            "-o",
            str(plan),
            "--passes",
            "ground,align-spans,select{budget-ratio=0.3},resolve-pages,compact{k=4}",
        ],
    )
    assert r.exit_code == 0, r.output
    r = runner.invoke(
        app, ["run", str(plan), "--max-tokens", "12", "--compare-full", "--force", "--json"]
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    for key in (
        "text",
        "retained_ratio",
        "acceptance_rate",
        "tokens_per_cycle",
        "speedup_predicted",
        "identical_to_full",
        "speedup_measured",
    ):
        assert key in out, key
    assert out["identical_to_full"] is True and out["text"]
    assert out["mode"] == "plan"
    # the plan records s to six digits; the executor reports visible / prompt tokens exactly
    assert abs(out["retained_ratio"] - out["plan_retained_ratio"]) < 1e-6
    assert 0.0 <= out["acceptance_rate"] <= 1.0


def test_run_refuses_a_corrupt_plan_with_a_message(tmp_path):
    bad = tmp_path / "bad.kapb"
    bad.write_bytes(b"KAPB\x00\r\n\x1a" + b"\x00" * 10)
    r = runner.invoke(app, ["run", str(bad)])
    assert r.exit_code != 0 and "truncated" in str(r.exception)
