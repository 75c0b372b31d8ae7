"""The vLLM hook's pure parts, without an engine (as vLLM tests its own proposers): compact block
tables, draft slots and budgets, and acceptance bookkeeping. The engine itself is tested in
tests/vllm/."""

from __future__ import annotations

import numpy as np

from kapc.policy import AcceptanceMonitor
from kapc.runtime.vllm.proposer import (_ReqState, accepted_of, compact_row, draft_budget,
                                        record_verification)

BLOCKS = [10, 11, 12, 13, 14, 15]  # the request's real blocks, logical blocks 0..5
BS = 4


def test_compact_row_at_the_prompt_tail():
    # prompt of 14 tokens: its last token (13) is in logical block 3, the tail
    table, seq_len, slot = compact_row(np.array([0, 2]), BLOCKS, 3, 13, BS)
    assert table == [10, 12, 13]  # selected full blocks 0 and 2, then the tail block
    assert seq_len == 8 + 2  # two full blocks, and positions 12 and 13 of the tail
    assert slot == 13 * BS + 1  # position 13 lives in real block 13 at offset 1


def test_compact_row_past_the_prompt():
    table, seq_len, slot = compact_row(np.array([0, 2]), BLOCKS, 3, 17, BS)
    assert table == [10, 12, 13, 14]  # every block from the tail to the one holding 17
    assert seq_len == 8 + (17 - 12 + 1)
    assert slot == 14 * BS + 1


def test_compact_row_with_nothing_selected():
    table, seq_len, _ = compact_row(np.array([], dtype=np.int64), BLOCKS, 3, 13, BS)
    assert table == [13] and seq_len == 2


def test_draft_budget_stays_in_allocated_blocks_and_the_model():
    assert draft_budget(4, 4, BS, 13, 100) == 3  # 16 allocated slots, positions 13, 14, 15
    assert draft_budget(2, 4, BS, 13, 100) == 2
    assert draft_budget(4, 4, BS, 13, 15) == 1  # the model ends at position 14
    assert draft_budget(4, 3, BS, 13, 100) < 1  # no allocated slot left: no drafts


def test_acceptance_bookkeeping():
    assert [accepted_of(4, n) for n in (0, 1, 3, 5, 9)] == [0, 0, 2, 4, 4]
    st = _ReqState(tag="t", status="plan", k=4, per_pos=[0] * 4,
                   monitor=AcceptanceMonitor(min_acceptance=0.5, window=8))
    st.last_drafted = 4
    record_verification(st, 3)  # two drafts accepted, then the correction
    assert st.accepted == 2 and st.per_pos == [1, 1, 0, 0] and st.last_drafted == 0
    record_verification(st, 1)  # nothing drafted since: nothing booked
    assert st.accepted == 2
    st.last_drafted = 4
    record_verification(st, 1)  # all four rejected: 2 of 8 over the window, below 0.5
    assert st.status == "fallback" and "below the plan's min_acceptance" in st.reason
