"""A new user's first run: an empty model cache, `kapc compile` first (which converts only the
tokenizer), then `kapc run` (which converts the weights). Both must agree on the model: a plan
compiled from a fresh cache runs, in separate processes, exactly as `make demo` runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import EXAMPLES

pytestmark = pytest.mark.model


def kapc(*args: str, cache) -> subprocess.CompletedProcess:
    env = dict(os.environ, KAPC_CACHE_DIR=str(cache))
    return subprocess.run(
        [sys.executable, "-m", "kapc", *args], capture_output=True, text=True, env=env, timeout=600
    )


def test_compile_then_run_from_an_empty_cache(tmp_path):
    cache = tmp_path / "cache"
    plan = tmp_path / "plan.kapb"
    prior = EXAMPLES / "hotpotqa" / "q0000-700.prior.json"
    c = kapc("compile", str(prior), "-o", str(plan), cache=cache)
    assert c.returncode == 0, c.stderr
    model_dir = cache / "models" / "smollm2-135m-instruct"
    assert (model_dir / "tokenizer.ok").exists() and not (model_dir / "weights.ok").exists()
    r = kapc("run", str(plan), "--max-tokens", "4", "--force", "--json", cache=cache)
    assert r.returncode == 0, r.stderr
    assert (model_dir / "weights.ok").exists()  # the run converted the weights, and still agreed
    out = json.loads(r.stdout)
    assert out["mode"] == "plan" and out["generated_tokens"] >= 1
    # and the fingerprint the compiler records now is the one it recorded before the weights came
    again = tmp_path / "again.kapb"
    c2 = kapc("compile", str(prior), "-o", str(again), cache=cache)
    assert c2.returncode == 0, c2.stderr
    assert again.read_bytes() == plan.read_bytes()
