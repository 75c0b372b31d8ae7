"""Sampled requests (temperature above zero) draft too, and their drafts are accepted by vLLM's
rejection sampler: the output distribution is the model's own. Token frequencies of many seeded
requests through kapc's hook are compared with plain vLLM's (tests/vllm/conftest.py); the same
comparison is shown to catch a biased acceptance."""

from __future__ import annotations

import numpy as np

from tests.vllm.conftest import SAMPLED_TOKENS, SAMPLES, sampling_settings

MIN_COUNT = 10  # tokens seen fewer times (both runs together) share one "other" cell


def distribution_p(a: list[list[int]], b: list[list[int]]) -> float:
    """How likely two sets of sampled outputs are under one distribution: a two-sample chi-square
    test of the token at each drafted position (1 on; position 0 comes from the prefill), one
    sequence per request so the counts are independent; the smallest p-value times the number of
    positions (Bonferroni)."""
    from scipy.stats import chi2_contingency

    ps = []
    for j in range(1, SAMPLED_TOKENS):
        x, y = [t[j] for t in a], [t[j] for t in b]
        tokens = sorted(set(x) | set(y))
        counts = np.array([[x.count(v) for v in tokens], [y.count(v) for v in tokens]])
        common = counts.sum(0) >= MIN_COUNT
        table = counts[:, common]
        if not common.all():
            table = np.hstack([table, counts[:, ~common].sum(1, keepdims=True)])
        ps.append(chi2_contingency(table)[1] if table.shape[1] > 1 else 1.0)
    return min(1.0, min(ps) * len(ps))


def _sampled(engine, case, n: int = SAMPLES, greedy_beside=None):
    from kapc.runtime.vllm import generate

    prompts, plans, sampling = [case.ids] * n, [case.plan] * n, sampling_settings(n)
    if greedy_beside is not None:
        prompts, plans = prompts + [greedy_beside.ids], plans + [greedy_beside.plan]
        sampling = sampling + [None]
    return generate(
        engine,
        prompts,
        plans,
        max_tokens=SAMPLED_TOKENS,
        ignore_eos=True,
        honor_predicted_loss=False,
        min_acceptance=False,
        sampling=sampling,
    )


def test_sampled_requests_draft_and_keep_the_model_distribution(
    engine, cases, baseline, plain_samples
):
    *res, greedy = _sampled(engine, cases[1], greedy_beside=cases[2])
    assert all(r["status"] == "plan" and r["accept"] == "sampled" for r in res)
    proposed, accepted = sum(r["proposed"] for r in res), sum(r["accepted"] for r in res)
    # drafted, some drafts kept and some rejected (a draft the target samples rarely is refused)
    assert proposed > 0 and 0 < accepted < proposed, (proposed, accepted)
    assert all(r["acceptance_rate"] is not None for r in res if r["proposed"])
    p = distribution_p(plain_samples, [r["tokens"] for r in res])
    assert p > 1e-3, p
    # a greedy request in the same batch stays token-identical to plain vLLM
    assert greedy["accept"] == "greedy" and greedy["proposed"] > 0
    assert greedy["tokens"] == baseline[2][:SAMPLED_TOKENS]


def _accept_every_draft(worker, on: bool) -> None:
    rs = worker.model_runner.rejection_sampler
    if not on:
        rs.forward = rs.__dict__.pop("_kapc_unbiased")
        return
    unbiased = rs.forward

    def biased(metadata, draft_probs, logits, sampling_metadata, *a, **kw):
        if logits is not None and len(metadata.draft_token_ids):
            rows, drafts = metadata.target_logits_indices, metadata.draft_token_ids.long()
            logits[rows, drafts] += 1e4
        return unbiased(metadata, draft_probs, logits, sampling_metadata, *a, **kw)

    rs._kapc_unbiased, rs.forward = unbiased, biased


def test_the_distribution_test_catches_a_biased_acceptance(engine, cases, plain_samples):
    """SIMULATED: a rejection sampler that accepts every draft (each draft token's target logit
    raised before it runs) cannot be caused for real; with as many samples, the comparison above
    refuses it (each request's first token, sampled at its prefill, and its second, sampled in
    the plain step after it, are never drafted)."""
    engine.llm.collective_rpc(_accept_every_draft, args=(True,))
    try:
        res = _sampled(engine, cases[1], n=SAMPLES)
    finally:
        engine.llm.collective_rpc(_accept_every_draft, args=(False,))
    assert sum(r["accepted"] for r in res) == sum(r["proposed"] for r in res) > 0
    assert distribution_p(plain_samples, [r["tokens"] for r in res]) < 1e-6
