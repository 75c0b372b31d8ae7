"""The load benchmark as a user runs it (a small stream): the same requests through plain vLLM's
server and `kapc serve`, each a real server process, every greedy output compared."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_the_load_benchmark_compares_the_two_servers(tmp_path):
    """Two loads (2 in flight; Poisson arrivals at 2 a second) of 6 requests, half of them short
    chats without a prior, through both servers."""
    rows_file = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.serve_load", "--requests", "6", "--concurrency", "2"]
        + ["--rates", "2", "--short-share", "0.5", "--seed", "1"]
        + ["--contexts", "1024", "--questions", "2", "--max-tokens", "16"]
        + ["--json", str(rows_file)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(rows_file.read_text())
    assert sorted((r["server"], r["load"]) for r in rows) == [
        ("kapc", "concurrency 2"),
        ("kapc", "rate 2"),
        ("vllm", "concurrency 2"),
        ("vllm", "rate 2"),
    ]
    for r in rows:
        assert r["requests"] == 6 and r["lost"] == 0 and r["out_tok_s"] > 0
        assert r["ttft_p50"] > 0 and r["tpot_p50"] > 0 and r["goodput_req_s"] >= 0
        each = r["per_request"]  # every request's own timings, for reading a percentile
        assert len(each) == 6 and all(e["ttft_s"] > 0 and e["sent_s"] >= 0 for e in each)
    for kapc in (r for r in rows if r["server"] == "kapc"):
        assert kapc["changed"] == 0  # every greedy output equals plain vLLM's
        assert kapc["share_plan"] + kapc["share_fallback"] == pytest.approx(1.0)
        assert kapc["share_refused"] == 0.0
        # what the hook counted during this load alone, beside the rows
        assert kapc["hook"]["timing"]["calls"] > 0
        planned = [e for e in kapc["per_request"] if "status" in e]  # those that sent a prior
        assert planned and all(e["status"] in ("plan", "fallback") for e in planned)
    # seeded: the same short chats each time, some of each kind; only the long ones carry priors
    from benchmarks.serve_load import request_stream

    pool = [{"key": f"q{i}", "question": "?", "prior": "{}", "messages": []} for i in range(2)]
    stream = request_stream(pool, 6, 0.5, 1)
    assert 0 < sum(j["prior"] is None for j in stream) < 6
    assert rows[0]["requests"] == len(stream)
    assert sum(r["compiles"] for r in rows if r["server"] == "kapc") >= 1


def test_a_shared_document_is_one_prefix_for_every_question():
    """`--shared-document`: the questions of a length read one document, so their prompts share
    it as a prefix (a server prefills it once); each keeps its own question and prior."""
    import os

    from benchmarks.serve_load import build_priors

    def contents(shared: bool) -> list[str]:
        pool = build_priors([1024], 2, 0, 16, shared=shared)
        assert [j["key"] for j in pool] == ["q0@1024", "q1@1024"]
        assert pool[0]["question"] != pool[1]["question"] and pool[0]["prior"] != pool[1]["prior"]
        return ["".join(m["content"] for m in j["messages"]) for j in pool]

    shared = contents(True)
    assert len(os.path.commonprefix(shared)) > 0.8 * min(map(len, shared))
    own = contents(False)
    assert len(os.path.commonprefix(own)) < 0.5 * min(map(len, own))


def test_the_load_benchmark_refuses_a_server_it_does_not_know():
    from benchmarks.serve_load import parse_args

    assert parse_args(["--servers", "kapc"]).servers == "kapc"
    with pytest.raises(SystemExit):
        parse_args(["--servers", "kapc,sglang"])
    # kapc's server without priors, and more vLLM arguments for every server
    args = parse_args(["--servers", "vllm,kapc-none", "--engine-args=--no-async-scheduling"])
    assert args.servers == "vllm,kapc-none" and args.engine_args == "--no-async-scheduling"


def test_rounds_pair_each_run_with_plain_vllms_of_its_round():
    """`--rounds`: every server runs once a round, the order turning each round; a ratio is
    taken against plain vLLM's run of the same round, and outputs are compared against plain
    vLLM's even where kapc ran first."""
    from benchmarks.serve_load import compare_outputs, parse_args, ratios

    assert parse_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])

    def row(server, rnd, tok_s, ttft):
        return {"server": server, "load": "concurrency 8", "round": rnd, "out_tok_s": tok_s} | {
            "ttft_p50": ttft,
            "ttft_p90": 2 * ttft,
        }

    # round 1 ran kapc first: its ratio is still against round 1's plain run
    rows = [row("vllm", 0, 10.0, 1.0), row("kapc", 0, 12.0, 1.1)]
    rows += [row("kapc", 1, 9.0, 0.5), row("vllm", 1, 9.0, 1.0)]
    rel = ratios(rows)
    assert rel[1]["tok_s"] == pytest.approx(1.2) and rel[1]["ttft_p90"] == pytest.approx(1.1)
    assert rel[2]["tok_s"] == pytest.approx(1.0) and rel[2]["ttft_p50"] == pytest.approx(0.5)
    same, other = [{"text": "a"}, {"text": "b"}], [{"text": "a"}, {"text": "c"}]
    outputs = {("vllm", "concurrency 8", 0): same, ("vllm", "concurrency 8", 1): same}
    outputs |= {("kapc", "concurrency 8", 0): same, ("kapc", "concurrency 8", 1): other}
    compare_outputs(rows, outputs)
    assert [r.get("changed") for r in rows] == [None, 0, 1, None]
