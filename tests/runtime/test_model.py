"""Which models the executor accepts and refuses (configs only: no weights needed)."""

import pytest
from transformers import (
    BloomConfig,
    LlamaConfig,
    LlavaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from kapc.runtime.model import UnsupportedModel, check_supported


@pytest.mark.parametrize(
    "cfg",
    [
        LlamaConfig(),
        Qwen2Config(use_sliding_window=False),
        Qwen3Config(),
        MistralConfig(sliding_window=None),
    ],
)
def test_full_attention_llama_family_is_accepted(cfg):
    check_supported(cfg)


@pytest.mark.parametrize(
    "cfg,why",
    [
        (MistralConfig(sliding_window=4096), "sliding"),
        (
            Qwen2Config(use_sliding_window=True, sliding_window=4096, max_window_layers=0),
            "attention",
        ),
        (BloomConfig(), "ALiBi"),
        (LlavaConfig(), "multimodal"),
    ],
)
def test_models_it_cannot_run_exactly_are_refused(cfg, why):
    with pytest.raises(UnsupportedModel, match=why):
        check_supported(cfg)
