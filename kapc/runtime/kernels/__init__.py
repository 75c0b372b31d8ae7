"""kapc's own CPU kernels, compiled on first use for this machine and cached.

One kernel today: `paged_attention`, causal attention of a few query tokens per row over vLLM-CPU's
paged KV cache, which kapc's vLLM hook runs for verification steps (paged_attention.cpp says why).

The source is compiled with the system's C++ compiler (`$CXX`, else `g++`) with `-march=native`,
once per head dim, block size, source and machine, into `$KAPC_CACHE_DIR/kernels/`. Nothing here
is needed to compile plans; a machine without a compiler runs vLLM's own kernel instead, and
`KernelUnavailable` says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from kapc.errors import KapcError

SOURCE = Path(__file__).with_name("paged_attention.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-std=c++17")


class KernelUnavailable(KapcError):
    """kapc's kernel cannot be built or used here (the caller runs the engine's own instead)."""


def _machine() -> str:
    """What `-march=native` compiles for: the CPU's model name and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(lines)))


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        raise KernelUnavailable(
            f"no C++ compiler ({cxx}) on PATH to build kapc's attention "
            f"kernel; install g++ or set CXX"
        )
    return path


def _build(head_dim: int, block_size: int) -> Path:
    from kapc.models import cache_root

    cxx = _compiler()
    defines = (f"-DHD={head_dim}", f"-DBS={block_size}")
    key = hashlib.sha256(
        "\0".join(
            [SOURCE.read_text(), cxx, *FLAGS, *defines, _machine(), platform.machine()]
        ).encode()
    ).hexdigest()[:16]
    out = cache_root() / "kernels" / f"paged_attention-hd{head_dim}-bs{block_size}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent builders (tensor-parallel ranks) never load
    # a half-written library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run(
            [cxx, *FLAGS, *defines, str(SOURCE), "-o", tmp], capture_output=True, text=True
        )
        if res.returncode != 0:
            raise KernelUnavailable(
                f"building kapc's attention kernel failed ({cxx}): {res.stderr.strip()[-800:]}"
            )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def _library(head_dim: int, block_size: int) -> ctypes.CDLL:
    if head_dim % 8 or block_size % 8:
        raise KernelUnavailable(
            f"kapc's attention kernel needs a head dim and block size that "
            f"are multiples of 8 (got {head_dim} and {block_size})"
        )
    lib = ctypes.CDLL(str(_build(head_dim, block_size)))
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for entry in (lib.kapc_paged_attention, lib.kapc_paged_attention_bf16):
        entry.argtypes = [
            p,
            i64,
            i64,
            p,
            i64,
            i64,
            p,
            i64,
            i64,
            p,
            p,
            i,
            p,
            i64,
            i,
            i,
            ctypes.c_float,
        ]
        entry.restype = i
    lib.kapc_has_bf16.restype = i
    return lib


def has_bfloat16(head_dim: int, block_size: int) -> bool:
    """Whether the kernel built for this machine reads bfloat16 caches (vLLM-CPU's "amx"
    layout): it runs on AMX tiles."""
    return bool(_library(int(head_dim), int(block_size)).kapc_has_bf16())


def load_paged_attention(head_dim: int, block_size: int) -> None:
    """Build (once) and load the kernel for this shape; raise KernelUnavailable with the reason
    when it cannot be."""
    _library(int(head_dim), int(block_size))


def _input_problems(query, cache, out, query_start_loc, seq_lens, block_table) -> list[str]:
    """What `paged_attention`'s inputs lack of what the kernel reads (empty: nothing)."""
    import torch

    _, kv_heads, _, two_hd = cache.shape
    _, heads, head_dim = query.shape
    problems = []
    if cache.dtype not in (torch.float32, torch.bfloat16) or not (
        query.dtype == cache.dtype == out.dtype
    ):
        problems.append("a float32 or bfloat16 cache, with query and output of its dtype")
    if two_hd != 2 * head_dim or out.shape != query.shape:
        problems.append("a cache of the query's head dim and an output of the query's shape")
    if heads % kv_heads:
        problems.append("query heads a multiple of KV heads")
    if not cache.is_contiguous() or query.stride(2) != 1 or out.stride(2) != 1:
        problems.append("a contiguous cache and unit-stride head dims")
    if block_table.dtype != torch.int32 or block_table.stride(1) != 1:
        problems.append("an int32 block table with contiguous rows")
    if (
        query_start_loc.dtype != torch.int32
        or seq_lens.dtype != torch.int32
        or not query_start_loc.is_contiguous()
        or not seq_lens.is_contiguous()
    ):
        problems.append("contiguous int32 query starts and sequence lengths")
    rows = seq_lens.shape[0]
    if query_start_loc.shape[0] != rows + 1 or block_table.shape[0] < rows:
        problems.append("one query start per row plus one, and a block table row per row")
    return problems


def paged_attention(
    query, cache, out, query_start_loc, seq_lens, block_table, scale: float
) -> None:
    """out[t, h] = causal attention of query[t, h] over its row's keys and values in `cache`.

    query, out: [tokens, heads, head_dim] (rows of `query_start_loc`'s lengths, each row's
    tokens the last of its sequence); cache: vLLM-CPU's layer cache [blocks, kv_heads,
    block_size, 2 * head_dim], float32 in its "vec" layout or bfloat16 in its "amx" layout
    (paged_attention.cpp), query and output of the cache's dtype; query_start_loc
    int32 [rows + 1]; seq_lens int32 [rows] (tokens each row sees, its queries included);
    block_table int32 [rows, width], each row read as one continuous sequence."""
    import torch

    problems = _input_problems(query, cache, out, query_start_loc, seq_lens, block_table)
    if problems:
        raise KernelUnavailable("kapc's attention kernel needs " + "; ".join(problems))
    _, kv_heads, block_size, _ = cache.shape
    _, heads, head_dim = query.shape
    rows = seq_lens.shape[0]
    lib = _library(head_dim, block_size)
    entry = (
        lib.kapc_paged_attention_bf16 if cache.dtype == torch.bfloat16 else lib.kapc_paged_attention
    )
    rc = entry(
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        cache.data_ptr(),
        cache.stride(0),
        cache.stride(1),
        query_start_loc.data_ptr(),
        seq_lens.data_ptr(),
        rows,
        block_table.data_ptr(),
        block_table.stride(0),
        heads,
        kv_heads,
        float(scale),
    )
    if rc != 0:
        raise KernelUnavailable(
            {
                -1: f"kapc's attention kernel tiles at most 64 query heads per "
                f"KV head (this model has {heads // kv_heads})",
                -2: "kapc's attention kernel could not allocate scratch memory",
                -3: "kapc's attention kernel reads bfloat16 caches only with AMX-BF16, head "
                "dims and block sizes that are multiples of 32 (this CPU or shape has not, or "
                "Linux refused this process AMX's tiles)",
            }.get(rc, f"kapc's attention kernel failed ({rc})")
        )
