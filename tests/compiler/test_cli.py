"""The command line: every command works, `--json` is machine-readable, the compiler stays light."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kapc.cli import app
from kapc.lower.kapb import read_plan
from kapc.parse import parse_file
from tests.conftest import ROOT, example_priors

PRIOR = example_priors()[0]
runner = CliRunner()


def test_compile_inspect_json(tmp_path):
    out, kap = tmp_path / "plan.kapb", tmp_path / "plan.kap"
    result = runner.invoke(app, ["compile", str(PRIOR), "-o", str(out), "--emit-kap", str(kap)])
    assert result.exit_code == 0, result.output
    info = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).output)
    module = parse_file(kap)
    assert info["format_version"] == 2
    assert info["access"]["mode"] == module.access.mode == "hybrid"
    assert info["access"]["budget"] == module.access.budget
    assert info["prompt_tokens"] == module.prompt.tokens
    assert info["block_size"] == module.pages.block_size == 16
    assert len(info["selected_blocks"]) == sum(len(r) for r in module.pages.selected)
    assert info["retained_ratio"] == module.pages.retained
    plan = read_plan(out)
    assert plan.positions.size == plan.header.visible_prompt_tokens == module.pages.visible
    # positions are the logical positions of the visible tokens, block by block
    bs = plan.header.block_size
    assert set(plan.positions.tolist()) == {
        p
        for b in plan.selected_blocks.tolist()
        for p in range(b * bs, (b + 1) * bs)
        if p < module.prompt.tokens
    }


def test_compile_continues_from_any_stage(tmp_path):
    """A .kap dumped after `select` compiles to the same plan as the prior itself."""
    staged = tmp_path / "selected.kap"
    result = runner.invoke(app, ["explain", str(PRIOR), "--print-after", "select", "--full-text"])
    staged.write_text(result.output)
    a, b = tmp_path / "a.kapb", tmp_path / "b.kapb"
    assert runner.invoke(app, ["compile", str(PRIOR), "-o", str(a)]).exit_code == 0
    r = runner.invoke(app, ["compile", str(staged), "-o", str(b)])
    assert r.exit_code == 0, r.output
    assert a.read_bytes() == b.read_bytes()


def test_pipeline_options_change_the_plan(tmp_path):
    small, large = tmp_path / "s.kapb", tmp_path / "l.kapb"
    for out, budget in ((small, 0.1), (large, 0.4)):
        r = runner.invoke(
            app,
            [
                "compile",
                str(PRIOR),
                "-o",
                str(out),
                "--passes",
                f"ground,align-spans,select{{budget-ratio={budget}}},"
                "resolve-pages{block-size=32},compact{k=4,accept=top3}",
            ],
        )
        assert r.exit_code == 0, r.output
    s, big = read_plan(small).header, read_plan(large).header
    assert s.block_size == big.block_size == 32 and s.k == 4 and s.accept == "top3"
    assert s.retained_ratio < big.retained_ratio


def test_fmt_check_and_rewrite(tmp_path):
    kap = tmp_path / "x.kap"
    r = runner.invoke(app, ["explain", str(PRIOR), "--print-after", "ground", "--full-text"])
    kap.write_text(r.output.replace(" request=chat", "\n   request=chat"))
    assert runner.invoke(app, ["fmt", "--check", str(kap)]).exit_code == 1
    assert runner.invoke(app, ["fmt", str(kap)]).exit_code == 0
    assert runner.invoke(app, ["fmt", "--check", str(kap)]).exit_code == 0
    assert not kap.read_text().startswith("#")  # comments are not IR; fmt drops them


def test_plans_folder_is_canonical_and_valid():
    r = runner.invoke(app, ["fmt", "--check", str(ROOT / "plans")])
    assert r.exit_code == 0, r.output


def test_schema_prior_is_json_schema():
    schema = json.loads(runner.invoke(app, ["schema", "prior"]).output)
    assert schema["$ref"].endswith("/Prior")
    prior = schema["$defs"]["Prior"]
    assert {"request", "units", "name"} <= set(prior["properties"])
    assert prior.get("additionalProperties") is False


@pytest.mark.parametrize(
    "cmd", [[], ["compile"], ["explain"], ["inspect"], ["fmt"], ["schema", "prior"], ["serve"]]
)
def test_help_everywhere(cmd):
    r = runner.invoke(app, [*cmd, "--help"])
    assert r.exit_code == 0 and "Usage" in r.output


def test_python_dash_m_and_no_torch_in_the_compiler(tmp_path):
    out = tmp_path / "p.kapb"
    code = (
        f"import sys, runpy; sys.argv=['kapc','compile',{str(PRIOR)!r},'-o',{str(out)!r}]\n"
        "try:\n    runpy.run_module('kapc', run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "heavy = sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules)\n"
        "print('HEAVY', heavy)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout
    assert read_plan(out).header.prompt_tokens > 0


def test_a_client_needs_no_engine():
    """kapc.client runs wherever a client does: no torch, transformers or vLLM behind it."""
    code = (
        "import sys, kapc.client\n"
        "print('HEAVY', sorted(m for m in ('torch', 'vllm', 'transformers', 'openai') "
        "if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


def test_dump_dir_writes_every_stage_as_parseable_kap(tmp_path, monkeypatch):
    dump = tmp_path / "dump"
    monkeypatch.setenv("KAPC_DUMP_DIR", str(dump))
    monkeypatch.setenv("KAPC_CHECK_ROUNDTRIP", "1")
    r = runner.invoke(app, ["compile", str(PRIOR), "-o", str(tmp_path / "p.kapb")])
    assert r.exit_code == 0, r.output
    files = sorted(p.name for p in dump.iterdir())
    assert files == [
        "00-ground.kap",
        "01-align-spans.kap",
        "02-select.kap",
        "03-resolve-pages.kap",
        "04-compact.kap",
    ]
    assert parse_file(dump / "04-compact.kap").kap.passes[-1] == "compact"


def test_exit_codes_through_the_real_entry_point(tmp_path):
    """`fmt --check` on a non-canonical file exits 1 from the shell, not only under CliRunner."""
    kap = tmp_path / "x.kap"
    kap.write_text('kap   name="x" request=raw\n')

    def run(*a):
        return subprocess.run([sys.executable, "-m", "kapc", *a], capture_output=True, text=True)

    assert run("fmt", "--check", str(kap)).returncode == 1
    assert run("fmt", str(kap)).returncode == 0
    assert run("fmt", "--check", str(kap)).returncode == 0
    assert run("inspect", str(tmp_path / "missing.kapb")).returncode == 1


def test_compile_warns_when_an_unmeasured_model_predicts_a_gain(tmp_path):
    """The memory-bound model predicts gains on CPUs where plans lose (docs/cost-model.md): a plan
    that says it pays on that model alone says it is not a measurement. A predicted loss needs no
    warning (the runtime falls back)."""

    def compile_with(compact: str) -> str:
        r = runner.invoke(
            app,
            [
                "compile",
                str(PRIOR),
                "-o",
                str(tmp_path / "p.kapb"),
                "--passes",
                f"ground,align-spans,select,resolve-pages,{compact}",
            ],
        )
        assert r.exit_code == 0, r.output
        return r.output

    gain = compile_with("compact{k=4,batch=64,profile=none}")
    assert "pays off" in gain and "warning: the predicted" in gain and "kapc calibrate" in gain
    loss = compile_with("compact{k=4,batch=1,profile=none}")
    assert "predicted loss" in loss and "warning" not in loss
