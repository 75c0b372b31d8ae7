"""What each pass guarantees, on real HotpotQA priors and the real tokenizer."""

from __future__ import annotations

import msgspec
import pytest

from kapc.ingest import module_from_prior
from kapc.intervals import union
from kapc.pipeline import parse_pipeline, run_pipeline
from kapc.prior import load_prior
from tests.conftest import example_priors

CASES = example_priors()


def compiled(path, ctx, pipeline="ground,align-spans,select,resolve-pages,compact"):
    return run_pipeline(module_from_prior(load_prior(path)), parse_pipeline(pipeline), ctx).module


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.name.split(".")[0])
def test_spans_cover_exactly_the_segment_text(path, ctx):
    m = compiled(path, ctx, "ground,align-spans")
    rendered, tokens = ctx.tokenize.prompt(m)
    n = len(tokens.ids)
    assert m.prompt.tokens == n
    for seg, span in zip(m.segment, m.span):
        assert rendered.text[span.chars.start : span.chars.end] == seg.text
        first, last = span.tokens.start, span.tokens.end
        assert last > first  # every segment has text, so some token
        # the span is tight: the token before it ends before the segment starts, the one after
        # starts after it ends, and its own first and last tokens touch the segment
        assert first == 0 or tokens.ends[first - 1] <= span.chars.start < tokens.ends[first]
        assert last == n or tokens.starts[last - 1] < span.chars.end <= tokens.starts[last]


def test_rendering_matches_transformers_chat_template(ctx):
    """The compiler renders and tokenizes without transformers; it must agree with it exactly."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(ctx.assets.path))
    for path in CASES:
        prior = load_prior(path)
        m = module_from_prior(prior)
        messages = [
            {"role": msg.role, "content": "".join(s.text for s in msg.segments)}
            for msg in prior.request.messages
        ]
        ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        rendered, tokens = ctx.tokenize.prompt(m)
        assert rendered.text == hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        assert tokens.ids.tolist() == list(ids)


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.name.split(".")[0])
@pytest.mark.parametrize("ratio", [0.2, 0.35])
def test_select_respects_budget_and_keeps_what_decoding_needs(path, ratio, ctx):
    m = compiled(path, ctx, f"ground,align-spans,select{{budget-ratio={ratio}}}")
    n, sel = m.prompt.tokens, m.select
    assert sel.kept <= sel.budget == int(ratio * n)
    kept = union(k.tokens for k in m.keep)

    def inside(r):
        return any(k.start <= r.start and r.end <= k.end for k in kept)

    spans = m.spans_by_id()
    assert inside(type(kept[0])(0, 4))  # attention sink
    assert inside(type(kept[0])(n - 32, n))  # recent window
    for seg in m.segment:
        if seg.kind in ("instruction", "question"):
            assert inside(spans[seg.id].tokens)
    chosen = [k.id for k in m.keep if k.why == "evidence"]
    prior = {e.id: e.prior for e in m.evidence}
    assert set(chosen) | set(sel.dropped) == set(prior) and not set(chosen) & set(sel.dropped)
    # greedy by prior: a dropped passage did not fit in the room left when its turn came, and the
    # room only shrinks, so it does not fit in what is left at the end either
    for d in sel.dropped:
        span = spans[d].tokens
        new = sum(
            1 for t in range(span.start, span.end) if not any(k.start <= t < k.end for k in kept)
        )
        assert new > sel.budget - sel.kept
    assert [prior[d] for d in sel.dropped] == sorted((prior[d] for d in sel.dropped), reverse=True)


def test_best_passage_that_fits_is_kept(ctx):
    m = compiled(CASES[0], ctx, "ground,align-spans,select{budget-ratio=0.3}")
    spans = m.spans_by_id()
    room = m.select.budget - m.select.mandatory
    fitting = [e for e in m.evidence if len(spans[e.id].tokens) <= room]
    best = max(fitting, key=lambda e: e.prior)
    assert best.id in {k.id for k in m.keep if k.why == "evidence"}


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.name.split(".")[0])
def test_select_keeps_the_evidence_not_a_fraction(path, ctx):
    """keep-top=N keeps the N best passages (the budget a ceiling only); min-prior drops the
    passages below it; both keep everything decoding needs."""
    wide = compiled(path, ctx, "ground,align-spans,select{budget-ratio=0.9}")
    prior = {e.id: e.prior for e in wide.evidence}
    best = sorted(prior, key=lambda i: -prior[i])
    for n in (1, 2):
        m = compiled(path, ctx, f"ground,align-spans,select{{budget-ratio=0.9,keep-top={n}}}")
        chosen = [k.id for k in m.keep if k.why == "evidence"]
        assert sorted(chosen) == sorted(best[:n])
        assert {k.why for k in m.keep} >= {"sink", "window", "question"}
        assert m.select.kept <= wide.select.kept
    cut = sorted(prior.values())[len(prior) // 2]
    m = compiled(path, ctx, f"ground,align-spans,select{{budget-ratio=0.9,min-prior={cut}}}")
    chosen = {k.id for k in m.keep if k.why == "evidence"}
    assert chosen == {i for i, p in prior.items() if p >= cut}


def test_keep_growth_adds_passages_per_doubling_of_the_passages():
    from kapc.passes.select import Select

    sel = Select(keep_top=5, keep_growth=1.0, growth_from=16)
    assert [sel.passage_cap(n) for n in (10, 16, 28, 32, 57, 64, 128)] == [5, 5, 6, 6, 7, 7, 8]
    assert Select(keep_top=5).passage_cap(1000) == 5  # no growth unless asked
    assert Select().passage_cap(1000) == 0  # no cap at all


def test_keep_growth_keeps_the_best_passages_up_to_the_grown_cap(ctx):
    """A prompt of ~10 passages with growth-from=5: one doubling, so keep-top=1 keeps 2."""
    path = CASES[0]
    wide = compiled(path, ctx, "ground,align-spans,select{budget-ratio=0.9}")
    prior = {e.id: e.prior for e in wide.evidence}
    best = sorted(prior, key=lambda i: -prior[i])
    n = len(prior)
    m = compiled(
        path,
        ctx,
        f"ground,align-spans,select{{budget-ratio=0.9,keep-top=1,"
        f"keep-growth=1,growth-from={n // 2}}}",
    )
    chosen = [k.id for k in m.keep if k.why == "evidence"]
    assert sorted(chosen) == sorted(best[:2])


def test_select_evidence_options_are_checked():
    from kapc.passes.base import PassError

    with pytest.raises(PassError, match="min-prior must be within"):
        parse_pipeline("ground,align-spans,select{min-prior=1.5}")
    with pytest.raises(PassError, match="keep-top must be within"):
        parse_pipeline("ground,align-spans,select{keep-top=-1}")
    with pytest.raises(PassError, match="keep-growth must be within"):
        parse_pipeline("ground,align-spans,select{keep-top=5,keep-growth=-1}")


@pytest.mark.parametrize("bs", [16, 32, 128])
def test_pages_cover_every_kept_token_and_the_tail(bs, ctx):
    m = compiled(CASES[0], ctx, f"ground,align-spans,select,resolve-pages{{block-size={bs}}}")
    p, n = m.pages, m.prompt.tokens
    selected = {b for r in p.selected for b in range(r.start, r.end)}
    for k in m.keep:
        for t in range(k.tokens.start, k.tokens.end):
            assert t // bs in selected
    assert (n - 1) // bs in selected
    assert p.visible == sum(min(bs, n - b * bs) for b in selected)
    assert p.retained == round(p.visible / n, 6)


def test_cost_model_follows_the_formula_and_batching_helps(ctx):
    m1 = compiled(CASES[0], ctx)
    m8 = compiled(CASES[0], ctx, "ground,align-spans,select,resolve-pages,compact{batch=8}")
    c = m1.cost
    w, kv, s, h, k = c.weight_bytes, c.kv_bytes, c.s, c.h, c.k
    assert c.speedup == round((1 + k * h) * (w + kv) / (k * (w + s * kv) + w + kv), 4)
    assert kv == m1.prompt.tokens * m1.target.kv_elements_per_token * 4
    # the paper's condition: a plan pays exactly when (h - s) KV > (1 - h) W
    assert c.pays == ((h - s) * kv > (1 - h) * w)
    assert m8.cost.speedup > m1.cost.speedup  # W is shared by the batch, KV is not


def test_passes_never_mutate_their_input(ctx):
    module = module_from_prior(load_prior(CASES[0]))
    before = msgspec.json.encode(module)
    run_pipeline(module, parse_pipeline("ground,align-spans,select,resolve-pages,compact"), ctx)
    assert msgspec.json.encode(module) == before


def test_registry_names_match_the_passes():
    from kapc.passes import PASSES

    assert all(name == cls.name for name, cls in PASSES.items())
    assert list(PASSES) == ["ground", "align-spans", "select", "resolve-pages", "compact"]


def test_checker_catches_a_broken_invariant(ctx):
    from kapc.checker import CheckError, check_module

    m = compiled(CASES[0], ctx)
    broken = msgspec.structs.replace(
        m, pages=msgspec.structs.replace(m.pages, selected=m.pages.selected[:-1])
    )
    with pytest.raises(CheckError, match="tail block"):
        check_module(broken)
    over = msgspec.structs.replace(
        m, select=msgspec.structs.replace(m.select, budget=m.select.kept - 1)
    )
    with pytest.raises(CheckError, match="over the budget"):
        check_module(over)


@pytest.mark.parametrize("batch", [1, 8])
def test_a_plan_pays_exactly_from_the_length_it_states(batch, ctx):
    """`pays_from` (the paper's KV_crit) agrees with the plan's own verdict: a prompt at least
    that long pays, a shorter one does not; and a batch shares W, so it pays from shorter."""
    for path in CASES:
        c = compiled(
            path,
            ctx,
            f"ground,align-spans,select,resolve-pages,compact{{batch={batch},access=static}}",
        ).cost
        n = compiled(path, ctx, "ground,align-spans").prompt.tokens
        assert c.pays_from is not None
        if c.pays_from == 0:
            assert not c.pays
        elif abs(n - c.pays_from) > c.pays_from // 50:  # the search is exact to about 1%
            assert c.pays == (n >= c.pays_from), (path.name, n, c.pays_from)
    one = compiled(CASES[0], ctx, "ground,align-spans,select,resolve-pages,compact{access=static}")
    eight = compiled(
        CASES[0], ctx, "ground,align-spans,select,resolve-pages,compact{batch=8,access=static}"
    )
    assert 0 < eight.cost.pays_from and (
        one.cost.pays_from == 0 or eight.cost.pays_from < one.cost.pays_from
    )


def test_flat_priors_make_a_plan_that_falls_back_for_prior_confidence(ctx):
    """Priors that score every passage alike separate nothing: the plan records it, and a runtime
    decodes with the full context, saying why; the frontend's own priors do separate."""
    from kapc.compiler import compile_to_kapb
    from kapc.lower.kapb import decode_plan
    from kapc.policy import admit

    prior = load_prior(CASES[0])
    # every passage scored alike, and no entity graph lending some of them more
    units = [
        msgspec.structs.replace(u, scores={k: 0.5 for k in u.scores}, anchors=[])
        for u in prior.units
        if u.kind == "passage"
    ]
    flat = msgspec.structs.replace(prior, units=units)
    module = run_pipeline(
        module_from_prior(flat),
        parse_pipeline("ground,align-spans,select,resolve-pages,compact"),
        ctx,
    ).module
    assert module.select.dropped and module.select.separation == 0.0
    plan = decode_plan(
        compile_to_kapb(flat, "ground,align-spans,select,resolve-pages,compact", ctx, verify=False)
    )
    assert plan.header.prior_separation == 0.0
    verdict = admit(plan.header, retained=plan.header.retained_ratio, honor_predicted_loss=False)
    assert not verdict.runs and verdict.reason.startswith("prior confidence:")
    real = compiled(CASES[0], ctx)
    assert real.select.separation > real.fallback.min_separation
