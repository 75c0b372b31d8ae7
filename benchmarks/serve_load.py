"""Load through the OpenAI API: the same stream of requests against `kapc serve` and against plain
vLLM with the same settings (`kapc serve --no-hook`), each a real server process.

Requests are real HotpotQA prompts (the frontend's priors at each context length) sent as chat
messages, greedy, streamed; kapc's requests carry their prior (compiled by the server as the
request arrives). With `--short-share`, that share of the requests are short chats instead (the
question alone, no prior), mixed in at random. The stream comes two ways: a fixed number of
requests in flight (`--concurrency`), or Poisson arrivals at a rate (`--rates`, requests per
second; the same seeded arrival times for both servers). For each server and each load it
reports output throughput, time to first token (TTFT), time per output token after the first
(TPOT) and end-to-end latency percentiles, goodput (requests a second that met the SLO:
`--slo-ttft`, `--slo-tpot`), the share of requests that ran a plan, and whether every output
equals plain vLLM's; kapc's rows also keep `hook`, what its hook counted during the load (the
`timing` counters and, per kind of step, the seconds observed and predicted, from `/kapc/stats`).
`--servers kapc` runs kapc alone (no ratios, no comparison); `kapc-none` is kapc's server sent
the same requests without their priors: what its engine costs when nothing drafts. Without `--warm` the first load
also pays each prompt's first prefill (the prefix cache starts cold on both servers). Run it on a
quiet machine: the servers are timed one after the other. `--rounds N` runs each N times, taking
turns at going first, and ends with each ratio's median and range over the rounds: a ratio of
one run moves by a few percent with the machine.

    python -m benchmarks.serve_load --requests 200 --concurrency 8,32 --rates 0.5,1
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def _log(*a):
    print(*a, file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_priors(
    contexts: list[int],
    questions: int,
    first: int,
    max_tokens: int,
    model: str | None = None,
    shared: bool = False,
) -> list[dict]:
    """[{"key", "context", "messages", "prior", "question"}] for HotpotQA dev questions at each
    length; with `shared`, the questions of a length read one document (each its own question
    and prior), so a server prefills the document once and the rest from its prefix cache."""
    from benchmarks.vllm_decode import fit_context
    from kapc.client import chat_messages
    from kapc.frontend.hybrid import hotpotqa_prior, hotpotqa_shared_priors, request_parts
    from kapc.policy import MAX_AUTO_K
    from kapc.prior import encode_prior

    pool = []
    for c in contexts:
        target = fit_context(c, max_tokens, MAX_AUTO_K, 32, model)
        indices = range(first, first + questions)
        shared_priors = hotpotqa_shared_priors(indices, target, model=model) if shared else None
        for n, i in enumerate(indices):
            t0 = time.perf_counter()
            prior = (
                shared_priors[n]
                if shared_priors
                else hotpotqa_prior(i, context_tokens=target, model=model)
            )
            pool.append(
                {
                    "key": f"q{i}@{c}",
                    "context": c,
                    "messages": chat_messages(prior),
                    "prior": encode_prior(prior, indent=0).decode(),
                    "question": request_parts(prior.request)[1],
                }
            )
            _log(f"  prior q{i} at {c} ({time.perf_counter() - t0:.1f}s)")
    return pool


def short_chat(job: dict) -> dict:
    """A short chat beside the long RAG prompts: the question alone, no prior, no plan."""
    return {
        "key": f"short-{job['key']}",
        "context": 0,
        "messages": [{"role": "user", "content": f"Answer in a few words: {job['question']}"}],
        "prior": None,
    }


def request_stream(pool: list[dict], requests: int, short_share: float, seed: int) -> list[dict]:
    """The requests of one load, in order: the pool's prompts in turn, `short_share` of them
    (chosen at random, seeded) replaced by short chats."""
    rng = np.random.default_rng(seed)
    jobs = [pool[i % len(pool)] for i in range(requests)]
    return [short_chat(j) if rng.random() < short_share else j for j in jobs]


def one_request(client, model: str, job: dict, max_tokens: int, xargs: dict | None) -> dict:
    t0 = time.perf_counter()
    first = None
    text, tokens, chunks = [], 0, []
    try:
        stream = client.chat.completions.create(
            model=model,
            messages=job["messages"],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"vllm_xargs": xargs} if xargs else None,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks.append(time.perf_counter() - t0)
                if first is None:
                    first = chunks[0]
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as exc:  # noqa: BLE001 - a lost request is a result, reported as such
        return {"key": job["key"], "error": f"{type(exc).__name__}: {exc}"}
    latency = time.perf_counter() - t0
    return {
        "key": job["key"],
        "text": "".join(text),
        "tokens": tokens,
        "latency_s": latency,
        "ttft_s": first,
        # after the first token, seconds per token (a chunk may carry several drafted tokens)
        "tpot_s": (latency - first) / (tokens - 1) if first is not None and tokens > 1 else None,
        "itl_s": [b - a for a, b in zip(chunks, chunks[1:])],
    }


def arrival_times(requests: int, rate: float, seed: int) -> np.ndarray:
    """Seconds from the start at which each request is sent: a Poisson process at `rate`."""
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, requests))


def run_phase(
    url: str,
    jobs: list[dict],
    load: tuple[str, float],
    max_tokens: int,
    priors: bool,
    label: str,
    seed: int = 0,
) -> tuple[list[dict], float]:
    """Send `jobs` at `load`: ("concurrency", n) keeps n in flight; ("rate", r) sends them at
    Poisson arrival times of rate r a second, however many are in flight."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1800)
    model = client.models.list().data[0].id
    kind, value = load
    start = time.perf_counter()
    at = arrival_times(len(jobs), value, seed) if kind == "rate" else None

    def send(i_job):
        i, job = i_job
        if at is not None:
            time.sleep(max(0.0, start + at[i] - time.perf_counter()))
        xargs = None
        if priors and job["prior"] is not None:
            xargs = {"kapc_prior": job["prior"], "kapc_tag": f"{label}-{i}"}
        sent = time.perf_counter() - start
        return {**one_request(client, model, job, max_tokens, xargs), "sent_s": sent}

    threads = len(jobs) if kind == "rate" else int(value)
    with ThreadPoolExecutor(max(1, threads)) as pool:
        results = list(pool.map(send, enumerate(jobs)))
    return results, time.perf_counter() - start


def _pct(values, q) -> float | None:
    return float(np.percentile(values, q)) if values else None


def meets_slo(r: dict, slo: tuple[float, float]) -> bool:
    """A request served within the SLO: its first token within slo[0] seconds, and each later
    token within slo[1] on average (TPOT)."""
    if "error" in r or r["ttft_s"] is None or r["ttft_s"] > slo[0]:
        return False
    return r["tpot_s"] is None or r["tpot_s"] <= slo[1]


def summarize(
    server: str,
    load: tuple[str, float],
    results: list[dict],
    wall: float,
    stats: dict | None,
    slo: tuple[float, float] = (2.0, 0.2),
) -> dict:
    ok = [r for r in results if "error" not in r]
    lat = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in ok if r.get("tpot_s") is not None]
    itl = [g for r in ok for g in r.get("itl_s", ())]
    row = {
        "server": server,
        "load": f"{load[0]} {load[1]:g}",
        "concurrency": int(load[1]) if load[0] == "concurrency" else None,
        "rate": load[1] if load[0] == "rate" else None,
        "requests": len(results),
        "lost": len(results) - len(ok),
        "wall_s": wall,
        "out_tok_s": sum(r["tokens"] for r in ok) / wall,
        "goodput_req_s": sum(meets_slo(r, slo) for r in results) / wall,
        "slo": {"ttft_s": slo[0], "tpot_s": slo[1]},
        "latency_p50": _pct(lat, 50),
        "latency_p90": _pct(lat, 90),
        "latency_p99": _pct(lat, 99),
        "ttft_p50": _pct(ttft, 50),
        "ttft_p90": _pct(ttft, 90),
        "ttft_p99": _pct(ttft, 99),
        "tpot_p50": _pct(tpot, 50),
        "tpot_p90": _pct(tpot, 90),
        "itl_p50": _pct(itl, 50),
        "itl_p90": _pct(itl, 90),
        "itl_p99": _pct(itl, 99),
    }
    if stats is not None:
        reqs = list(stats.values())
        for status in ("plan", "fallback", "refused"):
            row[f"share_{status}"] = sum(s["status"] == status for s in reqs) / max(1, len(reqs))
        compiled = [
            s["compile_s"] for s in reqs if s.get("compile_s") and not s.get("compile_cached")
        ]
        row["compiles"] = len(compiled)
        row["compile_s_mean"] = float(np.mean(compiled)) if compiled else None
        proposed = sum(s["proposed"] for s in reqs)
        row["acceptance"] = sum(s["accepted"] for s in reqs) / proposed if proposed else None
        row["fallback_reasons"] = sorted(
            {
                s["reason"].split(" (")[0]
                for s in reqs
                if s["status"] == "fallback" and s.get("reason")
            }
        )
    row["per_request"] = [_one(i, r, stats) for i, r in enumerate(results)]
    return row


def _one(i: int, r: dict, stats: dict | None) -> dict:
    """One request of a load, for the record: when it was sent, its timings and, from kapc's
    report, what its plan did."""
    keep = ("key", "sent_s", "ttft_s", "tpot_s", "latency_s", "tokens", "error")
    one = {k: r[k] for k in keep if k in r}
    report = next((v for t, v in (stats or {}).items() if t.rsplit("-", 1)[-1] == str(i)), None)
    if report is not None:
        one |= {k: report[k] for k in ("status", "proposed", "accepted", "held", "compile_s")}
    return one


def _hook_totals(url: str) -> dict:
    from kapc.client import server_stats

    stats = server_stats(url)
    return {
        "timing": stats.get("timing") or {},
        "steps": stats.get("step_totals") or {},
        "kernel_choices": stats.get("kernel_choices") or {},
    }


def hook_delta(before: dict, after: dict) -> dict:
    """What kapc's hook counted during one load: its timing counters (`/kapc/stats` `timing`)
    and, per kind of step, the seconds observed and predicted (`step_totals`), as the difference
    of the server's running totals after and before the load, and the attention kernel each
    shape of forward runs on at its end (`kernel_choices`)."""
    timing = {
        k: round(v - before["timing"].get(k, 0), 4)
        for k, v in after["timing"].items()
        if isinstance(v, (int, float)) and k != "forecast_from"
    }
    steps = {}
    for kind, t in after["steps"].items():
        b = before["steps"].get(kind, {})
        steps[kind] = {k: round(v - b.get(k, 0), 4) for k, v in t.items()}
    return {
        "timing": timing,
        "steps": {k: v for k, v in steps.items() if v.get("steps")},
        "kernel_choices": after.get("kernel_choices", {}),
    }


# --servers: each name's (whether the server runs kapc's hook, whether requests carry priors)
SERVERS = {"vllm": (False, False), "kapc": (True, True), "kapc-none": (True, False)}


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per load")
    ap.add_argument(
        "--concurrency",
        type=_ints,
        default=None,
        help="requests in flight, comma-separated; each level sends --requests "
        "(default 8,32 when no --rates are given)",
    )
    ap.add_argument(
        "--rates",
        type=_floats,
        default=[],
        help="Poisson arrival rates (requests a second), comma-separated; each sends --requests",
    )
    ap.add_argument("--contexts", type=_ints, default=[2048, 4096])
    ap.add_argument("--questions", type=int, default=16, help="distinct questions per context")
    ap.add_argument("--first", type=int, default=0, help="first HotpotQA dev question")
    ap.add_argument(
        "--shared-document",
        action="store_true",
        help="the questions of a length read one long document (each its own question and "
        "prior): what long contexts cost to prefill here is paid once per server",
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--short-share",
        type=float,
        default=0.0,
        help="share of requests sent as short chats (the question alone, no prior)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seeds the short chats and arrivals")
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="SLO: seconds to first token")
    ap.add_argument("--slo-tpot", type=float, default=0.2, help="SLO: seconds per later token")
    ap.add_argument(
        "--model",
        default=None,
        help="a model's name (smollm2-135m-instruct, the default) or a Hugging Face folder",
    )
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument(
        "--warm",
        action="store_true",
        help="prefill every distinct prompt once (one token, no plan) before timing, "
        "so the loads measure decoding under load rather than first prefills",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every server this many times, taking turns at going first (ABBA), each "
        "ratio against plain vLLM's run of the same round; the table ends with each ratio's "
        "median and range",
    )
    ap.add_argument("--json", type=Path, help="write the summary rows here")
    ap.add_argument(
        "--servers",
        default="vllm,kapc",
        help="which servers to run, in order (kapc alone: no ratios, no output comparison)",
    )
    ap.add_argument(
        "--engine-args",
        default="",
        help="more vLLM arguments for every server, as one string "
        "(e.g. --engine-args=--no-async-scheduling)",
    )
    args = ap.parse_args(argv)
    if not {x for x in args.servers.split(",") if x} <= set(SERVERS):
        ap.error(f"--servers takes {', '.join(SERVERS)} (comma-separated), not {args.servers!r}")
    if not 0.0 <= args.short_share <= 1.0:
        ap.error("--short-share is a share, between 0 and 1")
    if any(r <= 0 for r in args.rates):
        ap.error("--rates must be above zero")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.concurrency is None:
        args.concurrency = [] if args.rates else [8, 32]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    _log(f"building {len(args.contexts) * args.questions} priors")
    pool = build_priors(
        args.contexts, args.questions, args.first, args.max_tokens, args.model, args.shared_document
    )
    jobs = request_stream(pool, args.requests, args.short_share, args.seed)
    loads = [("concurrency", float(c)) for c in args.concurrency]
    loads += [("rate", r) for r in args.rates]
    slo = (args.slo_ttft, args.slo_tpot)
    rows: list[dict] = []
    outputs: dict[tuple[str, str, int], list[dict]] = {}  # (server, load, round): results
    logs = Path(tempfile.mkdtemp(prefix="kapc-serve-load-"))
    chosen = [n for n in SERVERS if n in args.servers.split(",")]
    for rnd in range(args.rounds):
        # ABBA: the servers take turns going first, so a drift of the machine over the run
        # (another tenant, the clock) weighs on each alike
        for name in chosen if rnd % 2 == 0 else chosen[::-1]:
            for row, results in serve_loads(name, rnd, args, pool, jobs, loads, logs, slo):
                outputs[(name, row["load"], rnd)] = results
                rows.append(row)
    compare_outputs(rows, outputs)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def compare_outputs(rows: list[dict], outputs: dict[tuple[str, str, int], list[dict]]) -> None:
    """Set each non-plain row's `changed`: how many of its requests failed or differ from plain
    vLLM's output for the same load (its first run, whichever round ran it; rows with no plain
    run of their load get none). `outputs`: per (server, load, round), the per-request results."""
    plain: dict[str, list[dict]] = {}  # per load, plain vLLM's results of its earliest round
    for (server, load, _), results in sorted(outputs.items()):
        if server == "vllm":
            plain.setdefault(load, results)
    for row in rows:
        reference = plain.get(row["load"])
        if reference is not None and row["server"] != "vllm":
            results = outputs[(row["server"], row["load"], row.get("round", 0))]
            row["changed"] = sum(
                1
                for r, ref in zip(results, reference)
                if "error" in r or r.get("text") != ref.get("text")
            )


def serve_loads(name, rnd, args, pool, jobs, loads, logs, slo):
    """Start server `name` (a SERVERS key), prefill with `--warm`, and run each load; yields
    (summary row, per-request results) per load."""
    from kapc.client import server_stats
    from kapc.runtime.vllm.serve import free_port, running, server_command

    hook, priors = SERVERS[name]
    cmd = server_command(
        args.model,
        port=free_port(),
        hook=hook,
        max_model_len=max(max(args.contexts) + 64, 4608),
        extra=["--max-num-seqs", str(args.max_num_seqs), *shlex.split(args.engine_args)],
    )
    tag = f"{name}-r{rnd}" if args.rounds > 1 else name
    t0 = time.perf_counter()
    with running(cmd.argv, cmd.url, logs / f"{tag}.log"):
        _log(f"[{tag}] up in {time.perf_counter() - t0:.0f}s (log {logs / f'{tag}.log'})")
        if args.warm:
            t0 = time.perf_counter()
            warm = pool + [short_chat(j) for j in pool] if args.short_share else pool
            if args.shared_document:  # each document alone first, then from the cache
                docs = [next(j for j in pool if j["context"] == c) for c in args.contexts]
                run_phase(cmd.url, docs, ("concurrency", 1), 1, False, f"{tag}-doc")
            run_phase(cmd.url, warm, ("concurrency", 8), 1, False, f"{tag}-warm")
            _log(f"[{tag}] {len(warm)} prompts prefilled in {time.perf_counter() - t0:.0f}s")
        for n, load in enumerate(loads):
            label = f"{tag}-l{n}"
            before = _hook_totals(cmd.url) if hook else None
            results, wall = run_phase(
                cmd.url, jobs, load, args.max_tokens, priors, label, seed=args.seed
            )
            stats = None
            if priors:
                everything = server_stats(cmd.url)["requests"]
                stats = {t: s for t, s in everything.items() if t.startswith(label + "-")}
            row = summarize(name, load, results, wall, stats, slo)
            row["round"] = rnd
            if args.engine_args:
                row["engine_args"] = args.engine_args
            if hook:
                row["hook"] = hook_delta(before, _hook_totals(cmd.url))
            _log(
                f"[{tag}] {row['load']}: "
                + json.dumps(
                    {
                        k: (round(v, 3) if isinstance(v, float) else v)
                        for k, v in row.items()
                        if k != "per_request"
                    }
                )
            )
            yield row, results


def ratios(rows: list[dict]) -> dict[int, dict]:
    """Each row's output throughput and TTFT p50 / p90 over plain vLLM's in the same load and
    round, by the row's index (rows without a plain vLLM run beside them have none)."""
    base = {(r["load"], r.get("round", 0)): r for r in rows if r["server"] == "vllm"}
    out = {}
    for i, r in enumerate(rows):
        b = base.get((r["load"], r.get("round", 0)))
        if b is not None:
            out[i] = {
                "tok_s": r["out_tok_s"] / b["out_tok_s"],
                **{q: _over(r[q], b[q]) for q in ("ttft_p50", "ttft_p90")},
            }
    return out


def _over(a, b):
    return None if a is None or not b else a / b


def print_table(rows: list[dict]) -> None:
    rel = ratios(rows)
    print(
        "| server | load | round | requests | lost | changed | out tok/s | ratio | goodput req/s | "
        "TTFT p50 / p90 / p99 s | TPOT p50 / p90 s | ITL p90 s | latency p50 / p90 s | "
        "plan / fallback / refused | acceptance |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    g = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for i, r in enumerate(rows):
        ratio = rel.get(i, {}).get("tok_s")
        shares = (
            "-"
            if "share_plan" not in r
            else f"{r['share_plan']:.0%} / {r['share_fallback']:.0%} / {r['share_refused']:.0%}"
        )
        print(
            f"| {r['server']} | {r['load']} | {r.get('round', 0)} | {r['requests']} | "
            f"{r['lost']} | {r.get('changed', '-')} | {r['out_tok_s']:.1f} | {f(ratio)}x | "
            f"{g(r['goodput_req_s'])} | "
            f"{f(r['ttft_p50'])} / {f(r['ttft_p90'])} / {f(r['ttft_p99'])} | "
            f"{g(r['tpot_p50'])} / {g(r['tpot_p90'])} | {g(r['itl_p90'])} | "
            f"{f(r['latency_p50'])} / {f(r['latency_p90'])} | {shares} | "
            f"{f(r.get('acceptance'))} |"
        )
    if len({r.get("round", 0) for r in rows}) > 1:
        print_rounds(rows, rel)


def print_rounds(rows: list[dict], rel: dict[int, dict]) -> None:
    """Per server and load, each ratio to plain vLLM's over the rounds: median (least-most)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for i, r in enumerate(rows):
        if r["server"] != "vllm" and i in rel:
            groups.setdefault((r["server"], r["load"]), []).append(rel[i])
    print()
    print("| server | load | rounds | throughput ratio | TTFT p50 ratio | TTFT p90 ratio |")
    print("|---|---|---|---|---|---|")
    for (server, load), got in groups.items():
        cells = []
        for q in ("tok_s", "ttft_p50", "ttft_p90"):
            v = [x[q] for x in got if x[q] is not None]
            cells.append(f"{np.median(v):.2f}x ({min(v):.2f}-{max(v):.2f})" if v else "-")
        print(f"| {server} | {load} | {len(got)} | {' | '.join(cells)} |")


if __name__ == "__main__":
    sys.exit(main())
