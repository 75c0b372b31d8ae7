"""Compile-time benchmark: how long `kapc compile` takes, with and without tokenization.

    python -m benchmarks.compile_time [--repeat 7] [--synthetic-tokens 131072] [--units 5000]

Two priors:
  * a real 8K-token HotpotQA prior from the offline frontend (question 0, hard negatives);
  * a synthetic 128K-token prior: real HotpotQA paragraphs, repeated in a seeded order until the
    prompt reaches the target, with 5,000 evidence units (passages plus graph nodes anchored in
    them) and seeded scores. SmolLM2's context is 8K, so this one is compiled for a copy of the
    SmolLM2 folder whose config admits 128K positions (same tokenizer and template).

For each it prints the median over --repeat runs of: the whole pipeline with a cold tokenizer memo
(tokenization included), the pipeline with the memo warm (the passes' own time, tokenization
excluded), each pass alone, and lowering to .kapb. The passes should take well under 100 ms at 128K.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from kapc.ingest import module_from_prior
from kapc.lower.lower import lower_module
from kapc.passes import DEFAULT_PIPELINE, CompileContext
from kapc.pipeline import parse_pipeline, run_pipeline
from kapc.prior import Anchor, Frontend, Message, Prior, Request, Segment, Unit


def real_prior(tokens: int) -> Prior:
    from kapc.frontend.hybrid import hotpotqa_prior

    return hotpotqa_prior(0, context_tokens=tokens)


def synthetic_prior(tokens: int, units: int, seed: int = 0) -> Prior:
    from kapc.frontend.data import hotpotqa_paragraph_pool

    paragraphs, _ = hotpotqa_paragraph_pool()
    rng = random.Random(seed)
    order = list(range(len(paragraphs)))
    rng.shuffle(order)
    n_passages = units // 2
    # ~3.6 characters a token for this prose through SmolLM2's tokenizer
    chars_each = max(80, tokens * 36 // (10 * n_passages))
    segs, unit_list = [], []
    for i in range(n_passages):
        p = paragraphs[order[i % len(order)]]
        text = f"Title: {p.title}\n{p.text}"
        while len(text) < chars_each:
            text += " " + paragraphs[order[(i * 7 + len(text)) % len(order)]].text
        text = text[:chars_each] + "\n\n"
        pid = f"p{i}"
        segs.append(Segment(text=text, kind="passage", id=pid, title=p.title))
        unit_list.append(
            Unit(
                id=pid,
                kind="passage",
                segment=pid,
                scores={"dense": rng.random(), "sparse": rng.random() * 30},
            )
        )
        at = rng.randrange(0, len(text) - 20)
        unit_list.append(
            Unit(
                id=f"n{i}",
                kind="node",
                text=text[at : at + 12],
                anchors=[Anchor(segment=pid, start=at, end=at + 12)],
                scores={"ppr": rng.random() / n_passages},
            )
        )
    request = Request(
        messages=[
            Message(
                role="system",
                segments=[Segment(text="Answer from the passages.", kind="instruction")],
            ),
            Message(
                role="user",
                segments=[
                    *segs,
                    Segment(text="Question: what is synthetic here?", kind="question", id="q"),
                ],
            ),
        ]
    )
    return Prior(
        name=f"synthetic-{tokens}",
        request=request,
        units=unit_list,
        frontend=Frontend(name="benchmarks.compile_time", params={"seed": seed}),
    )


def long_context_model(base: CompileContext, positions: int) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="kapc-longctx-"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        src = base.assets.path / name
        if src.exists():
            shutil.copy(src, folder / name)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["max_position_embeddings"] = positions
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def measure(prior: Prior, ctx: CompileContext, repeat: int) -> dict[str, float]:
    module = module_from_prior(prior)
    passes = parse_pipeline(DEFAULT_PIPELINE)
    cold, warm, lower = [], [], []
    per_pass: dict[str, list[float]] = {p.name: [] for p in passes}
    for _ in range(repeat):
        ctx.__dict__.pop("tokenize", None)  # a fresh memo: the next run tokenizes
        ctx.tokenize  # noqa: B018 - build the memo object outside the timing, not the tokenization
        t0 = time.perf_counter()
        run_pipeline(module, passes, ctx, verify=False)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        result = run_pipeline(module, passes, ctx, verify=False)
        warm.append(time.perf_counter() - t0)
        for rec in result.records:
            per_pass[rec.name].append(rec.seconds)
        t0 = time.perf_counter()
        lower_module(result.module, ctx)
        lower.append(time.perf_counter() - t0)
    out = {
        "prompt_tokens": result.module.prompt.tokens,
        "units": len(prior.units),
        "with_tokenization_ms": 1e3 * statistics.median(cold),
        "passes_only_ms": 1e3 * statistics.median(warm),
        "lower_ms": 1e3 * statistics.median(lower),
    }
    out.update({f"{k}_ms": 1e3 * statistics.median(v) for k, v in per_pass.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--real-tokens", type=int, default=8192)
    ap.add_argument("--synthetic-tokens", type=int, default=131072)
    ap.add_argument("--units", type=int, default=5000)
    args = ap.parse_args()

    base = CompileContext()
    rows = []
    try:
        rows.append(
            (
                "hotpotqa 8K (real frontend)",
                measure(real_prior(args.real_tokens), base, args.repeat),
            )
        )
    except ImportError as exc:  # the frontend is optional for this benchmark
        print(f"(skipping the real prior: {exc})")
    folder = long_context_model(base, max(args.synthetic_tokens * 2, 8192))
    try:
        ctx = CompileContext(str(folder))
        rows.append(
            (
                f"synthetic {args.synthetic_tokens // 1024}K, {args.units} units",
                measure(synthetic_prior(args.synthetic_tokens, args.units), ctx, args.repeat),
            )
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    cols = {
        "prompt_tokens": "tokens",
        "units": "units",
        "with_tokenization_ms": "+tokenize",
        "passes_only_ms": "passes",
        "ground_ms": "ground",
        "align-spans_ms": "align",
        "select_ms": "select",
        "resolve-pages_ms": "pages",
        "compact_ms": "compact",
        "lower_ms": "lower",
    }
    print(
        f"compile time, median of {args.repeat} runs, milliseconds; 'passes' excludes tokenization, "
        f"'+tokenize' includes it"
    )
    print(f"{'case':34s}" + "".join(f"{c:>10s}" for c in cols.values()))
    for name, r in rows:
        print(
            f"{name:34s}"
            + "".join(f"{r[c]:10.1f}" if c.endswith("_ms") else f"{r[c]:10d}" for c in cols)
        )


if __name__ == "__main__":
    main()
