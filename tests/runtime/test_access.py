"""Query-aware access policies in the reference executor, on the real SmolLM2 and real HotpotQA
prompts (~1K tokens): every policy and proxy stays lossless under greedy verification, the view
reads what the policy says, and a query-chosen view follows the draft better than a poor static
one."""

from __future__ import annotations

import pytest
import torch

from kapc.lower.kapb import FallbackPolicy
from kapc.policy import AccessPolicy, PolicyError
from kapc.runtime import selection
from kapc.runtime.executor import Request
from kapc.runtime.planning import plan_from_blocks

from .conftest import BLOCK, NEW_TOKENS, gold_plan

pytestmark = pytest.mark.model

POLICIES = [
    AccessPolicy(mode="dynamic", budget=0.2),
    AccessPolicy(mode="hybrid", budget=0.3),
    AccessPolicy(mode="dynamic", budget=0.2, proxy="es-in"),
    AccessPolicy(mode="hybrid", budget=0.3, proxy="es-mid"),
    AccessPolicy(mode="dynamic", budget=0.2, proxy="es-mix", mix=("in", "mid") * 15),
]


@pytest.mark.parametrize("access", POLICIES, ids=lambda a: f"{a.mode}-{a.proxy}")
def test_every_access_policy_is_lossless_for_a_batch(
    model, executor, prompts, full_outputs, access
):
    plans = [gold_plan(model, p, k=4) for p in prompts]
    reqs = [
        Request(p.token_ids, plan=pl, max_tokens=NEW_TOKENS, access=access)
        for p, pl in zip(prompts, plans)
    ]
    results, stats = executor.generate(reqs)
    # one choice per layer per draft cycle
    assert stats.select_calls > 0 and stats.select_calls % model.num_layers == 0
    for r, p, pl, full in zip(results, prompts, plans, full_outputs):
        assert r.tokens == full
        assert r.mode == "plan" and r.access == access.mode and r.proposed > 0
        # the proposal read `budget` of the prompt (or the plan's own pages, if more)
        assert r.retained_ratio <= max(access.budget, pl.header.retained_ratio) + 1e-9
        assert r.retained_ratio >= access.budget - 2 * BLOCK / len(p.token_ids)


def test_proxy_overlap_is_measured_per_layer(model, executor, prompts):
    p = prompts[0]
    executor.measure_overlap = True
    try:
        (r,), stats = executor.generate(
            [
                Request(
                    p.token_ids,
                    plan=gold_plan(model, p, k=4),
                    max_tokens=12,
                    access=AccessPolicy(mode="dynamic", budget=0.2, proxy="es-mid"),
                )
            ]
        )
    finally:
        executor.measure_overlap = False
    overlap = stats.overlap_by_layer()
    # layer 0 chooses from its own query; every later layer is scored against it
    assert sorted(overlap) == list(range(1, model.num_layers))
    assert all(0.0 <= v <= 1.0 for v in overlap.values())
    assert sum(overlap.values()) / len(overlap) > 0.5  # a proxy far better than chance


def test_a_query_chosen_view_follows_the_draft_better_than_a_poor_static_one(
    model, executor, prompts, full_outputs
):
    """A static plan of distractor passages accepts little; the dynamic view at the same budget,
    chosen by the drafts' own queries, accepts more, and both stay lossless."""
    p = prompts[0]
    blocks = p.distractor_blocks(BLOCK)[::2]
    plan = plan_from_blocks(
        model,
        p.token_ids,
        blocks,
        block_size=BLOCK,
        k=4,
        pays=True,
        fallback=FallbackPolicy(min_acceptance=0.0),
    )
    budget = plan.header.retained_ratio
    n = NEW_TOKENS
    (static,), _ = executor.generate([Request(p.token_ids, plan=plan, max_tokens=n)])
    (dynamic,), _ = executor.generate(
        [
            Request(
                p.token_ids,
                plan=plan,
                max_tokens=n,
                access=AccessPolicy(mode="dynamic", budget=budget),
            )
        ]
    )
    assert static.tokens == dynamic.tokens == full_outputs[0][:n]
    assert dynamic.retained_ratio <= budget + 1e-9
    assert dynamic.acceptance_rate > static.acceptance_rate + 0.1


def test_a_static_request_beside_dynamic_ones_keeps_its_view(
    model, executor, prompts, full_outputs
):
    plans = [gold_plan(model, p, k=4) for p in prompts]
    access = [
        None,
        AccessPolicy(mode="dynamic", budget=0.2),
        AccessPolicy(mode="hybrid", budget=0.3),
    ]
    reqs = [
        Request(p.token_ids, plan=pl, max_tokens=NEW_TOKENS, access=a)
        for p, pl, a in zip(prompts, plans, access)
    ]
    results, _ = executor.generate(reqs)
    assert [r.tokens for r in results] == full_outputs[: len(results)]
    assert results[0].access == "static"
    assert results[0].retained_ratio == pytest.approx(plans[0].header.retained_ratio)


def test_a_bad_access_policy_is_refused(model, executor, prompts):
    p = prompts[0]
    free = executor.cache.num_free_blocks
    with pytest.raises(PolicyError, match="budget"):
        executor.generate(
            [
                Request(
                    p.token_ids,
                    plan=gold_plan(model, p),
                    max_tokens=4,
                    access=AccessPolicy(mode="dynamic", budget=0.0),
                )
            ]
        )
    with pytest.raises(PolicyError, match="mix has 2 layers"):
        executor.generate(
            [
                Request(
                    p.token_ids,
                    plan=gold_plan(model, p),
                    max_tokens=4,
                    access=AccessPolicy(
                        mode="dynamic", budget=0.2, proxy="es-mix", mix=("in", "mid")
                    ),
                )
            ]
        )
    assert executor.cache.num_free_blocks == free  # refused before anything was allocated


def test_key_bounds_bound_every_key_of_a_block():
    """Quest's bound: for any query, the block score's upper bound is at least q.k for every key in
    the block (per head, before the softmax)."""
    torch.manual_seed(0)
    L, kvh, blocks, bs, hd = 1, 2, 5, 4, 8
    pool = torch.randn(L, kvh, blocks, bs, hd)
    lo, hi = selection.KeySummaries.of_blocks(pool, torch.arange(blocks))
    q = torch.randn(kvh, hd)
    ub = (q[:, None].clamp(min=0) * hi[0] + q[:, None].clamp(max=0) * lo[0]).sum(-1)  # [kvh, n]
    exact = torch.einsum("hd,hnbd->hnb", q, pool[0]).amax(-1)
    assert torch.all(ub >= exact - 1e-5)


def test_stacked_rows_give_each_layer_their_own_blocks_bounds():
    """Rows of different lengths laid end to end: each layer's gathered bounds are the row's own,
    in order, and the padding is masked."""
    torch.manual_seed(0)
    L, kvh, bs, hd = 2, 2, 4, 8
    pool = torch.randn(L, kvh, 6, bs, hd)
    pools = [torch.tensor([4, 1]), torch.tensor([0, 5, 2])]
    rows = [(*selection.KeySummaries.of_blocks(pool, p), p) for p in pools]
    summ = selection.KeySummaries.stack(rows)
    assert summ.valid.tolist() == [[True, True, False], [True, True, True]]
    assert summ.tables[1].tolist() == [0, 5, 2] and summ.tables[0, :2].tolist() == [4, 1]
    for layer in range(L):
        lo, hi = summ.layer(layer)
        for row, (want_lo, want_hi, p) in enumerate(rows):
            assert torch.equal(lo[:, row, : p.numel()], want_lo[layer])
            assert torch.equal(hi[:, row, : p.numel()], want_hi[layer])


def test_choose_keeps_forced_blocks_then_the_best():
    scores = torch.tensor([[0.1, 0.5, 0.2, 0.9, 0.0], [0.3, 0.2, 0.8, 0.1, 0.4]])
    forced = torch.tensor([[True, False, False, False, False], [False, False, False, True, False]])
    valid = torch.tensor([[True] * 5, [True, True, True, True, False]])
    got = selection.choose(scores, forced, valid, keep=3)
    assert sorted(got[0].tolist()) == [0, 1, 3]
    assert sorted(got[1].tolist()) == [0, 2, 3]


def test_calibrate_proxy_writes_a_well_formed_mix(model, tmp_path):
    """`kapc calibrate proxy` on a tiny grid: per-layer overlaps of both proxies, the better one
    chosen per layer, for this model; compact accepts the file."""
    from typer.testing import CliRunner

    from kapc.cli import app
    from kapc.proxy_mix import load_mix

    out = tmp_path / "mix.json"
    result = CliRunner().invoke(
        app,
        [
            "calibrate",
            "proxy",
            "-o",
            str(out),
            "--questions",
            "1",
            "--context",
            "700",
            "--tokens",
            "6",
        ],
    )
    assert result.exit_code == 0, result.output
    mix = load_mix(out)
    L = model.num_layers
    assert mix.model_fingerprint == model.fingerprint and len(mix.mix) == L
    assert mix.overlap_in[0] == mix.overlap_mid[0] == 1.0  # layer 0 uses its own query
    assert all(0.0 <= x <= 1.0 for x in mix.overlap_in + mix.overlap_mid)
    assert any(x < 1.0 for x in mix.overlap_in[1:])  # measured, not assumed
    for a, b, c in zip(mix.overlap_in, mix.overlap_mid, mix.mix):
        assert c == ("in" if a > b else "mid")
    assert "layer  es-in  es-mid  choice" in result.output


def test_hybrid_reads_the_querys_best_of_the_plans_pages_up_to_its_quota():
    from kapc.policy import hybrid_quota

    scores = torch.tensor([[0.0, 0.9, 0.1, 0.2, 0.8, 0.7]])
    forced = torch.tensor([[True, False, False, False, False, False]])  # the sink
    valid = torch.ones(1, 6, dtype=torch.bool)
    plan = torch.tensor([[False, False, True, True, False, True]])  # the plan's pages 2, 3, 5
    got = selection.choose(
        scores, forced, valid, keep=4, preferred=plan, quota=torch.tensor([hybrid_quota(3, 4 - 1)])
    )
    # sink, then the best one of the plan's pages (5), then the query's best others (1, 4)
    assert sorted(got[0].tolist()) == [0, 1, 4, 5]
    assert hybrid_quota(3, 10) == 3 and hybrid_quota(8, 10) == 5 and hybrid_quota(2, 1) == 0
