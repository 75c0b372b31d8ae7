"""Every environment switch kapc reads, in one place.

Each function reads its variable when called (so a test or a child process may set it late), and
`SWITCHES` names them all: a test checks that no module reads a `KAPC_*` variable defined
anywhere else, and `docs/runtime.md` lists them.
"""

from __future__ import annotations

import os
from pathlib import Path

from kapc.errors import KapcError

SWITCHES = (
    "KAPC_CACHE_DIR",
    "KAPC_DEBUG",
    "KAPC_QUIET",
    "KAPC_CHECK_ROUNDTRIP",
    "KAPC_DUMP_DIR",
    "KAPC_ATTENTION_KERNEL",
    "KAPC_DRAFT_WEIGHTS",
    "KAPC_VLLM_ALLOW_UNSUPPORTED",
    "KAPC_DENSE_PRECISION",
    "KAPC_FRONTEND_MEMO",
    "KAPC_DEMO_INDEX",
    "KAPC_TORCH_THREADS",
)

_OFF = ("0", "false", "no", "off")


class SettingError(KapcError):
    """An environment switch set to a value kapc does not read."""


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", *_OFF)


def cache_dir() -> Path:
    """KAPC_CACHE_DIR=DIR: where converted models, built kernels, calibration profiles and the
    frontend's indexes are kept (default `~/.cache/kapc`)."""
    return Path(os.environ.get("KAPC_CACHE_DIR") or Path.home() / ".cache" / "kapc")


def debug() -> bool:
    """KAPC_DEBUG=1: show full tracebacks instead of one-paragraph errors."""
    return _flag("KAPC_DEBUG")


def quiet() -> bool:
    """KAPC_QUIET=1: no progress bars or progress lines from long-running work."""
    return _flag("KAPC_QUIET")


def check_roundtrip() -> bool:
    """KAPC_CHECK_ROUNDTRIP=1: after every pass, print and re-parse the IR and compare."""
    return _flag("KAPC_CHECK_ROUNDTRIP")


def dump_dir() -> str | None:
    """KAPC_DUMP_DIR=DIR: write the IR after every pass to DIR/<nn>-<pass>.kap."""
    return os.environ.get("KAPC_DUMP_DIR") or None


def attention_kernel() -> bool:
    """KAPC_ATTENTION_KERNEL=0: kapc's vLLM engine runs vLLM's own attention kernel instead of
    kapc's (kapc.runtime.kernels) for decode, draft and verification steps."""
    return os.environ.get("KAPC_ATTENTION_KERNEL", "1").strip().lower() not in _OFF


def reduced_draft_weights() -> bool:
    """KAPC_DRAFT_WEIGHTS=float32: draft forwards of kapc's vLLM-CPU engine read the model's own
    float32 weights instead of bfloat16 copies (verification reads the model's own either way)."""
    value = os.environ.get("KAPC_DRAFT_WEIGHTS", "bfloat16").strip().lower()
    return value not in ("float32", "fp32", *_OFF)


def vllm_allow_unsupported() -> bool:
    """KAPC_VLLM_ALLOW_UNSUPPORTED=1: start the vLLM hook on a vLLM version outside the range
    kapc supports (at your own risk)."""
    return os.environ.get("KAPC_VLLM_ALLOW_UNSUPPORTED") == "1"


def dense_precision() -> str:
    """KAPC_DENSE_PRECISION=bfloat16: the frontend's dense encoder runs under CPU bfloat16
    autocast (about twice as fast on CPUs with AMX or AVX512-BF16; cosine to the float32
    embeddings above 0.9999). The default is float32."""
    mode = os.environ.get("KAPC_DENSE_PRECISION", "float32")
    if mode not in ("float32", "bfloat16"):
        raise SettingError(f"KAPC_DENSE_PRECISION must be float32 or bfloat16, not {mode!r}")
    return mode


def frontend_memo() -> str | None:
    """KAPC_FRONTEND_MEMO=FILE: the frontend keeps embeddings and entity extractions in this
    SQLite file and reuses them (off by default; `benchmarks.frontend_recall --memo` sets it)."""
    return os.environ.get("KAPC_FRONTEND_MEMO") or None


def demo_index() -> int:
    """KAPC_DEMO_INDEX=N: the HotpotQA dev question `make demo` runs (default 3)."""
    value = os.environ.get("KAPC_DEMO_INDEX", "3")
    if not value.isdigit():
        raise SettingError(f"KAPC_DEMO_INDEX must be a question index (0, 1, ...), not {value!r}")
    return int(value)


def torch_threads() -> int:
    """KAPC_TORCH_THREADS=N: torch threads for the reference-executor tests (default 1, so that
    two test processes do not fight over a small machine's cores)."""
    value = os.environ.get("KAPC_TORCH_THREADS", "1")
    if not value.isdigit() or int(value) < 1:
        raise SettingError(f"KAPC_TORCH_THREADS must be a positive integer, not {value!r}")
    return int(value)
