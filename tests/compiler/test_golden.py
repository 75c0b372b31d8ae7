"""Golden snapshots: the IR after every pass on small real HotpotQA cases, and `kapc explain`.

Regenerate with `pytest tests/compiler/test_golden.py --snapshot-update` and read the diff."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kapc.cli import app
from kapc.ingest import module_from_prior
from kapc.parse import parse_module, print_module
from kapc.passes import DEFAULT_PIPELINE
from kapc.pipeline import parse_pipeline, run_pipeline
from kapc.prior import load_prior
from tests.compiler.snapshot import KapSnapshot, TextSnapshot
from tests.conftest import example_priors

DEFAULT_NAMES = [p.name for p in parse_pipeline(DEFAULT_PIPELINE)]

CASES = [p for p in example_priors() if p.name.endswith("-700.prior.json")]


@pytest.mark.parametrize("prior_path", CASES, ids=lambda p: p.name.split(".")[0])
def test_every_pass_golden(prior_path, ctx, snapshot):
    module = module_from_prior(load_prior(prior_path))
    result = run_pipeline(module, parse_pipeline(DEFAULT_PIPELINE), ctx, roundtrip=True)
    assert [r.name for r in result.records] == DEFAULT_NAMES
    for record in result.records:
        text = print_module(record.module)
        assert parse_module(text) == record.module  # the round-trip law, at every stage
        assert text == snapshot(name=record.name, extension_class=KapSnapshot)


@pytest.mark.parametrize("prior_path", CASES[:1], ids=lambda p: p.name.split(".")[0])
def test_explain_golden(prior_path, snapshot):
    result = CliRunner().invoke(app, ["explain", str(prior_path)])
    assert result.exit_code == 0, result.output
    headers = [line for line in result.output.splitlines() if line.startswith("# ----- IR after")]
    assert headers == [f"# ----- IR after {p} ----- #" for p in ["input", *DEFAULT_NAMES]]
    assert result.output == snapshot(extension_class=TextSnapshot)


def test_explain_print_after_shows_only_that_pass(ctx):
    prior_path = CASES[0]
    result = CliRunner().invoke(
        app, ["explain", str(prior_path), "--print-after", "resolve-pages", "--full-text"]
    )
    assert result.exit_code == 0, result.output
    assert result.output.count("# ----- IR after") == 1
    # with --full-text, the section is itself a valid .kap module
    module = parse_module(result.output)
    assert module.kap.passes[-1] == "resolve-pages" and module.pages is not None
    assert "# pages:" in result.output and "# select:" in result.output
