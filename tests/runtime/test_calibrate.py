"""`kapc calibrate` on the reference executor, on a tiny grid: a well-formed profile (every step
kind fitted, acceptance fitted from real compiled plans), a summary and a plot, and a resumed run
that measures only what is missing."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kapc.profile import load_profile, machine_cpu, profile_key
from kapc.runtime.calibrate import (
    GRIDS,
    Grid,
    ReferenceBench,
    calibrate,
    cycle_times,
    plot,
    show,
)
from kapc.runtime.planner import StepRecord

pytestmark = pytest.mark.model

TINY = Grid(
    contexts=(256, 512),
    batches=(1, 2),
    pairs=((0.25, 2), (0.5, 3)),
    select_pair=(0.25, 3),
    tolerant_pairs=((0.25, 2), (0.5, 3)),
    steps=3,
    acceptance_questions=1,
    acceptance_contexts=(1024,),
    budgets=(0.15, 0.5),
    acceptance_tokens=12,
    rules=("greedy",),
)


class Counting:
    """The bench, counting the measurements it is asked for."""

    def __init__(self, bench):
        self.bench, self.calls = bench, 0

    def __getattr__(self, name):
        attr = getattr(self.bench, name)
        if name in ("plain", "resting", "cycle", "acceptance"):

            def counted(*a, **kw):
                self.calls += 1
                return attr(*a, **kw)

            return counted
        return attr


def test_tiny_calibration_gives_a_well_formed_profile(tmp_path, capsys):
    bench = Counting(ReferenceBench(block_size=16, max_context=1024, max_batch=2))
    # as vLLM's bench does once kapc's engine is up: every point measured on it records this, and
    # the progress lines must still print (a KeyError there once ended a vLLM calibration)
    bench.attention_kernel, bench.draft_weights = "kapc's", "bfloat16 copies"
    profile, path = calibrate(bench, TINY, resume=False, progress=False, out=tmp_path / "p.json")
    assert profile.attention_kernel == "kapc's" and profile.draft_weights == "bfloat16 copies"
    # output that is not a terminal gets a line as each point starts, before its result line
    log = capsys.readouterr().err.splitlines()
    n = len(TINY.points())
    starts = [i for i, line in enumerate(log) if line.startswith("kapc calibrate: point ")]
    assert len(starts) == n and log[starts[0]].startswith(f"kapc calibrate: point 1/{n}: ")
    assert all(log[i + 1].startswith("  ") for i in starts)  # its result follows it
    # every cycle point times resting steps beside it (rest_beside_cycles)
    cycles = sum(pt[0] == "cycle" for pt in TINY.points())
    assert TINY.rest_beside_cycles and bench.calls == len(TINY.points()) + cycles
    assert load_profile(path) == profile
    assert set(profile.fits) >= {"plain", "resting", "draft", "verify", "select", "verify_tolerant"}
    for fit in profile.fits.values():
        assert all(c >= 0 for c in fit.coef) and fit.samples >= len(fit.features)
    for kind in ("plain", "draft"):
        assert profile.seconds(kind, 2, 512) > 0
    assert profile.seconds("verify", 2, 512, query=3) > 0
    kinds = [s.kind for s in profile.samples]
    # cycles draft on the compiler's default (hybrid) pages, so each times its page choice too
    assert TINY.draft_access == "hybrid"
    assert kinds.count("plain") == 4 and kinds.count("verify") == 8
    assert kinds.count("select") == 4 + 8
    assert kinds.count("resting") == 4 + cycles
    assert kinds.count("verify_tolerant") == 8 and profile.seconds("verify_tolerant", 2, 512, 3) > 0
    # query-aware page choice costs something, and no less over longer prompts
    assert 0 < profile.seconds("select", 2, 256) <= profile.seconds("select", 2, 4096)
    fit = profile.acceptance["greedy"]
    assert len(fit.points) == len(TINY.budgets) and 0.0 < fit.p(0.3) < 1.0
    # query-chosen pages are measured too, at the same plans' own s, under their own key
    dyn = profile.acceptance_fit("greedy", "hybrid")
    assert dyn is profile.acceptance["greedy+dynamic"] and 0.0 < dyn.p(0.3) < 1.0
    assert [pt[1] for pt in dyn.points] == [pt[1] for pt in fit.points]
    assert [pt[0] for pt in dyn.points] == pytest.approx([pt[0] for pt in fit.points], abs=0.02)
    assert profile.cpu == machine_cpu()  # the CPU it holds for
    assert profile.key == profile_key(
        "reference",
        profile.model_fingerprint,
        profile.dtype,
        profile.device,
        profile.threads,
        machine_cpu(),
    )
    assert not (tmp_path / "p.partial.jsonl").exists()  # done: no partial beside the profile
    text = show(profile)
    assert "plain" in text and "acceptance greedy" in text
    # where plans start to pay, per batch measured, at each stated s
    assert "KV_crit" in text
    table = text[text.index("KV_crit") :].splitlines()[1:]
    assert table[0].split() == ["s"] + [
        f"B={b}" for b in sorted({x.batch for x in profile.samples if x.kind == "verify"})
    ]
    assert [row.split()[0] for row in table[1:]] == ["0.05", "0.10", "0.20"]
    assert "draft forwards read: bfloat16 copies" in text
    png = plot(profile, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # resume: with every point already in the partial file, nothing is measured again, and the
    # attention kernel and draft weights the points were measured with are kept though no
    # engine ran this time
    with open(tmp_path / "again.partial.jsonl", "w") as f:
        for point in TINY.points():
            f.write(
                json.dumps(
                    {
                        "point": list(point),
                        "samples": [],
                        "attention_kernel": "kapc's",
                        "draft_weights": "bfloat16 copies",
                    }
                )
                + "\n"
            )
    again = Counting(bench.bench)
    resumed, _ = calibrate(again, TINY, resume=True, progress=False, out=tmp_path / "again.json")
    assert again.calls == 0
    assert resumed.attention_kernel == "kapc's"
    assert resumed.draft_weights == "bfloat16 copies"

    # --only select: the page-choice points alone are measured again, the rest is kept, even
    # where an interrupted full run left other points in the partial file
    with open(tmp_path / "only.partial.jsonl", "w") as f:
        f.write(
            json.dumps({"point": ["plain", 256, 1, 0.0, 1], "samples": [["plain", 1, 1, 256, 9.9]]})
            + "\n"
        )
    once = Counting(bench.bench)
    redone, _ = calibrate(
        once,
        TINY,
        resume=True,
        progress=False,
        out=tmp_path / "only.json",
        base=profile,
        only=("select",),
    )
    assert once.calls == 4
    assert [x for x in redone.samples if x.kind != "select"] == [
        x for x in profile.samples if x.kind != "select"
    ]
    # the 4 select points' samples replace the base's at the same points; the base's samples
    # at other points (cycles time page choice too, at their own q) stay
    base_selects = [x for x in profile.samples if x.kind == "select"]
    at = lambda x: (x.batch, x.query, x.visible)  # noqa: E731
    redone_selects = [x for x in redone.samples if x.kind == "select"]
    new = {at(x) for x in redone_selects if x not in base_selects}
    assert len(new) == 4
    assert [x for x in redone_selects if at(x) not in new] == [
        x for x in base_selects if at(x) not in new
    ]
    assert redone.fits["verify"] == profile.fits["verify"]
    assert redone.acceptance == profile.acceptance

    # --only with a cell the profile lacks: the cell's points are added, the others kept
    wider = calibrate(
        Counting(bench.bench),
        dataclasses.replace(TINY, contexts=(384,), batches=(2,)),
        progress=False,
        out=tmp_path / "wider.json",
        base=profile,
        only=("select",),
    )[0]
    selects = [x for x in wider.samples if x.kind == "select"]
    assert len(selects) == len(base_selects) + 1 and "select" in wider.fits
    assert selects[:-1] == base_selects and selects[-1].visible == 384


def test_cycle_times_read_the_proposer_step_log():
    # StepRecords of steps of 2 rows, each call drafting 2 tokens per row in 0.2 s of forwards (0.04 s of
    # which choose pages) and 0.05 s of its own work, each verification taking 0.5 s between calls
    log, t = [], 0.0
    for _ in range(8):
        log.append(tuple(StepRecord(t, t + 0.25, 2, 2, 2, 0.2, 0.04)))  # as the worker sends
        t += 0.25 + 0.5
    c = cycle_times(log, rows=2, q=3)
    assert c.verify == pytest.approx(0.5) and c.draft == pytest.approx(0.08)
    assert c.propose == pytest.approx(0.05) and c.select == pytest.approx(0.04)


def test_a_grid_of_cells_times_those_cells_longest_first():
    """The default grid times chosen (context, batch) cells, not every context x batch, and no
    plain engine; its rows and contexts are what the bench sizes its engine for."""
    grid = GRIDS["default"]
    pts = grid.points()
    cells = sorted({(L, B) for kind, L, B, _, _ in pts if kind != "acceptance"})
    assert cells == sorted(grid.cells) and not any(p[0] == "plain" for p in pts)
    timed = [(L, B) for kind, L, B, _, _ in pts if kind == "resting"]
    assert [L for L, _ in timed] == sorted((L for L, _ in timed), reverse=True)
    assert grid.longest == max(L for L, _ in grid.cells) and grid.widest == 8
    # every step model the policy reads has samples to spare for a leave-one-out forecast (the
    # most features a kind has is 5), and verification is timed at more than one q
    cycles = [p for p in pts if p[0] == "cycle"]
    assert len(cycles) > 5 and len({q for *_, q in cycles}) >= 2
    full = GRIDS["full"]
    assert {(L, B) for kind, L, B, _, _ in full.points() if kind == "plain"} == {
        (L, B) for L in full.contexts for B in full.batches
    }


def test_calibrate_commands_measure_show_plot_and_refit_a_profile(tmp_path, monkeypatch):
    """The commands as a user runs them, on the reference executor and the real model: `measure`
    writes a profile and prints it, `show`, `plot` and `refit` read it back. The quick grid is
    swapped for a smaller one so that the test takes seconds; everything else is real."""
    from typer.testing import CliRunner

    from kapc.cli import app
    from kapc.runtime import calibrate as cal

    tiny = Grid(
        contexts=(256,),
        batches=(1, 2),
        pairs=((0.5, 3),),
        select_pair=None,
        tolerant_pairs=(),
        steps=3,
        acceptance_questions=0,
    )
    monkeypatch.setitem(cal.GRIDS, "quick", tiny)
    out = tmp_path / "ref.json"
    run = CliRunner().invoke(
        app, ["calibrate", "measure", "--engine", "reference", "--grid", "quick", "-o", str(out)]
    )
    assert run.exit_code == 0, run.output
    profile = load_profile(out)
    assert profile.engine == "reference"
    assert {(x.kind, x.batch) for x in profile.samples} >= {("plain", 1), ("plain", 2)}
    assert {x.visible for x in profile.samples if x.kind == "verify"} == {256}
    assert f"profile {profile.key}" in run.output
    shown = CliRunner().invoke(app, ["calibrate", "show", str(out)])
    assert shown.exit_code == 0 and f"profile {profile.key}" in shown.output
    png = tmp_path / "fit.png"
    plotted = CliRunner().invoke(app, ["calibrate", "plot", str(out), "-o", str(png)])
    assert plotted.exit_code == 0 and png.read_bytes()[:4] == b"\x89PNG"
    refit = CliRunner().invoke(app, ["calibrate", "refit", str(out)])
    assert refit.exit_code == 0 and "fitted again" in refit.output
    assert load_profile(out).samples == profile.samples


def test_acceptance_plans_are_compiled_for_the_model_being_calibrated():
    """Calibrating the long-context model must time its acceptance on its own prompts and plans:
    plans compiled for the default model carry another fingerprint and are refused."""
    from kapc.lower.kapb import decode_plan
    from kapc.models import LONG_CONTEXT_MODEL, load_assets
    from kapc.runtime.calibrate import build_acceptance_cases

    qwen = load_assets(LONG_CONTEXT_MODEL)
    ((ids, plans),) = build_acceptance_cases(TINY, 1024, 32, 4, LONG_CONTEXT_MODEL)
    assert len(plans) == len(TINY.budgets)
    for data in plans:
        plan = decode_plan(data)
        assert plan.header.model_fingerprint == qwen.fingerprint
        assert plan.header.tokenizer_fingerprint == qwen.tokenizer_fingerprint
        assert [int(t) for t in plan.prompt_token_ids] == ids
