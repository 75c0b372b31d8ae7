"""The offline hybrid frontend on real HotpotQA prompts, with the real models."""

from __future__ import annotations

import numpy as np
import pytest

from kapc.frontend import graph, hybrid, retrieval
from kapc.prior import decode_prior, encode_prior

N = 2048


@pytest.fixture(scope="module")
def graph_priors():
    """Graph-frontend priors for two questions (the models load once, here)."""
    return {i: hybrid.hotpotqa_prior(i, N) for i in (0, 1)}


def _passage_units(prior):
    return [u for u in prior.units if u.kind == "passage"]


def test_graph_prior_carries_every_score(graph_priors):
    for prior in graph_priors.values():
        assert decode_prior(encode_prior(prior)) == prior
        units = _passage_units(prior)
        segs = [s for m in prior.request.messages for s in m.segments if s.kind == "passage"]
        assert [u.segment for u in units] == [s.id for s in segs]
        for u in units:
            assert set(u.scores) == {"sparse", "dense", "fusion", "ppr"}
        assert prior.frontend.name == "kapc-graph"
        assert prior.frontend.params["primary_score"] == "ppr"
        assert prior.frontend.params["graph"]["damping"] == 0.5
        assert prior.frontend.params["graph"]["passage_node_weight"] == \
            graph.DEFAULT.passage_node_weight
        assert prior.meta["dataset"] == "hotpotqa" and prior.meta["answer"]
        assert set(prior.meta["gold_passages"]) <= {u.segment for u in units}


def test_node_units_are_anchored_at_their_mentions():
    # kapc's default emits no node units (docs/frontend.md); HippoRAG 2's setting emits 100.
    prior = hybrid.hotpotqa_prior(1, N, graph_config=graph.HIPPORAG2)
    segs = {s.id: s for m in prior.request.messages for s in m.segments}
    nodes = [u for u in prior.units if u.kind == "node"]
    assert 10 <= len(nodes) <= hybrid.MAX_NODES
    ppr = [u.scores["ppr"] for u in nodes]
    assert ppr == sorted(ppr, reverse=True)
    for u in nodes:
        assert u.anchors and set(u.scores) == {"ppr", "dense", "seed"}
        for a in u.anchors:
            assert graph.normalize(segs[a.segment].text[a.start:a.end]) == graph.normalize(u.text)
    # The bridge entity of "who portrayed Corliss Archer in Kiss and Tell" is in the graph.
    names = {graph.normalize(u.text) for u in nodes}
    assert "shirley temple" in names and "corliss archer" in names


def test_graph_ranks_gold_above_most_negatives(graph_priors):
    for prior in graph_priors.values():
        units = _passage_units(prior)
        ppr = np.array([u.scores["ppr"] for u in units])
        ranks = retrieval.ranks(ppr)
        gold = [int(g[1:]) for g in prior.meta["gold_passages"]]
        assert min(ranks[g] for g in gold) < len(units) // 2


def test_deterministic(graph_priors):
    again = hybrid.hotpotqa_prior(0, N)
    assert encode_prior(again) == encode_prior(graph_priors[0])


@pytest.mark.parametrize("frontend,names", [("bm25", {"sparse"}), ("dense", {"dense"}),
                                            ("fusion", {"sparse", "dense", "fusion"})])
def test_other_frontends(graph_priors, frontend, names):
    prior = hybrid.hotpotqa_prior(0, N, frontend=frontend)
    assert prior.request == graph_priors[0].request
    assert all(set(u.scores) == names for u in prior.units)
    assert all(u.kind == "passage" for u in prior.units)
    assert prior.frontend.params["primary_score"] == hybrid.PRIMARY[frontend]
    ref = {u.id: u.scores for u in graph_priors[0].units}
    for u in prior.units:
        for k in names:
            assert u.scores[k] == pytest.approx(ref[u.id][k], rel=1e-5, abs=1e-6)


def test_squad_prior():
    prior = hybrid.squad_prior(0, 1024, frontend="bm25")
    assert prior.meta["dataset"] == "squad" and prior.meta["answers"] == ["France"]
    assert prior.meta["gold_passages"] == ["p0"]
    units = _passage_units(prior)
    # The negatives are BM25-hard by construction (here: other paragraphs of the same article),
    # so only the shape is checked.
    assert all(set(u.scores) == {"sparse"} for u in units)
    assert "France" in prior.request.messages[1].segments[0].text


def test_fusion_is_reciprocal_rank():
    s = np.array([3.0, 1.0, 2.0])
    d = np.array([0.1, 0.9, 0.5])
    f = retrieval.rrf(s, d, k=60)
    assert f[2] == pytest.approx(2 / 62)
    assert f[0] == pytest.approx(1 / 61 + 1 / 63)


def test_ppr_prefers_the_seed_neighbourhood():
    # 0 - 1 - 2 - 3, seeded at 0.
    edges = {(0, 1): 1.0, (1, 2): 1.0, (2, 3): 1.0}
    p = graph.personalized_pagerank(4, edges, np.array([1.0, 0, 0, 0]))
    assert p.sum() == pytest.approx(1.0)
    assert p[0] > p[1] > p[2] > p[3]


def test_unknown_frontend():
    with pytest.raises(hybrid.FrontendError, match="unknown frontend"):
        hybrid.score_passages("q", [], "nope")
