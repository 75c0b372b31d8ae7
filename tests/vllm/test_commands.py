"""Every command that offers vLLM as its engine, run as a user runs it, in a process of its own
(each starts its own engine) on the real model: `kapc run --engine vllm`, `kapc calibrate
measure --engine vllm` (on a grid small enough for a test, as the reference executor's test
does) and the vLLM decoding benchmark. The reference engine's choices are tested beside their
commands (tests/test_cli_run.py, tests/runtime/test_calibrate.py, tests/bench/test_sweep.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kapc.profile import load_profile
from tests.conftest import EXAMPLES


def _run(argv: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_kapc_run_on_vllm_decodes_the_plan_identically(tmp_path):
    plan = tmp_path / "q3.kapb"
    prior = EXAMPLES / "hotpotqa" / "q0003-1k.prior.json"
    _run([sys.executable, "-m", "kapc", "compile", str(prior), "-o", str(plan)])
    done = _run(
        [sys.executable, "-m", "kapc", "run", str(plan), "--engine", "vllm"]
        + ["--compare-full", "--force", "--max-tokens", "24", "--json"]
    )
    out = json.loads(done.stdout)
    assert out["engine"] == "vllm" and out["mode"] == "plan" and out["status"] == "plan"
    assert out["identical_to_full"] and out["proposed"] > 0 and 0 < out["generated_tokens"] <= 24


def test_kapc_calibrate_measures_a_vllm_profile(tmp_path):
    out = tmp_path / "vllm.json"
    code = (
        "import sys\n"
        "from kapc.runtime import calibrate as cal\n"
        "cal.GRIDS['quick'] = cal.Grid(contexts=(512,), batches=(1, 2), pairs=((0.5, 3),),"
        " select_pair=None, tolerant_pairs=(), steps=3, acceptance_questions=0)\n"
        "from kapc.cli import app\n"
        f"sys.argv = ['kapc', 'calibrate', 'measure', '--grid', 'quick', '-o', {str(out)!r}]\n"
        "app()\n"
    )
    done = _run([sys.executable, "-c", code])
    profile = load_profile(out)
    assert profile.engine == "vllm-cpu" and f"profile {profile.key}" in done.stdout
    kinds = {x.kind for x in profile.samples}
    assert {"plain", "resting", "draft", "verify"} <= kinds, kinds
    assert {x.batch for x in profile.samples if x.kind == "resting"} == {1, 2}
    # timed as `kapc serve` runs vLLM: its worker on every core but the one vLLM reserves for
    # the engine core, and the profile keyed by that thread count
    assert "served" in profile.note
    assert profile.threads == max(1, len(os.sched_getaffinity(0)) - 1)
    assert f"-t{profile.threads}-" in profile.key


def test_the_vllm_decoding_benchmark_compares_the_three_engines(tmp_path):
    rows_file = tmp_path / "rows.json"
    _run(
        [sys.executable, "-m", "benchmarks.vllm_decode", "--in-process", "--no-interleave"]
        + ["--contexts", "1024", "--batches", "2", "--methods", "full,kapc,ngram"]
        + ["--max-tokens", "16", "--json", str(rows_file)]
    )
    rows = {r["method"]: r for r in json.loads(rows_file.read_text())}
    assert set(rows) == {"full", "kapc", "ngram"}
    assert rows["kapc"]["identical_to_full"] and rows["ngram"]["identical_to_full"]
    assert all(r["out_tok_s"] > 0 for r in rows.values())
