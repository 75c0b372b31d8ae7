"""The sweep's summary and tables on rows made by hand: throughput over distinct batches,
speedup against full context at the same length, acceptance from the counts, and the tables'
shape."""

from __future__ import annotations

import pytest

from kapc.bench import report


def _row(method, index, length=2048, batch="b", tokens=10, secs=1.0, **kw):
    r = {
        "dataset": "hotpotqa",
        "workload": "short",
        "length": length,
        "method": method,
        "index": index,
        "prompt_tokens": length - 100,
        "generated": tokens // 2,
        "batch_id": f"{method}-{length}-{batch}",
        "batch_tokens": tokens,
        "batch_decode_s": secs,
        "em": 1.0 if index == 0 else 0.0,
        "f1": 0.5,
        "contains": 1.0,
        "similarity": 0.6,
        "passed": index == 0,
    }
    r.update(kw)
    return r


@pytest.fixture
def summary():
    rows = [
        # full: one batch of two requests, 20 tokens in 2 s -> 10 tok/s
        _row("full", 0, tokens=20, secs=2.0),
        _row("full", 1, tokens=20, secs=2.0),
        # greedy plans: two batches (5 tok/s and 15 tok/s) -> 40 tokens / 2 s = 20 tok/s
        _row(
            "kapc",
            0,
            batch="1",
            tokens=10,
            secs=1.0,
            proposed=8,
            accepted=6,
            cycles=4,
            s=0.2,
            pred_speedup=1.5,
            status="plan",
            identical=True,
            generated=9,
        ),
        _row(
            "kapc",
            1,
            batch="2",
            tokens=30,
            secs=1.0,
            proposed=12,
            accepted=9,
            cycles=3,
            s=0.4,
            pred_speedup=2.5,
            status="fallback",
            identical=False,
            generated=7,
        ),
        _row("physical", 0, tokens=8, secs=0.5, prompt_tokens=300),
    ]
    ttft = [
        {"dataset": "hotpotqa", "length": 2048, "method": "full", "index": 0, "engine_s": 3.0},
        {"dataset": "hotpotqa", "length": 2048, "method": "full", "index": 1, "engine_s": 5.0},
    ]
    return report.summarize(rows, ttft)


def test_summary_by_hand(summary):
    by = {r["method"]: r for r in summary}
    assert by["full"]["tok_s"] == pytest.approx(10.0)  # the shared batch counts once
    assert by["kapc"]["tok_s"] == pytest.approx(20.0)
    assert by["kapc"]["speedup"] == pytest.approx(2.0)
    assert by["physical"]["speedup"] == pytest.approx(1.6)
    assert by["kapc"]["h"] == pytest.approx(15 / 20)
    assert by["kapc"]["s"] == pytest.approx(0.3)
    assert by["kapc"]["margin"] == pytest.approx(0.45)
    assert by["kapc"]["tokens_per_cycle"] == pytest.approx((8 + 6) / 7)
    assert by["kapc"]["pred_speedup"] == pytest.approx(2.0)
    assert by["kapc"]["plans_run"] == 1
    assert by["kapc"]["identical"] == pytest.approx(0.5)
    assert by["full"]["pass"] == pytest.approx(0.5) and by["full"]["em"] == pytest.approx(0.5)
    assert by["full"]["ttft_s"] == pytest.approx(4.0)
    assert "h" not in by["full"]


def _table_rows(text):
    lines = text.splitlines()
    assert lines[1].startswith("|---:") and all(
        line.count("|") == lines[0].count("|") for line in lines
    )
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def test_tables_have_the_papers_shape(summary):
    eff = _table_rows(report.efficiency_table(summary, "hotpotqa", "short"))
    assert eff == [["2048", "1948", "10.00", "20.00", "2.00x", "-", "-", "4.00", "-", "-", "-"]]
    q = _table_rows(report.quality_table(summary, "hotpotqa", "short"))
    assert [r[1] for r in q] == ["full context", "kapc greedy"]
    assert q[0][3:] == ["50.0", "50.0", "100.0", "0.600", "50.0", "-"]
    assert q[1][-1] == "50.0"
    n, base = report.baselines_table(summary, "hotpotqa", "short")
    assert n == 2048
    assert [r[0] for r in _table_rows(base)] == ["full context", "kapc greedy", "physical concat"]
    phase = _table_rows(report.phase_table(summary, "hotpotqa", "short"))
    assert phase == [
        ["2048", "kapc greedy", "0.300", "0.750", "0.450", "2.00", "2.00x", "2.00x", "1/2"]
    ]
    md = report.markdown(summary)
    for title in (
        "Efficiency by length",
        "Quality by length",
        "Plans against the prompt baselines at 2048 tokens",
        "Phase boundary",
    ):
        assert f"### {title}" in md


def test_methods_are_compared_on_the_same_questions():
    rows = [
        _row("full", 0),
        _row("full", 1),
        _row("kapc", 0),
        _row("kapc", 1),
        _row("physical", 0),  # question 1 has no physical row yet: the sweep is still on it
        _row("full", 0, length=4096),
        _row("kapc", 0, length=4096),
        _row("physical", 0, length=4096),
        _row("full", 2, length=4096),
    ]
    kept = report.complete_cases(rows)
    assert sorted((r["length"], r["index"], r["method"]) for r in kept) == [
        (2048, 0, "full"),
        (2048, 0, "kapc"),
        (2048, 0, "physical"),
        (4096, 0, "full"),
        (4096, 0, "kapc"),
        (4096, 0, "physical"),
    ]
    other = [dict(r, workload="long") for r in rows if r["method"] != "physical"]
    assert len(report.complete_cases(other)) == 6  # long answers ran without physical: all kept


def test_paired_differences_by_hand():
    # three questions at two lengths; full passes every case, greedy fails one (question 0 at
    # 2048) and scores 0.1 more F1 everywhere
    rows = []
    for q in range(3):
        for n in (2048, 4096):
            rows.append(_row("full", q, length=n, passed=True, f1=0.4))
            rows.append(_row("kapc", q, length=n, passed=not (q == 0 and n == 2048), f1=0.5))
    got = {c["metric"]: c for c in report.paired(rows, resamples=4000, seed=1)}
    p = got["pass"]
    assert (p["cases"], p["questions"]) == (6, 3)
    assert p["diff"] == pytest.approx(-1 / 6)
    # a resample draws question 0 k times of 3: -k/6; no draw at all has chance 8/27, so the
    # upper bound is 0; all three draws have chance 1/27 > 2.5%, so the lower bound is -1/2
    assert p["hi"] == pytest.approx(0.0) and p["lo"] == pytest.approx(-0.5)
    assert got["f1"]["diff"] == pytest.approx(0.1)
    assert got["f1"]["lo"] == pytest.approx(0.1) and got["f1"]["hi"] == pytest.approx(0.1)
    assert got["similarity"]["diff"] == got["similarity"]["lo"] == got["similarity"]["hi"] == 0
    assert report.paired(rows, resamples=500, seed=3) == report.paired(rows, resamples=500, seed=3)
    table = _table_rows(report.paired_table(report.paired(rows), "hotpotqa", "short"))
    assert table == [
        [
            "kapc greedy",
            "6",
            "3",
            "-16.7 [-50.0, +0.0]",
            "+10.0 [+10.0, +10.0]",
            "+0.000 [+0.000, +0.000]",
        ]
    ]
    md = report.markdown(report.summarize(rows), comparison=report.paired(rows))
    assert "### Against full context, on the same questions" in md


def test_paired_skips_cases_without_full_context():
    rows = [_row("full", 0), _row("kapc", 0, f1=0.9), _row("kapc", 1, f1=0.0)]
    f1 = next(c for c in report.paired(rows) if c["metric"] == "f1")
    assert (f1["cases"], f1["diff"]) == (1, pytest.approx(0.4))
