"""Adversarial plans in the reference executor: whatever a plan selects, greedy output stays
identical to full-context decoding, and the executor reports what it did.

Plans that a `.kapb` reader refuses (pages past the prompt, duplicated or unsorted blocks) cannot
reach a runtime from a file; they are built here in memory, past the reader, to show that the
executor itself never lets them touch the output or the KV cache. The same plans go through the
vLLM hook as bytes in tests/vllm/test_hook.py."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kapc.lower.kapb import FallbackPolicy, plan_problem
from kapc.runtime.executor import Request
from kapc.runtime.planning import plan_from_blocks

from .conftest import BLOCK, NEW_TOKENS

pytestmark = pytest.mark.model

KEEP = FallbackPolicy(min_acceptance=0.0, max_retained=1.0)  # run whatever happens


def _plan(model, p, blocks, **kw):
    kw.setdefault("fallback", KEEP)
    return plan_from_blocks(model, p.token_ids, blocks, block_size=BLOCK, k=4, pays=True, **kw)


def _raw(plan, **arrays):
    """The plan with arrays no reader would accept, built past the reader."""
    return msgspec.structs.replace(
        plan, **{k: np.asarray(v, dtype="<i4") for k, v in arrays.items()}
    )


def adversarial_plans(model, p) -> dict:
    P = len(p.token_ids)
    tail = (P - 1) // BLOCK
    nothing = _plan(model, p, [])
    rng = np.random.default_rng(7)
    plans = {
        "nothing but the tail": nothing,
        "everything": _plan(model, p, range(tail + 1)),
        "only distractors": _plan(model, p, p.distractor_blocks(BLOCK)),
        "random nonsense, matching hash": _plan(
            model, p, rng.choice(tail, size=tail // 5, replace=False)
        ),
        "pages past the prompt": _raw(
            nothing, positions=np.concatenate([nothing.positions, np.arange(P, P + 3 * BLOCK)])
        ),
        "duplicated and unsorted pages": _raw(
            nothing,
            positions=np.concatenate(
                [
                    np.arange(5 * BLOCK, 6 * BLOCK),
                    np.arange(BLOCK),
                    np.arange(BLOCK),
                    nothing.positions,
                ]
            ),
        ),
    }
    return plans


def test_adversarial_plans_stay_lossless(model, executor, prompts, full_outputs):
    p = prompts[2]
    plans = adversarial_plans(model, p)
    assert plan_problem(plans["pages past the prompt"]) is not None  # a reader would refuse these
    assert plan_problem(plans["duplicated and unsorted pages"]) is not None
    names = list(plans)
    results, _ = executor.generate(
        [Request(p.token_ids, plan=plans[n], max_tokens=NEW_TOKENS) for n in names]
    )
    P = len(p.token_ids)
    for name, r in zip(names, results):
        assert r.tokens == full_outputs[2], name
        assert r.mode == "plan" and r.fallback_reason is None and r.proposed > 0, name
        assert 0 < r.visible_prompt_tokens <= P, name
    by = dict(zip(names, results))
    # the executor reports what it read: past-the-prompt positions add nothing, duplicates once
    assert (
        by["pages past the prompt"].visible_prompt_tokens
        == by["nothing but the tail"].visible_prompt_tokens
    )
    assert (
        by["duplicated and unsorted pages"].visible_prompt_tokens
        == by["nothing but the tail"].visible_prompt_tokens + 2 * BLOCK
    )
    assert by["everything"].retained_ratio == 1.0 and by["everything"].acceptance_rate == 1.0
    # nothing held but the prefix cache's entries
    assert set(executor.cache.tables) == {sid for sid, _ in executor._prefixes.values()}
