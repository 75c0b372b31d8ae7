"""Tensor parallelism: every rank's proposer sees the same batch and must draft the same tokens
(a rank that drafted otherwise would run different forwards and hang or corrupt the step).
SmolLM2-135M has 9 attention heads and 3 KV heads, so the tensor-parallel size that divides
them is 3; on a one-NUMA-node machine vLLM needs the ranks' threads bound by hand."""

from __future__ import annotations

import pytest

from kapc.client import plan_xargs, request_stats, server_stats
from tests.serve.conftest import FORCE, PRIORS, start_server


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    yield from start_server(
        tmp_path_factory.mktemp("serve-tp") / "server.log",
        "--tensor-parallel-size",
        "3",
        "--kv-cache-gib",
        "1",
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1|0"},
    )


def test_every_rank_drafts_the_same_tokens(tp_server):
    plain = tp_server.chat("q3", 24)
    planned = tp_server.chat(
        "q3", 24, {**plan_xargs(prior=PRIORS["q3"], tag="tp-q3"), "kapc_opts": FORCE}
    )
    assert planned == plain
    st = request_stats(tp_server.root, "tp-q3")
    assert st["status"] == "plan" and st["accepted"] > 0, st
    everything = server_stats(tp_server.root)
    assert everything["ranks"] == 3 and everything["ranks_agree"] is True
