"""Preemption in a real engine: a KV cache of about 2,100 tokens (two of the test prompts and
room for about 80 more tokens each) makes vLLM preempt the newer of two decoding requests as they
grow and recompute it later in other blocks (the prefix cache is off, so a recomputed prompt never
finds its old blocks). What a plan's query-aware pages derived from the old blocks, its key
bounds, must be read again from the new ones; output stays what the same requests decode without
plans. The engine runs in a process of its own (tests/vllm/preemption_probe.py)."""

from __future__ import annotations

import pytest

from tests.vllm.conftest import run_probe

pytest.importorskip("vllm")


def test_a_preempted_request_reads_its_key_bounds_again_from_its_new_blocks(cases, tmp_path):
    pick = cases[:2] * 2  # prompts of 965 and 871 tokens
    out = run_probe("preemption_probe", pick, tmp_path)
    res = out["planned"]
    assert [r["tokens"] for r in res] == out["plain"]
    moved = [r for r in res if r["block_moves"]]
    assert moved, [(r["status"], r["proposed"], r["reason"]) for r in res]
    assert all(r["access"] != "static" for r in res)
    # pages were chosen for rows after their move, every time from bounds of their new blocks
    assert out["seen"]["moved"] > 0 and out["seen"]["stale"] == 0, out["seen"]
