"""Preemption in a real engine: a KV cache of about 2,100 tokens (two of the test prompts and
room for about 80 more tokens each) makes vLLM preempt the newer of two decoding requests as they
grow and recompute it later in other blocks (the prefix cache is off, so a recomputed prompt never
finds its old blocks). What a plan's query-aware pages derived from the old blocks, its key
bounds, must be read again from the new ones; output stays what the same requests decode without
plans."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import BLOCK, K

pytest.importorskip("vllm")

TOKENS = 128


@pytest.fixture(scope="module")
def tight_engine(engine):
    """Its own engine beside the shared one (which the fixture starts first, so that the
    session's engines come up in one order whichever tests run)."""
    from kapc.runtime.vllm import make_engine

    eng = make_engine(
        block_size=BLOCK,
        k=K,
        hook=True,
        max_model_len=2048,
        max_num_seqs=8,
        kv_cache_gib=0.09,
        enable_prefix_caching=False,
        in_process=True,
    )
    eng.use_profile("none")
    yield eng
    eng.close()


def _watch_bounds(worker, on: bool):
    """Check, at every page choice in the engine, that each row's key bounds were read from the
    blocks that hold its prompt now; returns the counts when turned off. A watch, not a stand-in:
    the hook's own code runs unchanged."""
    from kapc.runtime.vllm import compat
    from kapc.runtime.vllm.keys import KeyPages

    state = compat.__dict__.setdefault("_bounds_watch", {})
    if not on:
        KeyPages.table_router = state.pop("original")
        return state.pop("seen")
    original, seen = KeyPages.table_router, {"checked": 0, "stale": 0, "moved": 0}

    def watched(self, rows):
        router = original(self, rows)
        for r in rows:
            now = [int(b) for b in r.blocks[: r.session.tail_block]]
            seen["checked"] += 1
            seen["moved"] += r.session.block_moves > 0
            seen["stale"] += r.session.bounds[2].tolist() != now
        return router

    state.update(original=original, seen=seen)
    KeyPages.table_router = watched
    return None


def test_a_preempted_request_reads_its_key_bounds_again_from_its_new_blocks(tight_engine, cases):
    from kapc.runtime.vllm import generate

    pick = cases[:2] * 2  # prompts of 965 and 871 tokens
    ids = [c.ids for c in pick]
    plain = generate(tight_engine, ids, None, max_tokens=TOKENS, ignore_eos=True)
    tight_engine.llm.collective_rpc(_watch_bounds, args=(True,))
    try:
        res = generate(
            tight_engine,
            ids,
            [c.plan for c in pick],
            max_tokens=TOKENS,
            ignore_eos=True,
            honor_predicted_loss=False,
            min_acceptance=False,
        )
    finally:
        (seen,) = tight_engine.llm.collective_rpc(_watch_bounds, args=(False,))
    assert [r["tokens"] for r in res] == [r["tokens"] for r in plain]
    moved = [r for r in res if r["block_moves"]]
    assert moved, [(r["status"], r["proposed"], r["reason"]) for r in res]
    assert all(r["access"] != "static" for r in res)
    # pages were chosen for rows after their move, every time from bounds of their new blocks
    assert seen["moved"] > 0 and seen["stale"] == 0, seen
