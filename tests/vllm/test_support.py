"""Version range and model checks of the vLLM hook (no engine)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def test_version_range():
    from kapc.runtime.vllm import VLLMUnsupported, check_vllm_version

    assert check_vllm_version("0.32.0") == "0.32.0"
    assert check_vllm_version("0.32.0+cpu") == "0.32.0+cpu"
    for bad in ("0.21.3", "0.34.0", "1.0.0"):
        with pytest.raises(VLLMUnsupported, match="outside the range"):
            check_vllm_version(bad)
    check_vllm_version()  # the installed one is supported


def test_version_override(monkeypatch):
    from kapc.runtime.vllm import check_vllm_version

    monkeypatch.setenv("KAPC_VLLM_ALLOW_UNSUPPORTED", "1")
    assert check_vllm_version("0.40.0") == "0.40.0"


def test_compact_view_refuses_sliding_window(tmp_path):
    from transformers import LlamaConfig, MistralConfig

    from kapc.runtime.vllm import VLLMUnsupported, check_model_supported
    from kapc.runtime.vllm.proposer import attention_problems

    assert attention_problems(LlamaConfig()) == []
    assert any("sliding-window" in p for p in attention_problems(MistralConfig(sliding_window=256)))
    MistralConfig(sliding_window=256).save_pretrained(tmp_path)
    with pytest.raises(VLLMUnsupported, match="sliding-window"):
        check_model_supported(tmp_path)


def test_calibration_that_cannot_fit_its_kv_cache_says_what_would(monkeypatch):
    """vLLM-CPU refuses to start when its KV cache does not fit the free memory of NUMA node 0,
    after minutes of setup; `kapc calibrate` checks first and names the batches that fit. The
    real node has room on this machine, so its free memory is SIMULATED (2.5 GiB); what vLLM
    reports is also read for real."""
    from kapc.errors import KapcError
    from kapc.runtime.vllm import compat
    from kapc.runtime.vllm.calibrate import VllmBench

    room = compat.cpu_kv_room_gib()
    assert room is not None and room > 0  # vLLM-CPU reads node 0's meminfo here
    monkeypatch.setattr(compat, "cpu_kv_room_gib", lambda node=0: 2.5)
    with pytest.raises(KapcError, match=r"NUMA node 0, which has 2.5 GiB free.*--batches up to 4"):
        VllmBench(max_batch=16, max_context=7936)
    assert VllmBench(max_batch=1, max_context=2048).kv_cache_gib == 2
