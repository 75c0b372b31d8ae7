"""Recall of gold supporting paragraphs within the budget the compiler selects.

    .venv/bin/python -m benchmarks.frontend_recall --questions 500 --lengths 4096,8192

For each HotpotQA dev question (the first N, or --start onwards) and each prompt length, the
long-context prompt is built (kapc.frontend.longctx) and scored once by the graph frontend, which
computes every score; the other frontends' priors are the same prior with only their own scores
(identical to running them alone: tests/frontend/test_hybrid.py checks it). Each prior is compiled
with the real compiler (`ground,align-spans,select{budget-ratio=R}`: the budget is R of the prompt
tokens, and the instruction, question, template tokens, attention sink and recent window come out
of it first), and the passages `select` keeps are compared with the gold supporting paragraphs.

Variants:
  bm25       sparse score only
  dense      dense score only
  fusion     sparse + dense + RRF fusion (ground averages their normalised values)
  graph      the full graph prior as emitted: all four passage scores plus entity node units
             (ground mixes passage scores with the best anchored node score)
  graph-ppr  the graph frontend's own ranking: the passage PPR score only

Reported per length and variant: mean recall of gold paragraphs, the share of questions with
every gold paragraph kept, and the mean share of passages kept. --jsonl keeps per-question rows
(and --resume continues a run from them). Dense encoding dominates the time on CPU; by default it
runs under bf16 autocast (KAPC_DENSE_PRECISION=bfloat16), --fp32 turns that off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

VARIANTS = ("bm25", "dense", "fusion", "graph", "graph-ppr")
KEEP = {"bm25": {"sparse"}, "dense": {"dense"}, "fusion": {"sparse", "dense", "fusion"},
        "graph-ppr": {"ppr"}}


def _variant(prior, name: str):
    import msgspec
    if name == "graph":
        return prior
    units = [msgspec.structs.replace(u, scores={k: v for k, v in u.scores.items()
                                                if k in KEEP[name]})
             for u in prior.units if u.kind == "passage"]
    return msgspec.structs.replace(prior, units=units)


def _selected(prior, passes, ctx) -> tuple[set[str], int]:
    from kapc.ingest import module_from_prior
    from kapc.pipeline import run_pipeline
    out = run_pipeline(module_from_prior(prior), passes, ctx, verify=False).module
    return {k.id for k in out.keep if k.why == "evidence"}, out.prompt.tokens


def run_one(index: int, length: int, passes, ctx) -> dict:
    from kapc.frontend.hybrid import hotpotqa_prior
    t0 = time.perf_counter()
    prior = hotpotqa_prior(index, length, frontend="graph")
    t_front = time.perf_counter() - t0
    gold = set(prior.meta["gold_passages"])
    n_passages = sum(1 for u in prior.units if u.kind == "passage")
    row = {"index": index, "id": prior.meta["question_id"], "length": length,
           "prompt_tokens": prior.meta["prompt_tokens"], "passages": n_passages,
           "gold": sorted(gold), "frontend_s": round(t_front, 3), "recall": {}, "kept": {}}
    for v in VARIANTS:
        kept, _ = _selected(_variant(prior, v), passes, ctx)
        row["recall"][v] = len(gold & kept) / len(gold)
        row["kept"][v] = len(kept)
    return row


def summarize(rows: list[dict], lengths: list[int]) -> str:
    from rich.console import Console
    from rich.table import Table
    table = Table(title="Gold supporting-paragraph recall within the compiler's select budget")
    table.add_column("length")
    table.add_column("questions", justify="right")
    table.add_column("variant")
    table.add_column("recall", justify="right")
    table.add_column("all gold kept", justify="right")
    table.add_column("passages kept", justify="right")
    lines = []
    for n in lengths:
        rs = [r for r in rows if r["length"] == n]
        if not rs:
            continue
        for v in VARIANTS:
            rec = sum(r["recall"][v] for r in rs) / len(rs)
            full = sum(r["recall"][v] == 1.0 for r in rs) / len(rs)
            kept = sum(r["kept"][v] / r["passages"] for r in rs) / len(rs)
            table.add_row(str(n), str(len(rs)), v, f"{rec:.3f}", f"{full:.3f}", f"{kept:.3f}")
            lines.append(f"{n}\t{len(rs)}\t{v}\t{rec:.4f}\t{full:.4f}\t{kept:.4f}")
    Console(file=sys.stdout, width=120).print(table)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.frontend_recall",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=500, help="how many questions (default 500)")
    ap.add_argument("--start", type=int, default=0, help="first question index (default 0)")
    ap.add_argument("--lengths", default="4096,8192", help="prompt lengths in tokens")
    ap.add_argument("--budget-ratio", type=float, default=0.1,
                    help="select budget as a share of the prompt (default 0.1)")
    ap.add_argument("--jsonl", type=Path, help="write per-question rows here")
    ap.add_argument("--resume", action="store_true", help="skip rows already in --jsonl")
    ap.add_argument("--fp32", action="store_true", help="dense encoder in float32 (slower)")
    args = ap.parse_args(argv)
    if not args.fp32:
        os.environ.setdefault("KAPC_DENSE_PRECISION", "bfloat16")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    lengths = [int(x) for x in args.lengths.split(",") if x]

    from kapc.frontend.progress import track
    from kapc.passes import CompileContext
    from kapc.pipeline import parse_pipeline

    passes = parse_pipeline(f"ground,align-spans,select{{budget-ratio={args.budget_ratio}}}")
    ctx = CompileContext()
    rows: list[dict] = []
    done: set[tuple[int, int]] = set()
    if args.jsonl and args.resume and args.jsonl.exists():
        for line in args.jsonl.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                rows.append(r)
                done.add((r["index"], r["length"]))
    sink = args.jsonl.open("a" if args.resume else "w") if args.jsonl else None
    todo = [(i, n) for i in range(args.start, args.start + args.questions)
            for n in sorted(lengths, reverse=True) if (i, n) not in done]
    t0 = time.perf_counter()
    # Longest first per question: shorter prompts are prefixes, so their embeddings are cached.
    for i, n in track(todo, "scoring and compiling", total=len(todo)):
        row = run_one(i, n, passes, ctx)
        rows.append(row)
        if sink:
            sink.write(json.dumps(row) + "\n")
            sink.flush()
    if sink:
        sink.close()
    rows = [r for r in rows if args.start <= r["index"] < args.start + args.questions]
    print(f"# {len(rows)} (question, length) rows, {time.perf_counter() - t0:.0f}s this run, "
          f"budget-ratio {args.budget_ratio}, dense precision "
          f"{os.environ.get('KAPC_DENSE_PRECISION', 'float32')}")
    summarize(rows, lengths)


if __name__ == "__main__":
    main()
