"""Golden snapshots: the IR after every pass on small real HotpotQA cases, and `kapc explain`.

The cases are example priors cut to a screen (`tests/compiler/small_cases.py`). The first case's
per-pass IR is `plans/` itself, the folder users read; the others are syrupy snapshots. Regenerate
all of them with `pytest tests/compiler/test_golden.py --snapshot-update` and read the diff."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kapc.cli import app
from kapc.ingest import module_from_prior
from kapc.parse import parse_module, print_module
from kapc.parse.printer import WIDTH
from kapc.passes import DEFAULT_PIPELINE
from kapc.pipeline import parse_pipeline, run_pipeline
from kapc.prior import load_prior
from tests.compiler import small_cases
from tests.compiler.snapshot import KapSnapshot, TextSnapshot

DEFAULT_NAMES = [p.name for p in parse_pipeline(DEFAULT_PIPELINE)]
PLANS = Path(__file__).resolve().parents[2] / "plans"
CASES = [small_cases.input_path(s) for s in small_cases.SOURCES]
SCREEN = 64  # lines: a snapshot a reviewer reads on one screen


def _stages(prior_path, ctx):
    module = module_from_prior(load_prior(prior_path))
    result = run_pipeline(module, parse_pipeline(DEFAULT_PIPELINE), ctx, roundtrip=True)
    assert [r.name for r in result.records] == DEFAULT_NAMES
    for record in result.records:
        text = print_module(record.module)
        assert parse_module(text) == record.module  # the round-trip law, at every stage
        yield record.name, text


def plan_file(n: int, name: str) -> Path:
    return PLANS / f"{CASES[0].name.split('.')[0]}.{n}-{name}.kap"


@pytest.mark.parametrize("source", small_cases.SOURCES)
def test_inputs_are_what_small_cases_makes(source):
    assert small_cases.input_path(source).read_text() == small_cases.made(source)


def test_plans_folder_is_the_first_cases_golden(ctx, request):
    """plans/ holds the first case after every pass: compared here, rewritten by --snapshot-update."""
    update = request.config.getoption("--snapshot-update", default=False)
    for n, (name, text) in enumerate(_stages(CASES[0], ctx), start=1):
        path = plan_file(n, name)
        if update:
            path.write_text(text, encoding="utf-8")
        assert path.exists() and path.read_text(encoding="utf-8") == text, (
            f"{path} differs from the IR after {name}; regenerate with --snapshot-update"
        )
    kept = {plan_file(n, name).name for n, name in enumerate(DEFAULT_NAMES, start=1)}
    assert {p.name for p in PLANS.glob("*.kap")} == kept


@pytest.mark.parametrize("prior_path", CASES[1:], ids=lambda p: p.name.split(".")[0])
def test_every_pass_golden(prior_path, ctx, snapshot):
    for name, text in _stages(prior_path, ctx):
        assert text == snapshot(name=name, extension_class=KapSnapshot)


@pytest.mark.parametrize("prior_path", CASES, ids=lambda p: p.name.split(".")[0])
def test_goldens_fit_a_screen(prior_path, ctx):
    for name, text in _stages(prior_path, ctx):
        lines = text.splitlines()
        assert len(lines) <= SCREEN, f"{name}: {len(lines)} lines"
        assert max(map(len, lines)) <= WIDTH, f"{name}: a line of {max(map(len, lines))}"


def test_explain_golden(snapshot):
    """The one end-to-end golden: `kapc explain` on the first case, every pass and its notes."""
    result = CliRunner().invoke(app, ["explain", str(CASES[0])])
    assert result.exit_code == 0, result.output
    headers = [line for line in result.output.splitlines() if line.startswith("# ----- IR after")]
    assert headers == [f"# ----- IR after {p} ----- #" for p in ["input", *DEFAULT_NAMES]]
    assert result.output == snapshot(extension_class=TextSnapshot)


def test_explain_print_after_shows_only_that_pass(ctx):
    result = CliRunner().invoke(
        app, ["explain", str(CASES[0]), "--print-after", "resolve-pages", "--full-text"]
    )
    assert result.exit_code == 0, result.output
    assert result.output.count("# ----- IR after") == 1
    # with --full-text, the section is itself a valid .kap module
    module = parse_module(result.output)
    assert module.kap.passes[-1] == "resolve-pages" and module.pages is not None
    assert "# pages:" in result.output and "# select:" in result.output
