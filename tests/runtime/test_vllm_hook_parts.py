"""The vLLM hook's pure parts, without an engine (as vLLM tests its own proposers): compact block
tables, draft slots and budgets, and acceptance bookkeeping. The engine itself is tested in
tests/vllm/."""

from __future__ import annotations

import numpy as np

from kapc.policy import AcceptanceMonitor
from kapc.runtime.session import PlanSession, accepted_of
from kapc.runtime.vllm.views import compact_row, draft_budget

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


def test_draft_budget_stops_at_the_last_token_the_request_may_emit():
    # a 10-token prompt with max_tokens 6 ends holding 16 tokens, the last at position 15
    assert draft_budget(4, 4, BS, 10, 100, end_tokens=16) == 4  # drafts 11..14, bonus 15
    assert draft_budget(4, 4, BS, 12, 100, end_tokens=16) == 2  # drafts 13, 14, bonus 15
    assert draft_budget(4, 4, BS, 14, 100, end_tokens=16) == 0  # one token left: no drafts
    assert draft_budget(4, 4, BS, 10, 100, end_tokens=None) == 4


def test_acceptance_bookkeeping():
    assert [accepted_of(4, n) for n in (0, 1, 3, 5, 9)] == [0, 0, 2, 4, 4]
    st = PlanSession(
        tag="t",
        status="plan",
        k=4,
        per_pos=[0] * 4,
        monitor=AcceptanceMonitor(min_acceptance=0.5, window=8),
    )
    st.drafted(4)
    st.sampled(3)  # two drafts accepted, then the correction
    assert st.accepted == 2 and st.per_pos == [1, 1, 0, 0] and st.last_drafted == 0
    st.sampled(1)  # nothing drafted since: nothing booked
    assert st.accepted == 2 and st.steps == 2
    st.drafted(4)
    st.sampled(1)  # all four rejected: 2 of 8 over the window, below 0.5
    assert st.status == "fallback" and "below the plan's min_acceptance" in st.reason
    assert st.report().proposed == 8 and st.report().acceptance_rate == 0.25


def test_attention_dispatch_sends_few_query_forwards_to_kapcs_kernel():
    """compat.replace_decode_attention: forwards of up to `max_query` query tokens per row
    (decode, drafts, verification) run kapc's real kernel; prefill chunks, non-causal forwards
    and profiling runs keep the backend's own; a kernel refusal (here a real one: a float64
    query) sends that call and every later one back to the backend, which is said once. The
    backend is a stand-in recording its calls: vLLM's cannot be built without an engine."""
    from types import SimpleNamespace

    import torch

    from kapc.runtime import kernels
    from kapc.runtime.vllm import compat

    class Backend:
        scale = 0.125

        def __init__(self):
            self.calls = []

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a, **kw):
            self.calls.append(None if attn_metadata is None else attn_metadata.max_query_len)
            return output.fill_(-1.0)

    modules = [SimpleNamespace(impl=Backend()) for _ in range(2)]
    cfg = SimpleNamespace(
        compilation_config=SimpleNamespace(
            static_forward_context={"l0": modules[0], "l1": modules[1]}
        )
    )
    layout = compat.AttentionLayout(layer_names=["l0", "l1"], block_size=32, builder=None)
    said, ran = [], []
    compat.replace_decode_attention(
        cfg,
        layout,
        kernels.paged_attention,
        max_query=16,
        on_call=lambda i, q: ran.append((i, q)),
        on_refused=said.append,
    )
    compat.replace_decode_attention(cfg, layout, kernels.paged_attention, max_query=16)  # once
    cache = torch.randn(4, 3, 32, 128)
    table = torch.tensor([[2, 0]], dtype=torch.int32)

    def step(q, causal=True, dtype=torch.float32, layer=0):
        meta = SimpleNamespace(
            max_query_len=q,
            causal=causal,
            dynamic_causal=None,
            num_actual_tokens=q,
            seq_lens=torch.tensor([40], dtype=torch.int32),
            query_start_loc=torch.tensor([0, q], dtype=torch.int32),
            block_table=table,
        )
        query = torch.randn(q, 9, 64, dtype=dtype)
        out = torch.zeros(q, 9, 64, dtype=dtype)
        return modules[layer].impl.forward(None, query, None, None, cache, meta, out)

    assert (step(1) != -1).all() and (step(5, layer=1) != -1).all()  # kapc's kernel wrote these
    assert ran == [(0, 1), (1, 5)] and modules[0].impl.calls == [] == modules[1].impl.calls
    assert (step(17) == -1).all() and (step(3, causal=False) == -1).all()  # the backend's
    assert modules[0].impl.forward(None, None, None, None, cache, None, torch.zeros(1)) is not None
    assert modules[0].impl.calls == [17, 3, None] and not said
    assert (step(2, dtype=torch.float64) == -1).all()  # refused: the backend ran it instead
    assert len(said) == 1 and "float32" in said[0]
    assert (step(2) == -1).all() and len(said) == 1  # and runs everything from then on
    assert ran == [(0, 1), (1, 5)]


def test_a_draft_cycle_uploads_once_and_reads_once():
    """A cycle's inputs are packed on the host once and advanced on the device: every step's
    table, length, position and slot equal the compact view computed for that step alone, the
    table is padded to a power of two of blocks, and the whole cycle makes one upload (one more
    when a row stops early) and one read of the drafts."""
    import torch

    from kapc.runtime.vllm.draft_inputs import DraftInputs

    rows = [  # (selected full prompt blocks, tail block, newest position, drafts)
        (np.array([0, 2]), 3, 13, 3),
        (np.array([1]), 3, 12, 2),  # stops a step early
    ]
    per_step = [
        [compact_row(sel, BLOCKS, tail, pos + j, BS) for j in range(k)]
        for sel, tail, pos, k in rows
    ]
    inputs = DraftInputs(
        tables=[steps[-1][0] for steps in per_step],
        seq_lens=[steps[0][1] for steps in per_step],
        positions=[pos for _, _, pos, _ in rows],
        slots=[[slot for _, _, slot in steps] for steps in per_step],
        tokens=[101, 202],
        device=torch.device("cpu"),
    )
    assert inputs.width == 4 and inputs.uploads == 1
    for step in range(3):
        x = inputs.at(step)
        live = inputs.live(step)
        assert live == [i for i, (*_, k) in enumerate(rows) if k > step]
        for j, i in enumerate(live):
            table, seq_len, slot = per_step[i][step]
            assert x.block_table[j, : len(table)].tolist() == table
            assert int(x.seq_lens[j]) == seq_len == x.seq_lens_host[j]
            assert int(x.slots[j]) == slot and int(x.positions[j]) == rows[i][2] + step
        assert x.token_ids.tolist() == ([101, 202] if step == 0 else [10 * step + i for i in live])
        inputs.advance(step, torch.tensor([10 * (step + 1) + i for i in live]))
    assert inputs.uploads == 2 and inputs.reads == 0  # the second: the live rows' index
    assert inputs.drafts() == [[10, 20, 30], [11, 21]] and inputs.reads == 1


def test_generate_takes_one_value_or_one_per_prompt():
    """`generate`'s per-prompt options: a list or tuple gives one per prompt (its length
    checked), anything else is every prompt's."""
    import pytest

    from kapc.runtime.vllm import _per_prompt

    assert _per_prompt(("a", "b"), 2, "plans") == ["a", "b"]
    assert _per_prompt(["a", "b"], 2, "plans") == ["a", "b"]
    assert _per_prompt(None, 2, "plans") == [None, None]
    assert _per_prompt(True, 3, "flags") == [True] * 3
    with pytest.raises(ValueError, match="2 prompts but 3 plans"):
        _per_prompt([1, 2, 3], 2, "plans")


def test_sampled_requests_are_told_from_greedy_ones():
    from vllm import SamplingParams

    from kapc.runtime.vllm.admission import sampling_is_random

    assert sampling_is_random(SamplingParams(temperature=0.7))
    assert not sampling_is_random(SamplingParams(temperature=0.0))
    assert not sampling_is_random(None)


def _arrivals_seen_elsewhere(watch, out) -> None:
    out.put(watch.since())


def test_requests_arriving_during_a_step_are_counted_for_the_worker():
    """The engine core's input thread counts each new request as it queues it (aborts and other
    messages are not requests), into memory another process reads: the worker, holding the count
    its step was scheduled at, sees how many came since."""
    import gc
    import multiprocessing
    import os
    import queue
    import subprocess
    import tempfile
    from pathlib import Path

    from vllm.v1.engine import EngineCoreRequestType

    from kapc.runtime.vllm.scheduler import ArrivalCount, ArrivalWatch, count_arrivals

    gone = subprocess.Popen(["true"])
    gone.wait()  # an engine core killed without its exit handlers left its count behind
    stale = Path(tempfile.gettempdir() if not os.access("/dev/shm", os.W_OK) else "/dev/shm")
    stale = stale / f"kapc-arrivals-{gone.pid}-x"
    stale.write_bytes(bytes(8))
    foreign = stale.with_name("kapc-arrivals-not-a-pid")  # not one of kapc's: left alone
    foreign.write_bytes(bytes(8))
    count = ArrivalCount.create()
    assert not stale.exists() and Path(count.path).exists() and foreign.exists()
    foreign.unlink()
    inbox: queue.Queue = queue.Queue()  # an engine core's input queue
    count_arrivals(inbox, count)
    inbox.put_nowait((EngineCoreRequestType.ADD, "a"))
    watch = ArrivalWatch(count.path, count.value)  # a step scheduled now
    for kind in (EngineCoreRequestType.ADD, EngineCoreRequestType.ABORT):
        inbox.put_nowait((kind, "b"))
    inbox.put_nowait((EngineCoreRequestType.ADD, "c"))
    assert [kind for kind, _ in inbox.queue].count(EngineCoreRequestType.ADD) == 3
    assert count.value == 3
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_arrivals_seen_elsewhere, args=(watch, out))
    child.start()
    child.join(30)
    assert out.get(timeout=5) == 2
    path = count.path
    del count, inbox  # the engine core's count goes with it
    gc.collect()
    assert not os.path.exists(path)
    assert ArrivalWatch("/nonexistent/kapc-arrivals", 0).since() == 0
