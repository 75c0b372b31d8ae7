"""The offline hybrid frontend: sparse + dense + fusion + entity-graph PPR, emitted as a Prior.

`score_request` works on any chat request whose passages are `passage` segments and whose
question is a `question` segment; `hotpotqa_prior` and `squad_prior` build the long-context
request first (kapc.frontend.longctx) and then score it.

Frontends (`frontend=`), each emitting every score it computed on every passage unit:

* `bm25`: `sparse`;
* `dense`: `dense`;
* `fusion`: `sparse`, `dense`, and their reciprocal-rank fusion `fusion`;
* `graph` (default): all of the above plus `ppr` from Personalized PageRank over the entity graph
  (kapc.frontend.graph), and `node` units for the entities with the highest PPR, anchored at
  their mentions in the passages.

`Frontend.params.primary_score` names the score the frontend itself would rank passages by.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from kapc import __version__
from kapc.frontend import graph as graph_mod
from kapc.frontend import retrieval
from kapc.frontend.errors import FrontendError
from kapc.prior import Anchor, Frontend, Prior, Request, Segment, Unit, decode_prior, encode_prior

FRONTENDS = ("graph", "fusion", "dense", "bm25")
PRIMARY = {"graph": "ppr", "fusion": "fusion", "dense": "dense", "bm25": "sparse"}
MAX_NODES = 100
MAX_ANCHORS = 32


@dataclass
class Scored:
    """Per-passage scores (name -> array over the passages in prompt order) and the graph run."""

    scores: dict[str, np.ndarray]
    graph: graph_mod.GraphResult | None


def request_parts(request: Request) -> tuple[list[Segment], str]:
    """The passage segments (prompt order) and the question text of a request."""
    if request.messages is not None:
        segs = [s for m in request.messages for s in m.segments]
    else:
        segs = list(request.raw or [])
    passages = [s for s in segs if s.kind == "passage"]
    questions = [s for s in segs if s.kind == "question"]
    if not questions:
        raise FrontendError("the request has no `question` segment to retrieve for")
    question = questions[-1].text.strip()
    question = re.sub(r"^question:\s*", "", question, flags=re.IGNORECASE)
    return passages, question


def score_passages(question: str, passages: list[Segment], frontend: str = "graph") -> Scored:
    if frontend not in FRONTENDS:
        raise FrontendError(f"unknown frontend {frontend!r}; choose one of {', '.join(FRONTENDS)}")
    texts = [s.text.strip() for s in passages]
    scores: dict[str, np.ndarray] = {}
    if frontend in ("bm25", "fusion", "graph"):
        scores["sparse"] = retrieval.sparse_scores(question, texts)
    if frontend in ("dense", "fusion", "graph"):
        scores["dense"] = retrieval.dense_scores(question, texts)
    if frontend in ("fusion", "graph"):
        scores["fusion"] = retrieval.rrf(scores["sparse"], scores["dense"])
    g = None
    if frontend == "graph":
        g = graph_mod.run_graph(question, [s.text for s in passages], [s.title for s in passages],
                                scores["dense"])
        scores["ppr"] = g.passage_ppr
    return Scored(scores=scores, graph=g)


def _slug(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9]+", "_", graph_mod.normalize(name)).strip("_")[:60]
    return s or "x"


def _units(passages: list[Segment], scored: Scored, max_nodes: int) -> list[Unit]:
    units = [Unit(id=seg.id, kind="passage", segment=seg.id, text=seg.title or "",
                  scores={k: round(float(v[i]), 8) for k, v in scored.scores.items()})
             for i, seg in enumerate(passages)]
    g = scored.graph
    if g is None or not g.entities:
        return units
    order = np.lexsort((np.arange(len(g.entities)), -g.entity_ppr))[:max_nodes]
    used: set[str] = set()
    for j in order.tolist():
        ent = g.entities[j]
        uid = "ent:" + _slug(ent.name)
        k = 2
        while uid in used:
            uid, k = f"ent:{_slug(ent.name)}.{k}", k + 1
        used.add(uid)
        anchors = [Anchor(segment=passages[p].id, start=a, end=b)
                   for p, a, b in ent.mentions[:MAX_ANCHORS]]
        units.append(Unit(id=uid, kind="node", text=ent.name, anchors=anchors, scores={
            "ppr": round(float(g.entity_ppr[j]), 8),
            "dense": round(float(g.entity_dense[j]), 8),
            "seed": round(float(g.entity_seed[j]), 8)}))
    return units


def score_request(request: Request, name: str, frontend: str = "graph", *,
                  meta: dict | None = None, max_nodes: int = MAX_NODES) -> Prior:
    """Score the passages of `request` against its question and emit a validated Prior."""
    passages, question = request_parts(request)
    if not passages:
        raise FrontendError("the request has no passage segments to score")
    scored = score_passages(question, passages, frontend)
    params: dict = {"frontend": frontend, "primary_score": PRIMARY[frontend]}
    if "sparse" in scored.scores:
        params["sparse"] = {"method": "bm25s lucene", "k1": 1.5, "b": 0.75, "stopwords": "en"}
    if "dense" in scored.scores:
        params["dense"] = {"model": retrieval.DENSE_MODEL, "similarity": "cosine"}
    if "fusion" in scored.scores:
        params["fusion"] = {"method": "rrf", "k": retrieval.RRF_K, "of": ["sparse", "dense"]}
    if scored.graph is not None:
        params["graph"] = {
            "ner": "spacy en_core_web_sm", "damping": graph_mod.DAMPING,
            "passage_node_weight": graph_mod.PASSAGE_NODE_WEIGHT,
            "synonym_threshold": graph_mod.SYNONYM_THRESHOLD, "link_top_k": graph_mod.LINK_TOP_K,
            "entities": len(scored.graph.entities), "edges": scored.graph.edges,
            "question_entities": scored.graph.question_entities, "max_nodes": max_nodes}
    prior = Prior(name=name, request=request, units=_units(passages, scored, max_nodes),
                  frontend=Frontend(name=f"kapc-{frontend}", version=__version__, params=params),
                  meta=meta or {})
    return validated(prior)


def validated(prior: Prior) -> Prior:
    """Round-trip a prior through its JSON form; raises PriorError if it is not valid."""
    return decode_prior(encode_prior(prior, indent=0), source=f"<prior {prior.name}>")


def hotpotqa_prior(index: int | None = None, context_tokens: int = 4096, *, qid: str | None = None,
                   frontend: str = "graph", seed: int | None = 0, model: str | None = None,
                   max_nodes: int = MAX_NODES) -> Prior:
    """The prior for HotpotQA dev question `index` (or `qid`) at `context_tokens` tokens."""
    from kapc.frontend.longctx import build_hotpotqa
    lc = build_hotpotqa(index, context_tokens, qid=qid, seed=seed, model=model)
    return score_request(lc.request, f"hotpotqa-{lc.question_id}-{context_tokens}", frontend,
                         meta=lc.meta(), max_nodes=max_nodes)


def squad_prior(index: int | None = None, context_tokens: int = 4096, *, qid: str | None = None,
                frontend: str = "graph", seed: int | None = 0, model: str | None = None,
                max_nodes: int = MAX_NODES) -> Prior:
    """The prior for SQuAD 2.0 dev question `index` (or `qid`) at `context_tokens` tokens."""
    from kapc.frontend.longctx import build_squad
    lc = build_squad(index, context_tokens, qid=qid, seed=seed, model=model)
    return score_request(lc.request, f"squad-{lc.question_id}-{context_tokens}", frontend,
                         meta=lc.meta(), max_nodes=max_nodes)
