"""A client of `kapc serve`, with the `openai` package: a prior's chat messages and the prior
itself in, the answer and the plan's statistics out.

    kapc serve &                                   # once it prints how to call it:
    python examples/serve_client.py examples/hotpotqa/q0000-700.prior.json
    python examples/serve_client.py --plan plan.kapb --accept top3 examples/hotpotqa/q0000-4k.prior.json

With `--plan`, the request carries a `.kapb` compiled by you (`kapc compile prior.json -o
plan.kapb`) instead of the prior, which the server would compile (and cache) at admission.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

from openai import OpenAI

from kapc.client import chat_messages, plan_xargs, request_stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prior", help="the request's prior.json (its messages are the prompt)")
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's API root")
    ap.add_argument("--plan", help="send this compiled .kapb instead of the prior")
    ap.add_argument("--accept", help="override the plan's rule: greedy (lossless) or top3")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    client = OpenAI(base_url=args.url, api_key="unused")
    model = client.models.list().data[0].id
    tag = f"example-{uuid.uuid4().hex[:8]}"
    xargs = (
        plan_xargs(kapb=args.plan, tag=tag, accept=args.accept)
        if args.plan
        else plan_xargs(prior=args.prior, tag=tag, accept=args.accept)
    )
    t0 = time.perf_counter()
    reply = client.chat.completions.create(
        model=model,
        messages=chat_messages(args.prior),
        max_tokens=args.max_tokens,
        temperature=0,
        extra_body={"vllm_xargs": xargs},
    )
    seconds = time.perf_counter() - t0
    print(reply.choices[0].message.content)
    print(f"\n{reply.usage.completion_tokens} tokens in {seconds:.2f} s")
    stats = request_stats(args.url, tag)
    keep = (
        "status",
        "reason",
        "source",
        "compile_s",
        "compile_cached",
        "k",
        "accept",
        "retained_ratio",
        "proposed",
        "accepted",
        "acceptance_rate",
        "access",
    )
    print(json.dumps({k: stats.get(k) for k in keep}, indent=1))


if __name__ == "__main__":
    main()
