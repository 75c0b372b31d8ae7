"""Session fixtures for the runtime tests: the real SmolLM2-135M-Instruct (loaded once), real
HotpotQA prompts near 1K tokens, one shared executor (prefix cache on: every prompt is prefilled
once) and the reference outputs of full-context decoding and of Hugging Face `generate`."""

from __future__ import annotations

import pytest

from kapc import settings

BLOCK = 16
NEW_TOKENS = 24
PROMPT_INDICES = (0, 1, 2)


@pytest.fixture(scope="session")
def model():

    import torch

    from kapc.runtime.model import load_model

    # One thread by default: on a small shared CPU, OpenMP threads waiting for each other cost
    # more than they gain on this model's small matrices. KAPC_TORCH_THREADS overrides.
    torch.set_num_threads(settings.torch_threads())
    torch.manual_seed(0)
    return load_model()


@pytest.fixture(scope="session")
def prompts(model):
    from kapc.runtime.prompts import build_prompt

    return [build_prompt(model.path, i, max_own_tokens=1000) for i in PROMPT_INDICES]


@pytest.fixture(scope="session")
def executor(model):
    from kapc.runtime.executor import Executor

    return Executor(model, block_size=BLOCK, kv_cache_gib=0.75, prefix_cache=True)


@pytest.fixture(scope="session")
def full_outputs(executor, prompts):
    """Full-context greedy decoding of every prompt, as one batch."""
    results, _ = executor.full([p.token_ids for p in prompts], max_tokens=NEW_TOKENS)
    return [r.tokens for r in results]


@pytest.fixture(scope="session")
def hf_outputs(model, prompts):
    import torch

    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p.token_ids])
            gen = model.hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=model.tokenizer.eos_token_id,
            )
            outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


def gold_plan(model, prompt, **kw):
    """Attention sink and instruction + gold passages + the question + the tail."""
    from kapc.runtime.planning import plan_from_blocks

    blocks = (
        prompt.instruction_blocks(BLOCK) + prompt.gold_blocks(BLOCK) + prompt.question_blocks(BLOCK)
    )
    kw.setdefault("pays", True)
    return plan_from_blocks(model, prompt.token_ids, blocks, block_size=BLOCK, **kw)
