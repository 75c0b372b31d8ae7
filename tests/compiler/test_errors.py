"""Bad input gets a message that says what is wrong and where; nothing crashes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kapc.cli import app
from kapc.ingest import module_from_prior
from kapc.lower.kapb import KapbError, PlanMismatch, check_plan_matches, read_plan
from kapc.parse import KapError, parse_module
from kapc.passes import CompileContext
from kapc.passes.base import PassError
from kapc.pipeline import PipelineError, parse_pipeline, run_pipeline
from kapc.prior import PriorError, load_prior
from tests.conftest import example_priors

PRIOR = example_priors()[0]


def test_syntax_error_points_at_line_and_column():
    text = 'kap name="x" request=chat\nsegment %a kind=passage\n  text="hi" }\n'
    with pytest.raises(KapError) as info:
        parse_module(text, "plan.kap")
    msg = str(info.value)
    assert msg.startswith("plan.kap:3:13: error: unexpected '}'")
    assert msg.splitlines()[1].strip() == 'text="hi" }'
    assert msg.splitlines()[2] == "  " + " " * 12 + "^"


def test_semantic_error_points_at_the_value():
    with pytest.raises(KapError) as info:
        parse_module('kap name="x" request=chat\nspan %a chars=1..2 tokens="3..4"\n', "p.kap")
    assert str(info.value).startswith(
        "p.kap:2:27: error: span.tokens: expected a range (start..end)"
    )


def test_unknown_statement_suggests_the_right_one():
    with pytest.raises(
        KapError, match=r"1:1: error: unknown statement 'kapp'; did you mean 'kap'\?"
    ):
        parse_module('kapp name="x" request=chat\n', "p.kap")


def test_unknown_pass():
    with pytest.raises(PipelineError, match=r"unknown pass 'selct'; did you mean 'select'\?"):
        parse_pipeline("ground,align-spans,selct")


def test_unknown_pass_option():
    with pytest.raises(PipelineError, match=r"select: unknown option 'budget=3'.*budget-tokens"):
        parse_pipeline("select{budget=3}")


def test_pass_before_what_it_requires(ctx):
    module = module_from_prior(load_prior(PRIOR))
    with pytest.raises(
        PipelineError, match="pass 'select' requires 'align-spans' to run before it"
    ):
        run_pipeline(module, parse_pipeline("ground,select"), ctx)


def test_prior_with_wrong_type_deep_inside_names_the_json_path(tmp_path):
    data = json.loads(PRIOR.read_text())
    data["units"][3]["scores"]["dense"] = "high"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    # msgspec itself only says `scores[...]`: the key is named from the document
    with pytest.raises(
        PriorError,
        match=r"Expected `float`, got `str` - at "
        r"`\$\.units\[3\]\.scores\[\"dense\"\]`",
    ):
        load_prior(bad)


def test_prior_with_dangling_anchor(tmp_path):
    data = json.loads(PRIOR.read_text())
    unit = next(i for i, u in enumerate(data["units"]) if u.get("anchors"))
    data["units"][unit]["anchors"][0]["segment"] = "nowhere"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(
        PriorError,
        match=rf"\$\.units\[{unit}\]\.anchors\[0\]\.segment: no passage segment 'nowhere'",
    ):
        load_prior(bad)


def test_budget_larger_than_the_prompt(ctx):
    module = module_from_prior(load_prior(PRIOR))
    with pytest.raises(
        PassError, match=r"budget of 100000 tokens is not below the prompt's \d+ tokens"
    ):
        run_pipeline(module, parse_pipeline("ground,align-spans,select{budget-tokens=100000}"), ctx)


def test_budget_below_the_mandatory_tokens(ctx):
    module = module_from_prior(load_prior(PRIOR))
    with pytest.raises(
        PassError, match=r"budget of 8 tokens is below the \d+ tokens that must stay visible"
    ):
        run_pipeline(module, parse_pipeline("ground,align-spans,select{budget-tokens=8}"), ctx)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.kapb"
    result = CliRunner().invoke(app, ["compile", str(PRIOR), "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_truncated_kapb(plan_file, tmp_path):
    cut = tmp_path / "cut.kapb"
    data = plan_file.read_bytes()
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(
        KapbError, match=rf"truncated: {len(data) - 100} bytes, the header says {len(data)}"
    ):
        read_plan(cut)
    cut.write_bytes(data[:20])
    with pytest.raises(
        KapbError, match="truncated: 20 bytes is shorter than the 56-byte .kapb prefix"
    ):
        read_plan(cut)


def test_kapb_with_one_flipped_byte(plan_file, tmp_path):
    data = bytearray(plan_file.read_bytes())
    for at in (100, len(data) // 2, len(data) - 1):
        flipped = bytearray(data)
        flipped[at] ^= 0x01
        path = tmp_path / "flipped.kapb"
        path.write_bytes(bytes(flipped))
        with pytest.raises(KapbError, match="checksum mismatch: the file is corrupt"):
            read_plan(path)


def test_kapb_future_version(plan_file, tmp_path):
    data = bytearray(plan_file.read_bytes())
    data[8] = 9
    path = tmp_path / "future.kapb"
    path.write_bytes(bytes(data))
    with pytest.raises(KapbError, match="format version 9 is newer than this kapc reads"):
        read_plan(path)


def test_kapb_compiled_for_another_model(plan_file, ctx):
    plan = read_plan(plan_file)
    check_plan_matches(
        plan, model_fingerprint=ctx.assets.fingerprint, prompt_token_ids=plan.prompt_token_ids
    )  # its own model: accepted
    with pytest.raises(PlanMismatch, match="was compiled for another model"):
        check_plan_matches(plan, model_fingerprint="sha256:" + "0" * 64)
    with pytest.raises(PlanMismatch, match="was compiled for another prompt"):
        check_plan_matches(plan, prompt_token_ids=plan.prompt_token_ids[:-1])
    with pytest.raises(PlanMismatch, match="compiled for block size 16, the engine uses 32"):
        check_plan_matches(plan, block_size=32)


def test_lowering_for_another_model_is_refused(tmp_path, ctx):
    """A .kap aligned for one model, lowered with another model's tokenizer, is refused."""
    import shutil

    from kapc.lower.lower import LowerError, lower_module

    other = tmp_path / "other-model"
    shutil.copytree(ctx.assets.path, other, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_hidden_layers"] = 2  # another architecture, same tokenizer
    (other / "config.json").write_text(json.dumps(cfg))
    module = run_pipeline(
        module_from_prior(load_prior(PRIOR)),
        parse_pipeline("ground,align-spans,select,resolve-pages,compact"),
        ctx,
    ).module
    with pytest.raises(LowerError, match="was aligned for model smollm2-135m-instruct"):
        lower_module(module, CompileContext(str(other)))


def test_cli_errors_are_one_paragraph_with_nonzero_exit(tmp_path):
    bad = tmp_path / "bad.kap"
    bad.write_text('kap name="x" request=chat\nsegment %a text=\n')
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "kapc", "fmt", "--check", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"{bad}:2:17: error: unexpected end of file" in proc.stderr
