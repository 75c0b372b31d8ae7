"""Decode speedup and retained ratio s against context length, from `benchmarks.vllm_decode`
rows kept in records (their `--json` files), as a table and a plot.

    python -m benchmarks.lengths benchmarks/records/qwen-long-vllm-cpu/rows-*.json \
        --plot benchmarks/records/qwen-long-vllm-cpu/lengths.png

Every file is one run: a ratio is that run's method throughput over its own plain vLLM
throughput at the same (context, batch), so runs made at different times (this VM drifts) are
compared only through their ratios. Where several runs hold a row, the table gives each run's
ratio and the plot their median.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ORDER = ("full", "kapc", "kapc-top3", "ngram")


def read_runs(paths: list[Path]) -> list[dict]:
    """Every row of every file, tagged with its run (the file's name)."""
    rows = []
    for path in paths:
        for r in json.loads(Path(path).read_text()):
            rows.append(dict(r, run=Path(path).name))
    return rows


def table(rows: list[dict]) -> list[str]:
    """A markdown table: one line per (context, batch, method), each run's tok/s and ratio."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["context"], r["batch"], r["method"]), []).append(r)

    def order(key):
        c, b, m = key
        return c, b, ORDER.index(m) if m in ORDER else len(ORDER), m

    out = [
        "| context | batch | method | tok/s | ratio to plain vLLM | s | h | tokens/cycle "
        "| same as plain |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for key in sorted(groups, key=order):
        c, b, m = key
        rs = groups[key]
        fmt = " / ".join
        speeds = fmt(f"{r['out_tok_s']:.2f}" for r in rs)
        ratios = fmt("-" if r.get("ratio") is None else f"{r['ratio']:.2f}" for r in rs)
        s = fmt(f"{r['s']:.3f}" for r in rs if r.get("s") is not None) or "-"
        h = fmt(f"{r['h']:.2f}" for r in rs if r.get("h") is not None) or "-"
        tpc = (
            fmt(f"{r['tokens_per_cycle']:.2f}" for r in rs if r.get("tokens_per_cycle") is not None)
            or "-"
        )
        same = "-" if m == "full" else fmt(same_as_plain(r) for r in rs)
        out.append(f"| {c:,} | {b} | {m} | {speeds} | {ratios} | {s} | {h} | {tpc} | {same} |")
    return out


def same_as_plain(row: dict) -> str:
    """Whether a row's greedy tokens equal plain vLLM's, with how many of its batch's rows do
    where some differ (rows recorded with that count)."""
    same = row.get("identical_to_full")
    if same is None:
        return "-"
    rows = row.get("rows_identical_to_full")
    if same or rows is None or row["batch"] == 1:
        return "yes" if same else "no"
    return f"no ({rows}/{row['batch']} rows)"


def plot(rows: list[dict], path: Path) -> Path:
    """Median ratio to plain vLLM against context, one line per (method, batch); and s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_s) = plt.subplots(1, 2, figsize=(9, 3.4))
    lines: dict[tuple, dict[int, list[float]]] = {}
    svals: dict[int, dict[int, list[float]]] = {}
    for r in rows:
        if r["method"] != "full" and r.get("ratio") is not None:
            lines.setdefault((r["method"], r["batch"]), {}).setdefault(r["context"], []).append(
                r["ratio"]
            )
        if r["method"] == "kapc" and r.get("s") is not None:
            svals.setdefault(r["batch"], {}).setdefault(r["context"], []).append(r["s"])
    for (m, b), pts in sorted(lines.items()):
        xs = sorted(pts)
        ax.plot(xs, [statistics.median(pts[x]) for x in xs], marker="o", label=f"{m} x{b}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode throughput / plain vLLM")
    ax.legend(fontsize=7)
    for b, pts in sorted(svals.items()):
        xs = sorted(pts)
        ax_s.plot(xs, [statistics.median(pts[x]) for x in xs], marker="o", label=f"batch {b}")
    ax_s.set_xscale("log", base=2)
    ax_s.set_xlabel("context (tokens)")
    ax_s.set_ylabel("retained ratio s")
    ax_s.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return Path(path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", nargs="+", type=Path, help="`benchmarks.vllm_decode --json` files")
    ap.add_argument("--plot", type=Path, help="write the plot to this PNG")
    args = ap.parse_args(argv)
    rows = read_runs(args.rows)
    print("\n".join(table(rows)))
    if args.plot:
        print(f"\nplot: {plot(rows, args.plot)}")


if __name__ == "__main__":
    main()
