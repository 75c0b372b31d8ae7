"""Adapters: the shipped real-shaped examples make valid priors that compile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kapc.frontend import adapters
from kapc.frontend.cli import prior_app
from kapc.frontend.errors import FrontendError
from kapc.prior import PriorError, decode_prior, encode_prior, load_prior

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "adapters"
KINDS = ("hipporag", "graphrag", "lightrag", "passages")
QUESTION = (
    "What government position was held by the woman who portrayed Corliss Archer in the "
    "film Kiss and Tell?"
)


def _example(kind):
    return json.loads((EXAMPLES / f"{kind}.json").read_text())


@pytest.mark.parametrize("kind", KINDS)
def test_example_makes_a_valid_prior(kind):
    prior = adapters.adapt_file(kind, EXAMPLES / f"{kind}.json")
    assert decode_prior(encode_prior(prior)) == prior
    segs = [s for m in prior.request.messages for s in m.segments]
    assert segs[-1].kind == "question" and QUESTION in segs[-1].text
    passages = [s for s in segs if s.kind == "passage"]
    assert len(passages) == 6
    assert any("Shirley Temple" in s.text for s in passages)
    units = [u for u in prior.units if u.kind == "passage"]
    assert [u.segment for u in units] == [s.id for s in passages]
    assert all(u.scores for u in units)
    for u in prior.units:
        for a in u.anchors:
            seg = next(s for s in passages if s.id == a.segment)
            assert 0 <= a.start < a.end <= len(seg.text)


def test_hipporag_scores_and_titles():
    prior = adapters.from_hipporag(_example("hipporag"))
    src = _example("hipporag")[0]
    units = [u for u in prior.units if u.kind == "passage"]
    assert [u.scores["ppr"] for u in units] == src["doc_scores"]
    assert units[0].text == src["docs"][0].split("\n")[0]
    assert prior.meta["gold_answers"] == ["Chief of Protocol"]


@pytest.mark.parametrize("kind", ["graphrag", "lightrag"])
def test_graph_items_become_anchored_units(kind):
    prior = adapters.adapt_file(kind, EXAMPLES / f"{kind}.json")
    segs = {s.id: s for m in prior.request.messages for s in m.segments}
    nodes = [u for u in prior.units if u.kind == "node"]
    triples = [u for u in prior.units if u.kind == "triple"]
    assert len(nodes) == 5 and len(triples) == 5
    for u in nodes:
        for a in u.anchors:
            assert segs[a.segment].text[a.start : a.end].lower() == u.text.lower()
    assert "unanchored" not in prior.meta


def test_compiles_with_the_compiler():
    from kapc.ingest import module_from_prior
    from kapc.passes import CompileContext
    from kapc.pipeline import parse_pipeline, run_pipeline

    ctx = CompileContext()
    for kind in KINDS:
        prior = adapters.adapt_file(kind, EXAMPLES / f"{kind}.json")
        module = module_from_prior(prior)
        out = run_pipeline(
            module,
            parse_pipeline("ground,align-spans,select{budget-ratio=0.5},resolve-pages,compact"),
            ctx,
        ).module
        kept = {k.id for k in out.keep if k.why == "evidence"}
        assert kept, kind


def test_bad_inputs_are_refused_with_a_reason(tmp_path):
    with pytest.raises(FrontendError, match="doc_scores"):
        adapters.from_hipporag({"question": "q", "docs": ["a", "b"], "doc_scores": [1.0]})
    with pytest.raises(FrontendError, match="no question"):
        adapters.from_passages([{"id": "a", "text": "x", "scores": {"s": 1}}])
    with pytest.raises(FrontendError, match="finite"):
        adapters.from_passages(
            {"question": "q", "passages": [{"id": "a", "text": "x", "scores": {"s": "nan"}}]}
        )
    with pytest.raises(FrontendError, match="source"):
        adapters.from_graphrag(
            {
                "query": "q",
                "context_data": {
                    "sources": [{"id": "1", "text": "t"}],
                    "relationships": [{"id": "0"}],
                },
            }
        )
    with pytest.raises(FrontendError, match="failed"):
        adapters.from_lightrag({"status": "failure", "message": "boom", "data": {}})
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(FrontendError, match="bad.json: not valid JSON"):
        adapters.adapt_file("passages", bad)


def test_odd_ids_are_made_safe():
    prior = adapters.from_passages(
        {
            "question": "q",
            "passages": [
                {"id": "doc 1/2", "text": "alpha", "scores": {"s": 1}},
                {"id": "9", "text": "beta", "scores": {"s": 2}},
                {"id": "9", "text": "gamma"},
            ],
        }
    )
    ids = [u.id for u in prior.units]
    assert len(set(ids)) == 3 and ids[0] == "doc_1_2"


runner = CliRunner()


@pytest.mark.parametrize("kind", KINDS)
def test_cli_from_commands(kind, tmp_path):
    out = tmp_path / "prior.json"
    res = runner.invoke(prior_app, [f"from-{kind}", str(EXAMPLES / f"{kind}.json"), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert load_prior(out).request.messages


def test_cli_question_override_and_errors(tmp_path):
    src = tmp_path / "p.json"
    src.write_text(json.dumps([{"id": "a", "title": "T", "text": "body", "scores": {"x": 1}}]))
    res = runner.invoke(prior_app, ["from-passages", str(src)])
    assert res.exit_code == 1 and "no question" in res.output
    res = runner.invoke(prior_app, ["from-passages", str(src), "--question", "Why?"])
    assert res.exit_code == 0
    assert decode_prior(res.stdout).request.messages[1].segments[-1].text == "Question: Why?"
    res = runner.invoke(prior_app, ["hotpotqa", "--index", "1", "--id", "x"])
    assert res.exit_code == 1 and "exactly one" in res.output


def test_cli_hotpotqa(tmp_path):
    out = tmp_path / "h.json"
    res = runner.invoke(
        prior_app,
        [
            "hotpotqa",
            "--index",
            "1",
            "--context-tokens",
            "1500",
            "--frontend",
            "bm25",
            "-o",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    prior = load_prior(out)
    assert prior.meta["context_tokens"] == 1500 and prior.meta["prompt_tokens"] <= 1500
    assert prior.frontend.name == "kapc-bm25"
    with pytest.raises(PriorError):
        decode_prior(b"{}")
