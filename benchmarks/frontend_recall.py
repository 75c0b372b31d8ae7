"""Recall of gold supporting paragraphs within the budget the compiler selects.

    nice -n 10 .venv/bin/python -m benchmarks.frontend_recall --questions 500 --lengths 4096,8192 \
        --jsonl recall.jsonl --resume

For each HotpotQA dev question (the first N, or --start onwards) and each prompt length, the
long-context prompt is built (kapc.frontend.longctx) and scored once: sparse, dense and fusion
once, then the entity graph on top of them under each graph setting (hybrid.with_graph). The
single-score frontends' priors are that prior with only their own scores (identical to running
them alone: tests/frontend/test_hybrid.py checks it). Each prior is compiled with the real
compiler (`ground,align-spans,select{budget-ratio=R}`: the budget is R of the prompt tokens, and
the instruction, question, template tokens, attention sink and recent window come out of it
first), and the passages `select` keeps are compared with the gold supporting paragraphs.

Variants:
  bm25             sparse score only
  dense            dense score only
  fusion           sparse + dense + RRF fusion (ground averages their normalised values)
  graph            the full graph prior as kapc's graph frontend emits it by default
                   (graph.DEFAULT): all four passage scores plus second-hop entity node units
                   (ground mixes passage scores with the best anchored node score)
  graph-no-nodes   the same without node units (ground averages the four passage scores)
  graph-ppr        the graph frontend's own ranking: the passage PPR score only
  graph-hipporag2, graph-hipporag2-ppr
                   the same under HippoRAG 2's settings (graph.HIPPORAG2), when the default
                   differs from them

Reported per length and variant: mean recall of gold paragraphs, the share of questions with
every gold paragraph kept, the mean share of passages kept, and the mean retained ratio s (the
tokens select keeps over the prompt's). `--select keep-top=N` (or `min-prior=x`) measures
evidence-driven selection, where the budget is only a ceiling. --jsonl keeps per-question rows
(and --resume continues a run from them). Speed: shorter prompts are prefixes of longer ones and
every model output is cached per text (in-process, and on disk in the --memo file), torch runs on
one thread (--threads), the dense encoder under bf16 autocast (--fp32 turns that off).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from kapc import settings

BASE = ("bm25", "dense", "fusion")
KEEP = {
    "bm25": {"sparse"},
    "dense": {"dense"},
    "fusion": {"sparse", "dense", "fusion"},
    "graph-ppr": {"ppr"},
}


def graph_configs() -> dict[str, object]:
    """Graph variant name -> GraphConfig: `graph` is kapc's default; `graph-hipporag2` is
    HippoRAG 2's setting, measured alongside when the default differs from it."""
    import dataclasses

    from kapc.frontend import graph

    out = {"graph": graph.DEFAULT}
    if graph.DEFAULT.max_nodes > 0:
        out["graph-no-nodes"] = dataclasses.replace(graph.DEFAULT, max_nodes=0)
    if graph.DEFAULT != graph.HIPPORAG2:
        out["graph-hipporag2"] = graph.HIPPORAG2
    return out


def variants() -> tuple[str, ...]:
    names = list(BASE)
    for g in graph_configs():
        # graph-no-nodes has the default's PPR: its -ppr variant would repeat graph-ppr
        names += [g] if g == "graph-no-nodes" else [g, f"{g}-ppr"]
    return tuple(names)


def _variant(prior, name: str):
    import msgspec

    if name in BASE:
        keep = KEEP[name]
    elif name.endswith("-ppr"):
        keep = KEEP["graph-ppr"]
    else:
        return prior
    units = [
        msgspec.structs.replace(u, scores={k: v for k, v in u.scores.items() if k in keep})
        for u in prior.units
        if u.kind == "passage"
    ]
    return msgspec.structs.replace(prior, units=units)


def _selected(prior, passes, ctx) -> tuple[set[str], float]:
    """The passages `select` keeps, and the share of the prompt's tokens it keeps (s)."""
    from kapc.ingest import module_from_prior
    from kapc.pipeline import run_pipeline

    out = run_pipeline(module_from_prior(prior), passes, ctx, verify=False).module
    return {k.id for k in out.keep if k.why == "evidence"}, out.select.kept / out.prompt.tokens


def run_one(index: int, length: int, passes, ctx, model: str | None = None) -> dict:
    """Build one prompt, score it once (sparse, dense, fusion, and the graph under each graph
    config), and compile every variant's prior."""
    from kapc.frontend import hybrid
    from kapc.frontend.longctx import build_hotpotqa

    t0, c0 = time.perf_counter(), time.process_time()
    lc = build_hotpotqa(index, length, model=model)
    t1 = time.perf_counter()
    passages, question = hybrid.request_parts(lc.request)
    meta = lc.meta()
    name = f"hotpotqa-{lc.question_id}-{length}"
    scored = hybrid.score_passages(question, passages, "fusion")
    priors = {}
    runs = {}  # configs that differ only in their node units share one graph run
    for g, cfg in graph_configs().items():
        key = dataclasses.replace(cfg, max_nodes=0)
        sg = runs.get(key) or runs.setdefault(
            key, hybrid.with_graph(question, passages, scored, cfg)
        )
        priors[g] = hybrid.prior_from_scored(
            lc.request, name, "graph", passages, sg, meta=meta, graph_config=cfg
        )
    t2 = time.perf_counter()
    gold = set(meta["gold_passages"])
    row = {
        "index": index,
        "id": lc.question_id,
        "length": length,
        "prompt_tokens": lc.prompt_tokens,
        "passages": len(passages),
        "gold": sorted(gold),
        "build_s": round(t1 - t0, 3),
        "frontend_s": round(t2 - t1, 3),
        "recall": {},
        "kept": {},
        "s": {},
    }
    for v in variants():
        prior = priors["graph" if v in BASE else v.removesuffix("-ppr")]
        kept, s = _selected(_variant(prior, v), passes, ctx)
        row["recall"][v] = len(gold & kept) / len(gold)
        row["kept"][v] = len(kept)
        row["s"][v] = s
    row["compile_s"] = round(time.perf_counter() - t2, 3)
    row["cpu_s"] = round(time.process_time() - c0, 3)  # this process's CPU time, all threads
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
    table.add_column("s", justify="right")
    lines = []
    for n in lengths:
        rs = [r for r in rows if r["length"] == n]
        if not rs:
            continue
        # Variants every row has (rows from an older run may lack newer variants).
        for v in [v for v in rs[0]["recall"] if all(v in r["recall"] for r in rs)]:
            rec = sum(r["recall"][v] for r in rs) / len(rs)
            full = sum(r["recall"][v] == 1.0 for r in rs) / len(rs)
            kept = sum(r["kept"][v] / r["passages"] for r in rs) / len(rs)
            ss = [r["s"][v] for r in rs if v in r.get("s", {})]
            s = f"{sum(ss) / len(ss):.3f}" if ss else "-"
            table.add_row(str(n), str(len(rs)), v, f"{rec:.3f}", f"{full:.3f}", f"{kept:.3f}", s)
            lines.append(f"{n}\t{len(rs)}\t{v}\t{rec:.4f}\t{full:.4f}\t{kept:.4f}\t{s}")
    Console(file=sys.stdout, width=120).print(table)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.frontend_recall", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--questions", type=int, default=500, help="how many questions (default 500)")
    ap.add_argument("--start", type=int, default=0, help="first question index (default 0)")
    ap.add_argument("--lengths", default="4096,8192", help="prompt lengths in tokens")
    ap.add_argument(
        "--model",
        default=None,
        help="a model's name (smollm2-135m-instruct, the default) or a Hugging Face folder",
    )
    ap.add_argument(
        "--budget-ratio",
        type=float,
        default=0.1,
        help="select budget as a share of the prompt (default 0.1)",
    )
    ap.add_argument(
        "--select",
        default="",
        help="more select options, e.g. 'keep-top=4' or 'min-prior=0.6' "
        "(evidence-driven selection; the budget is then a ceiling)",
    )
    ap.add_argument("--jsonl", type=Path, help="write per-question rows here")
    ap.add_argument("--resume", action="store_true", help="skip rows already in --jsonl")
    ap.add_argument("--fp32", action="store_true", help="dense encoder in float32 (slower)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: on a shared machine more threads spin "
        "against other jobs and run several times slower)",
    )
    ap.add_argument(
        "--memo",
        type=Path,
        default=None,
        help="on-disk memo of embeddings and entities per text (default "
        "$KAPC_CACHE_DIR/frontend/memo.sqlite); reruns and --resume skip the "
        "model work already done",
    )
    ap.add_argument("--no-memo", action="store_true", help="no on-disk memo")
    args = ap.parse_args(argv)
    if not args.fp32:
        os.environ.setdefault("KAPC_DENSE_PRECISION", "bfloat16")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not args.no_memo:
        from kapc.models import cache_root

        memo = args.memo or cache_root() / "frontend" / "memo.sqlite"
        os.environ["KAPC_FRONTEND_MEMO"] = str(memo)
    import torch

    torch.set_num_threads(max(1, args.threads))
    lengths = [int(x) for x in args.lengths.split(",") if x]

    from kapc.frontend.progress import track
    from kapc.passes import CompileContext
    from kapc.pipeline import parse_pipeline

    options = ",".join(o for o in (f"budget-ratio={args.budget_ratio}", args.select) if o)
    passes = parse_pipeline(f"ground,align-spans,select{{{options}}}")
    ctx = CompileContext(args.model)
    rows: list[dict] = []
    done: set[tuple[int, int]] = set()
    if args.jsonl and args.resume and args.jsonl.exists():
        for line in args.jsonl.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                rows.append(r)
                done.add((r["index"], r["length"]))
    sink = args.jsonl.open("a" if args.resume else "w") if args.jsonl else None
    todo = [
        (i, n)
        for i in range(args.start, args.start + args.questions)
        for n in sorted(lengths, reverse=True)
        if (i, n) not in done
    ]
    t0 = time.perf_counter()
    new_rows: list[dict] = []
    # Longest first per question: shorter prompts are prefixes, so their embeddings and entities
    # are cached (in-process, by text) when the shorter one comes.
    for i, n in track(todo, "scoring and compiling", total=len(todo)):
        row = run_one(i, n, passes, ctx, args.model)
        rows.append(row)
        new_rows.append(row)
        if sink:
            sink.write(json.dumps(row) + "\n")
            sink.flush()
    if sink:
        sink.close()
    rows = [r for r in rows if args.start <= r["index"] < args.start + args.questions]
    wall = time.perf_counter() - t0
    questions = len({i for i, _ in todo})
    cpu = sum(r["cpu_s"] for r in new_rows)
    per_q = (
        f", per question (all lengths) {wall / questions:.2f}s wall, {cpu / questions:.2f}s CPU"
        if questions
        else ""
    )
    print(
        f"# {len(rows)} (question, length) rows, {len(todo)} computed in {wall:.0f}s this run"
        f"{per_q}; select{{{options}}}, dense precision "
        f"{settings.dense_precision()}, torch threads {args.threads}, "
        f"memo {settings.frontend_memo() or 'off'}"
    )
    summarize(rows, lengths)


if __name__ == "__main__":
    main()
