"""GPU readiness, checked on the CPU: the executor's lossless law in bfloat16 (the dtype it runs
on a GPU), and the prepared GPU measurement script end to end on a tiny random model."""

from __future__ import annotations

import json

import pytest
import torch

from kapc.runtime.executor import Executor, Request

from .conftest import BLOCK, gold_plan

pytestmark = pytest.mark.model


def test_bf16_plan_decoding_is_lossless(prompts):
    from kapc.runtime.model import load_model

    m = load_model(dtype=torch.bfloat16)
    assert m.dtype == torch.bfloat16
    ex = Executor(m, block_size=BLOCK, kv_cache_gib=0.25, prefix_cache=True)
    p = prompts[0]
    n = 12
    (full,), _ = ex.generate([Request(p.token_ids, max_tokens=n)])
    (plan,), _ = ex.generate([Request(p.token_ids, plan=gold_plan(m, p, k=4), max_tokens=n)])
    assert plan.mode == "plan" and plan.proposed > 0
    assert plan.tokens == full.tokens


def test_gpu_script_runs_end_to_end_on_a_tiny_model(tmp_path):
    from benchmarks.gpu import main

    rc = main(
        [
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--shape",
            "tiny",
            "--contexts",
            "128,256",
            "--batches",
            "1,2",
            "--steps",
            "2",
        ]
    )
    assert rc == 0
    prof = json.loads((tmp_path / "profile.json").read_text())
    assert prof["engine"] == "reference" and "RANDOM WEIGHTS" in prof["note"]
    assert {"plain", "draft", "verify", "verify_tolerant"} <= set(prof["fits"])
    # 2 contexts x 2 batches: a plain step, three (s, q) cycles and two top-3 verifications each,
    # and nothing timed twice under another kind's name
    kinds = [smp[0] for smp in prof["samples"]]  # StepSample is array-like: kind first
    assert {k: kinds.count(k) for k in set(kinds)} == {
        "plain": 4,
        "draft": 12,
        "propose": 12,
        "verify": 12,
        "verify_tolerant": 8,
    }
    assert len((tmp_path / "steps.jsonl").read_text().splitlines()) == len(prof["samples"])


def test_the_prepared_gpu_check_refuses_without_a_gpu(tmp_path):
    """`python -m benchmarks.gpu_check` runs only where there is a CUDA GPU and vLLM's GPU
    package: here it refuses at once, says why, and writes nothing."""
    import subprocess
    import sys

    out = tmp_path / "gpu"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "gpu_check: refused: no CUDA GPU is visible" in done.stderr
    assert not out.exists()
