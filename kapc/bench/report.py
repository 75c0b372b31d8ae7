"""A sweep's tables (Markdown, shaped like the paper's) and plots (PNG), from its rows.

`summarize` reduces rows to one record per (dataset, workload, length, method); the tables and
plots read only those records, so they can be tested on rows made by hand.

Throughput is a batch's output tokens over its decode seconds, summed over the batches of a
(dataset, workload, length, method); a speedup is that throughput over full context's at the same
(dataset, workload, length), measured in the same sweep.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from kapc.bench import cases

LABEL = {
    "full": "full context",
    "kapc": "kapc greedy",
    "kapc-top3": "kapc top-3",
    "physical": "physical concat",
    "random": "random concat",
    "window": "local window",
}
PLANS = ("kapc", "kapc-top3")
BASELINES = ("physical", "random", "window")


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def complete_cases(rows: list[dict]) -> list[dict]:
    """The rows of the cases (dataset, workload, length, question) that every method of their
    (dataset, workload) decoded. Methods are compared on the same questions only: a sweep that
    was interrupted, or is still running, has some methods ahead of others, and a mean over other
    questions says nothing about a method."""
    methods: dict[tuple, set] = defaultdict(set)
    have: dict[tuple, set] = defaultdict(set)
    for r in rows:
        methods[(r["dataset"], r["workload"])].add(r["method"])
        have[(r["dataset"], r["workload"], r["length"], r["index"])].add(r["method"])
    return [
        r
        for r in rows
        if have[(r["dataset"], r["workload"], r["length"], r["index"])]
        == methods[(r["dataset"], r["workload"])]
    ]


def summarize(rows: list[dict], ttft: list[dict] = ()) -> list[dict]:
    """One record per (dataset, workload, length, method), sorted."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["dataset"], r["workload"], r["length"], r["method"])].append(r)
    tt: dict[tuple, list[dict]] = defaultdict(list)
    for t in ttft:
        tt[(t["dataset"], t["length"], t["method"])].append(t)
    out = []
    for (d, w, n, m), g in sorted(groups.items()):
        batches = {r["batch_id"]: (r["batch_tokens"], r["batch_decode_s"]) for r in g}
        tokens = sum(b[0] for b in batches.values())
        secs = sum(b[1] for b in batches.values())
        proposed = sum(r.get("proposed") or 0 for r in g)
        accepted = sum(r.get("accepted") or 0 for r in g)
        cycles = sum(r.get("cycles") or 0 for r in g)
        t = tt.get((d, n, m), [])
        rec = {
            "dataset": d,
            "workload": w,
            "length": n,
            "method": m,
            "n": len(g),
            "prompt_tokens": _mean([r["prompt_tokens"] for r in g]),
            "generated": _mean([r["generated"] for r in g]),
            "tok_s": tokens / secs if secs else None,
            "em": _mean([r.get("em") for r in g]),
            "f1": _mean([r.get("f1") for r in g]),
            "contains": _mean([r.get("contains") for r in g]),
            "similarity": _mean([r.get("similarity") for r in g]),
            "pass": _mean([None if r.get("passed") is None else float(r["passed"]) for r in g]),
            "identical": _mean(
                [None if r.get("identical") is None else float(r["identical"]) for r in g]
            ),
            "agree_f1": _mean([r.get("agree_f1") for r in g]),
            "ttft_s": _mean([x["engine_s"] for x in t]),
            "compile_s": _mean([r.get("compile_s") for r in g]),
            "frontend_s": _mean([r.get("frontend_s") for r in g]),
        }
        if m in PLANS:
            s = _mean([r.get("s") for r in g])
            h = accepted / proposed if proposed else None
            rec.update(
                s=s,
                h=h,
                margin=h - s if h is not None and s is not None else None,
                tokens_per_cycle=sum(max(0, r["generated"] - 1) for r in g) / cycles
                if cycles
                else None,
                pred_speedup=_mean([r.get("pred_speedup") for r in g]),
                plans_run=sum(r.get("status") == "plan" for r in g),
            )
        out.append(rec)
    full = {(r["dataset"], r["workload"], r["length"]): r for r in out if r["method"] == "full"}
    for r in out:
        f = full.get((r["dataset"], r["workload"], r["length"]))
        r["speedup"] = (
            r["tok_s"] / f["tok_s"] if f and f["tok_s"] and r["tok_s"] is not None else None
        )
    return out


def _f(x, spec=".2f", scale=1.0):
    return "-" if x is None else format(x * scale, spec)


def _pct(x):
    return _f(x, ".1f", 100.0)


def _table(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def _by(summary, d, w):
    return {
        (r["length"], r["method"]): r for r in summary if r["dataset"] == d and r["workload"] == w
    }


def efficiency_table(summary, d, w) -> str:
    """Efficiency by length (the paper's Table 2)."""
    by = _by(summary, d, w)
    body = []
    for n in sorted({k[0] for k in by}):
        f, g, t = by.get((n, "full"), {}), by.get((n, "kapc"), {}), by.get((n, "kapc-top3"), {})
        p = g or t
        body.append(
            [
                f"{n}",
                _f(f.get("prompt_tokens"), ".0f"),
                _f(f.get("tok_s")),
                _f(g.get("tok_s")),
                _f(g.get("speedup")) + "x" if g else "-",
                _f(t.get("tok_s")),
                _f(t.get("speedup")) + "x" if t else "-",
                _f(f.get("ttft_s")),
                _f(p.get("ttft_s")),
                _f(p.get("compile_s"), ".3f"),
                _f(f.get("frontend_s")),
            ]
        )
    return _table(
        [
            "length",
            "prompt tokens",
            "full tok/s",
            "greedy tok/s",
            "greedy x",
            "top-3 tok/s",
            "top-3 x",
            "full TTFT s",
            "kapc TTFT s",
            "+ compile s",
            "frontend s",
        ],
        body,
    )


def quality_table(summary, d, w, methods=("full",) + PLANS) -> str:
    """Quality by length (the paper's Table 3), with agreement with full context."""
    by = _by(summary, d, w)
    body = []
    for n in sorted({k[0] for k in by}):
        for m in methods:
            r = by.get((n, m))
            if r is None:
                continue
            body.append(
                [
                    f"{n}",
                    LABEL[m],
                    f"{r['n']}",
                    _pct(r["em"]),
                    _pct(r["f1"]),
                    _pct(r["contains"]),
                    _f(r["similarity"], ".3f"),
                    _pct(r["pass"]),
                    "-" if m == "full" else _pct(r["identical"]),
                ]
            )
    return _table(
        [
            "length",
            "method",
            "questions",
            "EM %",
            "F1 %",
            "contains %",
            "similarity",
            "pass %",
            "identical to full %",
        ],
        body,
    )


def baselines_table(summary, d, w, length: int | None = None) -> tuple[int | None, str]:
    """Every method at one length (the paper's Table 4): the longest measured by default."""
    by = _by(summary, d, w)
    lengths = sorted({k[0] for k in by})
    n = length if length in lengths else (lengths[-1] if lengths else None)
    body = []
    for m in ("full",) + PLANS + BASELINES:
        r = by.get((n, m))
        if r is None:
            continue
        body.append(
            [
                LABEL[m],
                _f(r["prompt_tokens"], ".0f"),
                _f(r["tok_s"]),
                _f(r["speedup"]) + "x" if r["speedup"] is not None else "-",
                _f(r["ttft_s"]),
                _pct(r["em"]),
                _pct(r["f1"]),
                _f(r["similarity"], ".3f"),
                _pct(r["pass"]),
            ]
        )
    return n, _table(
        [
            "method",
            "prompt tokens",
            "tok/s",
            "x full",
            "TTFT s",
            "EM %",
            "F1 %",
            "similarity",
            "pass %",
        ],
        body,
    )


def phase_table(summary, d, w) -> str:
    """s, h, h - s and speedup by length (the paper's Table 5), measured beside predicted."""
    by = _by(summary, d, w)
    body = []
    for n in sorted({k[0] for k in by}):
        for m in PLANS:
            r = by.get((n, m))
            if r is None:
                continue
            body.append(
                [
                    f"{n}",
                    LABEL[m],
                    _f(r["s"], ".3f"),
                    _f(r["h"], ".3f"),
                    _f(r["margin"], ".3f"),
                    _f(r["tokens_per_cycle"]),
                    _f(r["speedup"]) + "x" if r["speedup"] is not None else "-",
                    _f(r["pred_speedup"]) + "x" if r["pred_speedup"] is not None else "-",
                    f"{r['plans_run']}/{r['n']}",
                ]
            )
    return _table(
        [
            "length",
            "method",
            "s",
            "h",
            "h - s",
            "tokens/cycle",
            "measured x",
            "predicted x",
            "plans run",
        ],
        body,
    )


# ---------------------------------------------------------------------------------------------
# paired differences

# (summary name, row field, scale to the table's unit, format): pass rate and F1 in points
PAIRED_METRICS = (
    ("pass", "passed", 100.0, "+.1f"),
    ("f1", "f1", 100.0, "+.1f"),
    ("similarity", "similarity", 1.0, "+.3f"),
)


def paired(rows: list[dict], resamples: int = 2000, seed: int = 0) -> list[dict]:
    """Each method minus full context on the same cases, per (dataset, workload) and metric,
    pooled over lengths, with a 95% bootstrap interval.

    A difference taken case by case cancels what makes a question hard for every method, so it
    is far tighter than the gap between two methods' means. The bootstrap resamples questions,
    not cases: a question's cases at every length share its passages and gold answers, so they
    are not independent draws."""
    import numpy as np

    rng = np.random.default_rng(seed)
    full = {
        (r["dataset"], r["workload"], r["length"], r["index"]): r
        for r in rows
        if r["method"] == "full"
    }
    groups: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        f = full.get((r["dataset"], r["workload"], r["length"], r["index"]))
        if r["method"] == "full" or f is None:
            continue
        for name, field, _, _ in PAIRED_METRICS:
            a, b = r.get(field), f.get(field)
            if a is not None and b is not None:
                groups[(r["dataset"], r["workload"], r["method"], name)][r["index"]].append(
                    float(a) - float(b)
                )
    out = []
    for (d, w, m, name), by_q in sorted(groups.items()):
        sums = np.array([sum(v) for v in by_q.values()])
        counts = np.array([len(v) for v in by_q.values()])
        draw = rng.integers(0, len(sums), size=(resamples, len(sums)))
        stats = sums[draw].sum(axis=1) / counts[draw].sum(axis=1)
        lo, hi = np.percentile(stats, [2.5, 97.5])
        out.append(
            {
                "dataset": d,
                "workload": w,
                "method": m,
                "metric": name,
                "cases": int(counts.sum()),
                "questions": len(sums),
                "diff": float(sums.sum() / counts.sum()),
                "lo": float(lo),
                "hi": float(hi),
            }
        )
    return out


def paired_table(comparison: list[dict], d, w) -> str:
    """Every method's paired difference from full context, with its interval."""
    by = {
        (c["method"], c["metric"]): c
        for c in comparison
        if c["dataset"] == d and c["workload"] == w
    }
    body = []
    for m in PLANS + BASELINES:
        known = [by[(m, name)] for name, *_ in PAIRED_METRICS if (m, name) in by]
        if not known:
            continue
        cells = [
            "-"
            if (c := by.get((m, name))) is None
            else f"{_f(c['diff'], spec, scale)} [{_f(c['lo'], spec, scale)}, "
            f"{_f(c['hi'], spec, scale)}]"
            for name, _, scale, spec in PAIRED_METRICS
        ]
        body.append([LABEL[m], f"{known[0]['cases']}", f"{known[0]['questions']}", *cells])
    return _table(
        ["method", "cases", "questions", "pass, points", "F1, points", "similarity"], body
    )


def markdown(summary: list[dict], title: str = "kapc bench", comparison: list[dict] = ()) -> str:
    parts = [f"# {title}", ""]
    for d in sorted({r["dataset"] for r in summary}):
        for w in [
            w
            for w in cases.WORKLOADS
            if any(r["dataset"] == d and r["workload"] == w for r in summary)
        ]:
            n, base = baselines_table(summary, d, w)
            parts += [
                f"## {d}, {w} answers",
                "",
                "### Efficiency by length",
                "",
                efficiency_table(summary, d, w),
                "",
                "### Quality by length",
                "",
                quality_table(summary, d, w),
                "",
                f"### Plans against the prompt baselines at {n} tokens",
                "",
                base,
                "",
                "### Phase boundary",
                "",
                phase_table(summary, d, w),
                "",
            ]
            if any(c["dataset"] == d and c["workload"] == w for c in comparison):
                parts += [
                    "### Against full context, on the same questions",
                    "",
                    "Each method's score minus full context's, case by case, over every "
                    "length; in brackets a 95% bootstrap interval over questions.",
                    "",
                    paired_table(comparison, d, w),
                    "",
                ]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# plots


def plot_all(summary: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    paths = []
    combos = sorted({(r["dataset"], r["workload"]) for r in summary})
    for d, w in combos:
        by = _by(summary, d, w)
        lengths = sorted({k[0] for k in by})
        tag = f"{d}-{w}"

        def series(m, field, by=by, lengths=lengths):
            return [by.get((n, m), {}).get(field) for n in lengths]

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
        for m in ("full",) + PLANS + BASELINES:
            ys = series(m, "tok_s")
            if any(y is not None for y in ys):
                a1.plot(lengths, ys, marker="o", label=LABEL[m])
        a1.set(ylabel="output tokens/s", title="decode throughput")
        _length_axis(a1, lengths)
        a1.legend(fontsize=7)
        for m in PLANS:
            a2.plot(lengths, series(m, "speedup"), marker="o", label=f"{LABEL[m]} measured")
            a2.plot(
                lengths,
                series(m, "pred_speedup"),
                ls="--",
                marker="x",
                label=f"{LABEL[m]} predicted",
            )
        a2.axhline(1.0, color="grey", lw=0.8)
        a2.set(ylabel="x full context", title="speedup")
        _length_axis(a2, lengths)
        a2.legend(fontsize=7)
        fig.suptitle(f"{d}, {w} answers", fontsize=9)
        paths.append(_save(fig, out / f"speedup-{tag}.png", plt))

        fig, ax = plt.subplots(figsize=(4.8, 3.4))
        ax.plot(lengths, series("kapc", "s"), marker="o", label="s (retained)")
        for m in PLANS:
            ax.plot(lengths, series(m, "h"), marker="o", label=f"h ({LABEL[m]})")
        ax.set(ylim=(0, 1.02), title="s and h by length")
        _length_axis(ax, lengths)
        ax.legend(fontsize=7)
        paths.append(_save(fig, out / f"s-h-{tag}.png", plt))

        fig, ax = plt.subplots(figsize=(4.2, 4.0))
        pts = [
            (r["pred_speedup"], r["speedup"], r["method"])
            for r in by.values()
            if r["method"] in PLANS and r.get("pred_speedup") and r.get("speedup")
        ]
        for m in PLANS:
            xy = [(p, s) for p, s, mm in pts if mm == m]
            if xy:
                ax.scatter(*zip(*xy), label=LABEL[m])
        if pts:
            lo = min(min(p, s) for p, s, _ in pts) * 0.9
            hi = max(max(p, s) for p, s, _ in pts) * 1.1
            ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, label="measured = predicted")
        ax.axhline(1.0, color="red", lw=0.6, ls=":")
        ax.axvline(1.0, color="red", lw=0.6, ls=":", label="break-even")
        ax.set(
            xlabel="predicted speedup",
            ylabel="measured speedup",
            title="measured against predicted",
        )
        ax.legend(fontsize=7)
        paths.append(_save(fig, out / f"predicted-{tag}.png", plt))

        fig, ax = plt.subplots(figsize=(7.5, 3.4))
        methods = [m for m in ("full",) + PLANS + BASELINES if any(k[1] == m for k in by)]
        width = 0.8 / max(1, len(methods))
        for j, m in enumerate(methods):
            ys = [100 * (by.get((n, m), {}).get("pass") or 0) for n in lengths]
            ax.bar([i + j * width for i in range(len(lengths))], ys, width, label=LABEL[m])
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(lengths))], [str(n) for n in lengths])
        ax.set(
            xlabel="context tokens",
            ylabel="pass rate % (similarity >= 0.5)",
            title=f"quality by method ({d}, {w} answers)",
        )
        ax.legend(fontsize=7, ncol=2)
        paths.append(_save(fig, out / f"quality-{tag}.png", plt))
    return paths


def _length_axis(ax, lengths: list[int]) -> None:
    """Context lengths on a log axis, labelled by the lengths measured only (matplotlib's own
    minor labels, 2x10^3 and so on, overprint them)."""
    ax.set(xscale="log", xlabel="context tokens")
    ax.minorticks_off()
    ax.set_xticks(lengths, [str(n) for n in lengths])


def _save(fig, path: Path, plt) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def write_report(out: Path) -> Path:
    """report.md, summary.json, paired.json and the plots under `out`; returns the report's path."""
    from kapc.bench.quality import scored_rows
    from kapc.bench.run import CONFIG, TTFT, read_rows_plain

    out = Path(out)
    rows = complete_cases(scored_rows(out))
    summary = summarize(rows, read_rows_plain(out / TTFT))
    cfg = json.loads((out / CONFIG).read_text()) if (out / CONFIG).exists() else {}
    ident = cfg.get("identity", {})
    title = (
        f"kapc bench: {ident.get('engine', '?')} engine, batch {ident.get('batch', '?')}, "
        f"k={ident.get('k', '?')}"
    )
    comparison = paired(rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "paired.json").write_text(json.dumps(comparison, indent=1))
    text = markdown(summary, title, comparison)
    plots = plot_all(summary, out)
    text += "\n## Plots\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n"
    path = out / "report.md"
    path.write_text(text)
    return path
