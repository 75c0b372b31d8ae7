"""Every environment switch kapc reads, in one place."""

from __future__ import annotations

import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def debug() -> bool:
    """KAPC_DEBUG=1: show full tracebacks instead of one-paragraph errors."""
    return _flag("KAPC_DEBUG")


def check_roundtrip() -> bool:
    """KAPC_CHECK_ROUNDTRIP=1: after every pass, print and re-parse the IR and compare."""
    return _flag("KAPC_CHECK_ROUNDTRIP")


def dump_dir() -> str | None:
    """KAPC_DUMP_DIR=DIR: write the IR after every pass to DIR/<nn>-<pass>.kap."""
    return os.environ.get("KAPC_DUMP_DIR") or None


def attention_kernel() -> bool:
    """KAPC_ATTENTION_KERNEL=0: kapc's vLLM engine runs vLLM's own attention kernel instead of
    kapc's (kapc.runtime.kernels) for decode, draft and verification steps."""
    return os.environ.get("KAPC_ATTENTION_KERNEL", "1").strip().lower() not in ("0", "false", "no")


def reduced_draft_weights() -> bool:
    """KAPC_DRAFT_WEIGHTS=float32: draft forwards of kapc's vLLM-CPU engine read the model's own
    float32 weights instead of bfloat16 copies (verification reads the model's own either way)."""
    return os.environ.get("KAPC_DRAFT_WEIGHTS", "bfloat16").strip().lower() not in (
        "float32",
        "fp32",
        "0",
        "false",
        "no",
        "off",
    )
