"""`kapc calibrate proxy`: measure, per layer, how well each EarlySelectKV proxy query (ES-In,
ES-Mid) picks the pages the true query would, and write the ES-Mix choice (kapc.proxy_mix).

It decodes HotpotQA calibration questions (dev 1000 on: the benchmarks use 0..999) with a dynamic
access policy under each proxy, in the reference executor, with the executor scoring every layer's
proxy choice against the true query's (`Executor.measure_overlap`).
"""

from __future__ import annotations

from collections.abc import Callable

from kapc.policy import AccessPolicy
from kapc.profile import now
from kapc.proxy_mix import MIX_VERSION, ProxyMix, choose_mix

CALIBRATION_FIRST_QUESTION = 1000


def calibrate_proxy(
    model,
    *,
    questions: int = 4,
    context: int = 4096,
    budget: float = 0.15,
    tokens: int = 32,
    block_size: int = 16,
    progress: Callable[[str], None] = lambda msg: None,
) -> ProxyMix:
    from kapc.runtime.executor import Executor, Request
    from kapc.runtime.planning import plan_from_blocks
    from kapc.runtime.prompts import build_long_prompt

    prompts = []
    for i in range(questions):
        p = build_long_prompt(model.path, CALIBRATION_FIRST_QUESTION + i, context)
        plan = plan_from_blocks(
            model,
            p.token_ids,
            p.instruction_blocks(block_size),
            block_size=block_size,
            k=4,
            pays=True,
        )
        prompts.append((p.token_ids, plan))
        progress(f"question {CALIBRATION_FIRST_QUESTION + i}: {len(p.token_ids)} tokens")
    longest = max(len(ids) for ids, _ in prompts)
    ex = Executor(
        model,
        block_size=block_size,
        prefix_cache=True,
        honor_predicted_loss=False,
        kv_blocks=2 * len(prompts) * (-(-(longest + tokens + 8) // block_size)) + 8,
    )
    ex.measure_overlap = True
    L = model.num_layers
    overlaps = {}
    for proxy in ("es-in", "es-mid"):
        access = AccessPolicy(mode="dynamic", budget=budget, proxy=proxy)
        _, stats = ex.generate(
            [
                Request(ids, plan=plan, max_tokens=tokens, access=access, ignore_eos=True)
                for ids, plan in prompts
            ]
        )
        per_layer = stats.overlap_by_layer()
        overlaps[proxy] = tuple(
            [1.0] + [round(per_layer.get(layer, 0.0), 4) for layer in range(1, L)]
        )
        progress(f"{proxy}: mean overlap {sum(overlaps[proxy][1:]) / max(1, L - 1):.3f}")
    ex.clear_prefix_cache()
    return ProxyMix(
        version=MIX_VERSION,
        model=model.name,
        model_fingerprint=model.fingerprint,
        budget=budget,
        questions=questions,
        overlap_in=overlaps["es-in"],
        overlap_mid=overlaps["es-mid"],
        mix=choose_mix(overlaps["es-in"], overlaps["es-mid"]),
        created=now(),
    )
