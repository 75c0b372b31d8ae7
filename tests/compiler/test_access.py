"""Access policies through the compiler: `compact{access=...}` writes an `access` statement that
prints, parses, is checked, and lowers into the `.kapb` header; ES-Mix calibrations are read,
checked against the model and copied into the plan."""

from __future__ import annotations

import msgspec
import pytest

from kapc.checker import CheckError, check_module
from kapc.ingest import module_from_prior
from kapc.lower.kapb import FORMAT_VERSION, KapbError, decode_plan
from kapc.lower.lower import lower_module
from kapc.parse import parse_module, print_module
from kapc.passes.base import PassError
from kapc.pipeline import parse_pipeline, run_pipeline
from kapc.prior import load_prior
from kapc.proxy_mix import MIX_VERSION, ProxyMix, ProxyMixError, choose_mix, load_mix, save_mix
from tests.conftest import example_priors

PRIOR = example_priors()[0]
BASE = "ground,align-spans,select,resolve-pages,"


def compile_with(ctx, compact: str):
    m = run_pipeline(
        module_from_prior(load_prior(PRIOR)), parse_pipeline(BASE + compact), ctx
    ).module
    return m, decode_plan(lower_module(m, ctx))


def test_default_plans_are_hybrid_at_their_own_retained_ratio(ctx):
    m, plan = compile_with(ctx, "compact")
    assert m.access.mode == plan.header.access.mode == "hybrid"
    assert m.access.budget == pytest.approx(m.pages.retained, abs=1e-6)
    assert plan.header.access.budget == m.access.budget
    static, plan = compile_with(ctx, "compact{access=static}")
    assert static.access.mode == plan.header.access.mode == "static"
    with pytest.raises(PassError, match="access-budget must be a ratio or plan, not 'most'"):
        parse_pipeline(BASE + "compact{access=dynamic,access-budget=most}")


@pytest.mark.parametrize(
    "options,mode,proxy",
    [
        ("access=dynamic,access-budget=0.2", "dynamic", "query"),
        ("access=hybrid,access-budget=0.25,proxy=es-mid", "hybrid", "es-mid"),
    ],
)
def test_an_access_policy_prints_parses_and_lowers(ctx, options, mode, proxy):
    m, plan = compile_with(ctx, f"compact{{{options}}}")
    text = print_module(m)
    assert f"access mode={mode}" in text
    assert parse_module(text) == m  # the round-trip law holds for the new statement
    a = plan.header.access
    assert (a.mode, a.proxy) == (mode, proxy) and a.budget == m.access.budget
    assert FORMAT_VERSION == 2


def test_bad_access_options_are_refused_before_anything_runs():
    with pytest.raises(PassError, match="access budget 0.0 must lie in"):
        parse_pipeline(BASE + "compact{access=dynamic,access-budget=0}")
    with pytest.raises(PassError, match="access mode 'sometimes'"):
        parse_pipeline(BASE + "compact{access=sometimes}")
    with pytest.raises(PassError, match="es-mix needs mix=FILE"):
        parse_pipeline(BASE + "compact{access=dynamic,proxy=es-mix}")


def test_the_checker_refuses_a_hand_edited_access(ctx):
    m, _ = compile_with(ctx, "compact{access=hybrid}")
    bad = msgspec.structs.replace(m, access=msgspec.structs.replace(m.access, budget=1.5))
    with pytest.raises(CheckError, match="access budget 1.5"):
        check_module(bad)
    with pytest.raises(CheckError, match="no 'access' statement"):
        check_module(msgspec.structs.replace(m, access=None))


def test_a_version_1_plan_reads_as_static_access(ctx):
    data = bytearray(lower_module(compile_with(ctx, "compact")[0], ctx))
    data[8] = 1  # the version lives in the prefix, outside the checksummed body
    old = decode_plan(bytes(data))
    assert old.header.access.mode == "static"


def _mix(ctx, layers=30, **kw) -> ProxyMix:
    a = ctx.assets
    fields = dict(
        version=MIX_VERSION,
        model=a.name,
        model_fingerprint=a.fingerprint,
        budget=0.15,
        questions=2,
        overlap_in=(1.0,) + (0.8,) * (layers - 1),
        overlap_mid=(1.0,) + (0.9,) * (layers - 1),
        mix=("mid",) * layers,
    )
    fields.update(kw)
    return ProxyMix(**fields)


def test_es_mix_copies_the_calibrations_choice_into_the_plan(ctx, tmp_path):
    path = save_mix(_mix(ctx), tmp_path / "mix.json")
    m, plan = compile_with(ctx, f"compact{{access=dynamic,proxy=es-mix,mix={path}}}")
    assert m.access.mix == ("mid",) * 30 and m.access.mix_digest == load_mix(path).digest
    assert plan.header.access.mix == ("mid",) * 30
    assert parse_module(print_module(m)) == m


def test_a_proxy_calibration_for_another_model_or_unreadable_is_refused(ctx, tmp_path):
    other = save_mix(_mix(ctx, model_fingerprint="sha256:" + "0" * 64), tmp_path / "other.json")
    with pytest.raises(PassError, match="made for another model"):
        compile_with(ctx, f"compact{{access=dynamic,proxy=es-mix,mix={other}}}")
    junk = tmp_path / "junk.json"
    junk.write_text("{}")
    with pytest.raises(PassError, match="not a kapc proxy calibration"):
        compile_with(ctx, f"compact{{access=dynamic,proxy=es-mix,mix={junk}}}")
    short = save_mix(_mix(ctx, mix=("in",)), tmp_path / "short.json")
    with pytest.raises(ProxyMixError, match="for every layer"):
        load_mix(short)


def test_choose_mix_takes_the_better_proxy_per_layer():
    assert choose_mix((1.0, 0.9, 0.5), (1.0, 0.8, 0.6)) == ("mid", "in", "mid")


def test_a_plan_with_a_bad_access_policy_is_refused_by_the_reader(ctx):
    from kapc.lower.kapb import encode_plan
    from kapc.policy import AccessPolicy

    _, plan = compile_with(ctx, "compact")
    h = msgspec.structs.replace(
        plan.header, access=AccessPolicy(mode="dynamic", budget=0.0), arrays=()
    )
    data = encode_plan(h, plan.prompt_token_ids, plan.selected_blocks, plan.positions)
    with pytest.raises(KapbError, match="access budget 0.0"):
        decode_plan(data)
