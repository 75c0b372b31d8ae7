"""A draft row's compact view of its request's KV blocks, and how far it may draft: the pure
parts of kapc's vLLM hook (tested without an engine, as vLLM tests its own proposers)."""

from __future__ import annotations

import numpy as np

from kapc.runtime.session import PlanSession


def compact_row(
    selected: np.ndarray, blocks, tail_block: int, pos: int, block_size: int
) -> tuple[list[int], int, int]:
    """A draft at logical position `pos`: its compact block table (the request's real blocks of
    the selected full prompt blocks, then every real block from the tail block to the one
    holding `pos`), the number of tokens that table shows, and the KV slot its key goes to.
    The kernel reads a table row as one sequence, so every block but the last must be full:
    selected blocks are full prompt blocks, and the tail starts on a block boundary."""
    table = [int(blocks[b]) for b in selected] + [
        int(b) for b in blocks[tail_block : pos // block_size + 1]
    ]
    seq_len = len(selected) * block_size + pos + 1 - tail_block * block_size
    slot = int(blocks[pos // block_size]) * block_size + pos % block_size
    return table, seq_len, slot


def view_blocks(s: PlanSession, static: bool = False) -> np.ndarray:
    """The full prompt blocks of a row's compact view: the plan's (for a dynamic view too, if
    `static`), or for a dynamic view `keep` placeholders (block 0) that the page choice
    overwrites before each layer reads them."""
    if s.view is None or static:
        return s.selected
    return np.zeros(s.view.keep, dtype=np.int64)


def draft_budget(
    k: int,
    allocated_blocks: int,
    block_size: int,
    position: int,
    max_model_len: int,
    end_tokens: int | None = None,
) -> int:
    """How many drafts a row may write from `position` (its newest token): draft j writes
    position+j, which must lie in the request's allocated blocks (never a stale table entry)
    and within the model's length. A cycle of d drafts emits at most d + 1 tokens, so a request
    that stops at `end_tokens` tokens (prompt + max_tokens) needs none past the one before its
    last: at 128 output tokens and k = 7, the last cycle drafted up to 6 tokens never emitted."""
    budget = min(k, allocated_blocks * block_size - position, max_model_len - 1 - position)
    if end_tokens is not None:
        budget = min(budget, end_tokens - 2 - position)
    return budget
