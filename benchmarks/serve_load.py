"""Load through the OpenAI API: the same stream of requests against `kapc serve` and against plain
vLLM with the same settings (`kapc serve --no-hook`), each a real server process.

Requests are real HotpotQA prompts (the frontend's priors at each context length) sent as chat
messages, greedy, streamed; kapc's requests carry their prior (compiled by the server at
admission). For each server and each concurrency level (requests in flight) it reports output
throughput, end-to-end latency and time-to-first-token percentiles, the share of requests that
ran a plan, and whether every output equals plain vLLM's. Without `--warm` the first level also
pays each prompt's first prefill (the prefix cache starts cold on both servers). Run it on a quiet
machine: the two servers are timed one after the other.

    python -m benchmarks.serve_load --requests 200 --concurrency 8,32
"""

from __future__ import annotations

import argparse
import json
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
    contexts: list[int], questions: int, first: int, max_tokens: int, model: str | None = None
) -> list[dict]:
    """[{"key", "context", "messages", "prior"}] for HotpotQA dev questions at each length."""
    from benchmarks.vllm_decode import fit_context
    from kapc.client import chat_messages
    from kapc.frontend.hybrid import hotpotqa_prior
    from kapc.policy import MAX_AUTO_K
    from kapc.prior import encode_prior

    pool = []
    for c in contexts:
        for i in range(first, first + questions):
            t0 = time.perf_counter()
            prior = hotpotqa_prior(
                i, context_tokens=fit_context(c, max_tokens, MAX_AUTO_K, 32, model), model=model
            )
            pool.append(
                {
                    "key": f"q{i}@{c}",
                    "context": c,
                    "messages": chat_messages(prior),
                    "prior": encode_prior(prior, indent=0).decode(),
                }
            )
            _log(f"  prior q{i} at {c} ({time.perf_counter() - t0:.1f}s)")
    return pool


def one_request(client, model: str, job: dict, max_tokens: int, xargs: dict | None) -> dict:
    t0 = time.perf_counter()
    first = None
    text, tokens = [], 0
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
                if first is None:
                    first = time.perf_counter() - t0
                text.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    except Exception as exc:  # noqa: BLE001 - a lost request is a result, reported as such
        return {"key": job["key"], "error": f"{type(exc).__name__}: {exc}"}
    return {
        "key": job["key"],
        "text": "".join(text),
        "tokens": tokens,
        "latency_s": time.perf_counter() - t0,
        "ttft_s": first,
    }


def run_phase(
    url: str, jobs: list[dict], concurrency: int, max_tokens: int, hook: bool, label: str
) -> tuple[list[dict], float]:
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1800)
    model = client.models.list().data[0].id

    def send(i_job):
        i, job = i_job
        xargs = None
        if hook:
            xargs = {"kapc_prior": job["prior"], "kapc_tag": f"{label}-{i}"}
        return one_request(client, model, job, max_tokens, xargs)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(send, enumerate(jobs)))
    return results, time.perf_counter() - t0


def _pct(values, q) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(
    server: str,
    concurrency: int,
    results: list[dict],
    wall: float,
    stats: dict | None,
    reference: list[dict] | None,
) -> dict:
    ok = [r for r in results if "error" not in r]
    lat = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    row = {
        "server": server,
        "concurrency": concurrency,
        "requests": len(results),
        "lost": len(results) - len(ok),
        "wall_s": wall,
        "out_tok_s": sum(r["tokens"] for r in ok) / wall,
        "latency_p50": _pct(lat, 50),
        "latency_p90": _pct(lat, 90),
        "latency_p99": _pct(lat, 99),
        "ttft_p50": _pct(ttft, 50),
        "ttft_p90": _pct(ttft, 90),
        "ttft_p99": _pct(ttft, 99),
    }
    if reference is not None:
        row["changed"] = sum(
            1
            for r, ref in zip(results, reference)
            if "error" in r or r.get("text") != ref.get("text")
        )
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
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per concurrency level")
    ap.add_argument(
        "--concurrency",
        type=_ints,
        default=[8, 32],
        help="requests in flight, comma-separated; each level sends --requests",
    )
    ap.add_argument("--contexts", type=_ints, default=[2048, 4096])
    ap.add_argument("--questions", type=int, default=16, help="distinct questions per context")
    ap.add_argument("--first", type=int, default=0, help="first HotpotQA dev question")
    ap.add_argument("--max-tokens", type=int, default=64)
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
        "so the levels measure decoding under load rather than first prefills",
    )
    ap.add_argument("--json", type=Path, help="write the summary rows here")
    args = ap.parse_args(argv)

    from kapc.runtime.vllm.serve import free_port, running, server_command

    _log(f"building {len(args.contexts) * args.questions} priors")
    pool = build_priors(args.contexts, args.questions, args.first, args.max_tokens, args.model)
    jobs = [pool[i % len(pool)] for i in range(args.requests)]
    max_len = max(args.contexts) + 64
    rows, reference = [], {}
    logs = Path(tempfile.mkdtemp(prefix="kapc-serve-load-"))
    for name, hook in (("vllm", False), ("kapc", True)):
        port = free_port()
        cmd = server_command(
            args.model,
            port=port,
            hook=hook,
            max_model_len=max(max_len, 4608),
            extra=["--max-num-seqs", str(args.max_num_seqs)],
        )
        t0 = time.perf_counter()
        with running(cmd.argv, cmd.url, logs / f"{name}.log"):
            _log(f"[{name}] up in {time.perf_counter() - t0:.0f}s (log {logs / f'{name}.log'})")
            if args.warm:
                t0 = time.perf_counter()
                run_phase(cmd.url, pool, 8, 1, False, f"{name}-warm")
                _log(f"[{name}] {len(pool)} prompts prefilled in {time.perf_counter() - t0:.0f}s")
            for c in args.concurrency:
                label = f"{name}-c{c}"
                results, wall = run_phase(cmd.url, jobs, c, args.max_tokens, hook, label)
                stats = None
                if hook:
                    from kapc.client import server_stats

                    everything = server_stats(cmd.url)["requests"]
                    stats = {t: s for t, s in everything.items() if t.startswith(label + "-")}
                row = summarize(name, c, results, wall, stats, reference.get(c))
                if not hook:
                    reference[c] = results
                rows.append(row)
                _log(
                    f"[{name}] {c} in flight: "
                    + json.dumps(
                        {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
                    )
                )
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def print_table(rows: list[dict]) -> None:
    base = {r["concurrency"]: r for r in rows if r["server"] == "vllm"}
    print(
        "| server | in flight | requests | lost | changed | out tok/s | ratio | latency p50 / p90 / "
        "p99 s | TTFT p50 / p90 / p99 s | plan / fallback / refused | acceptance |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        b = base.get(r["concurrency"])
        ratio = r["out_tok_s"] / b["out_tok_s"] if b else None
        shares = (
            "-"
            if "share_plan" not in r
            else f"{r['share_plan']:.0%} / {r['share_fallback']:.0%} / {r['share_refused']:.0%}"
        )
        print(
            f"| {r['server']} | {r['concurrency']} | {r['requests']} | {r['lost']} | "
            f"{r.get('changed', '-')} | {r['out_tok_s']:.1f} | {f(ratio)}x | "
            f"{f(r['latency_p50'])} / {f(r['latency_p90'])} / {f(r['latency_p99'])} | "
            f"{f(r['ttft_p50'])} / {f(r['ttft_p90'])} / {f(r['ttft_p99'])} | {shares} | "
            f"{f(r.get('acceptance'))} |"
        )


if __name__ == "__main__":
    sys.exit(main())
