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
        assert (
            prior.frontend.params["graph"]["passage_node_weight"]
            == graph.DEFAULT.passage_node_weight
        )
        assert prior.meta["dataset"] == "hotpotqa" and prior.meta["answer"]
        assert set(prior.meta["gold_passages"]) <= {u.segment for u in units}


def test_default_emits_second_hop_nodes_with_provenance(graph_priors):
    # Question 1: "What government position was held by the woman who portrayed Corliss Archer
    # in the film Kiss and Tell?"; the bridge is Shirley Temple, whose page is gold.
    prior = graph_priors[1]
    segs = {s.id: s for m in prior.request.messages for s in m.segments}
    units = _passage_units(prior)
    nodes = [u for u in prior.units if u.kind == "node"]
    hops = prior.frontend.params["graph"]["hops"]
    assert nodes and [h["node"] for h in hops] == [u.id for u in nodes]
    assert prior.frontend.params["graph"]["node_mode"] == "hop"
    # the sources are the two passages with the best mean normalised score
    own = hybrid.own_scores({k: np.array([u.scores[k] for u in units]) for k in units[0].scores})
    top2 = {units[i].segment for i in np.argsort(-own, kind="stable")[:2]}
    q_keys = {graph.normalize(n) for n in prior.frontend.params["graph"]["question_entities"]}
    hop = [u.scores["hop"] for u in nodes]
    assert hop == sorted(hop, reverse=True)
    for u, h in zip(nodes, hops):
        assert set(u.scores) == {"hop"} and u.anchors
        assert h["from"] and set(h["from"]) <= top2
        assert u.scores["hop"] == pytest.approx(max(own[int(p[1:])] for p in h["from"]), abs=1e-6)
        assert graph.normalize(u.text) not in q_keys
        # anchored at its mentions, only in the passages it came from and the pages it leads to
        assert {a.segment for a in u.anchors} <= set(h["from"]) | set(h["to"])
        for a in u.anchors:
            assert graph.normalize(segs[a.segment].text[a.start : a.end]) == graph.normalize(u.text)
        for page in h["to"]:
            assert graph.normalize(graph.title_entity(segs[page].title)) == graph.normalize(u.text)
            assert page in {a.segment for a in u.anchors}
    bridge = next(h for u, h in zip(nodes, hops) if graph.normalize(u.text) == "shirley temple")
    gold = set(prior.meta["gold_passages"])
    assert set(bridge["to"]) & gold and set(bridge["from"]) & gold


def test_hop_nodes_lift_the_bridge_page_under_ground(graph_priors):
    # The compiler's ground mixes the best anchored node score in: the gold page the bridge
    # entity leads to gains on every passage no node is anchored in.
    import dataclasses

    from kapc.ingest import module_from_prior
    from kapc.passes import CompileContext
    from kapc.pipeline import parse_pipeline, run_pipeline

    prior = graph_priors[1]
    bare = hybrid.hotpotqa_prior(1, N, graph_config=dataclasses.replace(graph.DEFAULT, max_nodes=0))
    assert not [u for u in bare.units if u.kind == "node"]

    def priors(p):
        out = run_pipeline(
            module_from_prior(p), parse_pipeline("ground"), CompileContext(), verify=False
        ).module
        return {e.id: e.prior for e in out.evidence}

    with_nodes, without = priors(prior), priors(bare)
    anchored = {a.segment for u in prior.units if u.kind == "node" for a in u.anchors}
    page = next(
        h["to"][0]
        for h in prior.frontend.params["graph"]["hops"]
        if h["to"] and h["to"][0] in prior.meta["gold_passages"]
    )
    rank = lambda ps, pid: sorted(ps, key=lambda k: -ps[k]).index(pid)  # noqa: E731
    assert rank(with_nodes, page) < rank(without, page)
    for pid in with_nodes:
        if pid not in anchored:
            assert with_nodes[pid] == pytest.approx(without[pid] / 2, abs=1e-5)


def test_node_units_are_anchored_at_their_mentions():
    # HippoRAG 2's setting emits the 100 entities with the highest PPR.
    prior = hybrid.hotpotqa_prior(1, N, graph_config=graph.HIPPORAG2)
    segs = {s.id: s for m in prior.request.messages for s in m.segments}
    nodes = [u for u in prior.units if u.kind == "node"]
    assert 10 <= len(nodes) <= hybrid.MAX_NODES
    ppr = [u.scores["ppr"] for u in nodes]
    assert ppr == sorted(ppr, reverse=True)
    for u in nodes:
        assert u.anchors and set(u.scores) == {"ppr", "dense", "seed"}
        for a in u.anchors:
            assert graph.normalize(segs[a.segment].text[a.start : a.end]) == graph.normalize(u.text)
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


@pytest.mark.parametrize(
    "frontend,names",
    [("bm25", {"sparse"}), ("dense", {"dense"}), ("fusion", {"sparse", "dense", "fusion"})],
)
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
