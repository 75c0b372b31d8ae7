"""The sizes kapc accepts, in one place (docs/limits.md lists them for users).

Every input is bounded before the work it would cost is done, so that a hostile or broken input
gets a clear error instead of a hang, an out-of-memory kill or a crash in a native library."""

from __future__ import annotations

MAX_PROMPT_TOKENS = (
    1 << 22
)  # a plan's prompt: 4M tokens (16 MiB of ids; the longest contexts are 1-2M)
MAX_BLOCK_SIZE = 1 << 16  # a KV page, in tokens
MAX_K = 64  # proposal length
MAX_BATCH = 1 << 16  # the batch size the cost model is told about
MAX_INPUT_BYTES = 64 << 20  # any input file: prior.json, .kap, .kapb
MAX_KAP_TOKENS = 500_000  # lexical tokens of one .kap (a 4K-token prompt's plan has ~4,300)
