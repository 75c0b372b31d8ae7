"""The offline hybrid frontend: sparse + dense + fusion + entity-graph PPR, emitted as a Prior.

`score_request` works on any chat request whose passages are `passage` segments and whose
question is a `question` segment; `hotpotqa_prior` and `squad_prior` build the long-context
request first (kapc.frontend.longctx) and then score it.

Frontends (`frontend=`), each emitting every score it computed on every passage unit:

* `bm25`: `sparse`;
* `dense`: `dense`;
* `fusion`: `sparse`, `dense`, and their reciprocal-rank fusion `fusion`;
* `graph` (default): all of the above plus `ppr` from Personalized PageRank over the entity graph
  (kapc.frontend.graph), and `node` units anchored at their mentions in the passages: with
  kapc's `graph.DEFAULT`, second-hop nodes (the entities of the two best passages, scored `hop`,
  anchored there and in the page each leads to; provenance in `frontend.params.graph.hops`);
  with `graph.HIPPORAG2`, the 100 entities with the highest PPR.

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


def score_passages(
    question: str,
    passages: list[Segment],
    frontend: str = "graph",
    graph_config: graph_mod.GraphConfig | None = None,
) -> Scored:
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
        g = run_graph(question, passages, scores["dense"], graph_config)
        scores["ppr"] = g.passage_ppr
    return Scored(scores=scores, graph=g)


def run_graph(
    question: str,
    passages: list[Segment],
    dense: np.ndarray,
    graph_config: graph_mod.GraphConfig | None = None,
) -> graph_mod.GraphResult:
    return graph_mod.run_graph(
        question, [s.text for s in passages], [s.title for s in passages], dense, graph_config
    )


def with_graph(
    question: str,
    passages: list[Segment],
    scored: Scored,
    graph_config: graph_mod.GraphConfig | None,
) -> Scored:
    """The same sparse/dense/fusion scores with the graph run again under `graph_config` (what the
    recall benchmark uses to compare graph settings without scoring twice)."""
    scores = {k: v for k, v in scored.scores.items() if k != "ppr"}
    g = run_graph(question, passages, scores["dense"], graph_config)
    scores["ppr"] = g.passage_ppr
    return Scored(scores=scores, graph=g)


def _slug(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9]+", "_", graph_mod.normalize(name)).strip("_")[:60]
    return s or "x"


def own_scores(scores: dict[str, np.ndarray]) -> np.ndarray:
    """Each passage's mean min-max normalised score (a constant score counts 1), the same
    "own part" the compiler's `ground` computes from the passage units."""
    parts = []
    for v in scores.values():
        v = np.round(np.asarray(v, dtype=np.float64), 8)
        lo, hi = float(v.min()), float(v.max())
        parts.append((v - lo) / (hi - lo) if hi > lo else np.ones_like(v))
    return np.mean(parts, axis=0)


def _units(
    passages: list[Segment], scored: Scored, max_nodes: int, cfg: graph_mod.GraphConfig
) -> tuple[list[Unit], list[dict]]:
    """The passage units, then the node units (`cfg.node_mode`); with hop nodes also their
    provenance (node id, the passages it was reached from, the pages it leads to)."""
    units = [
        Unit(
            id=seg.id,
            kind="passage",
            segment=seg.id,
            text=seg.title or "",
            scores={k: round(float(v[i]), 8) for k, v in scored.scores.items()},
        )
        for i, seg in enumerate(passages)
    ]
    g = scored.graph
    if g is None or not g.entities or max_nodes <= 0:
        return units, []
    used: set[str] = set()

    def uid_for(name: str) -> str:
        uid, k = "ent:" + _slug(name), 2
        while uid in used:
            uid, k = f"ent:{_slug(name)}.{k}", k + 1
        used.add(uid)
        return uid

    def anchors(mentions) -> list[Anchor]:
        return [
            Anchor(segment=passages[p].id, start=a, end=b) for p, a, b in mentions[:MAX_ANCHORS]
        ]

    hops: list[dict] = []
    if cfg.node_mode == "hop":
        own = own_scores(scored.scores)
        for h in graph_mod.hop_nodes(
            g, [s.title for s in passages], own, cfg.hop_sources, MAX_ANCHORS
        )[:max_nodes]:
            ent = g.entities[h.index]
            uid = uid_for(ent.name)
            values = {
                "hop": h.score,
                "ppr": g.entity_ppr[h.index],
                "dense": g.entity_dense[h.index],
                "seed": g.entity_seed[h.index],
            }
            units.append(
                Unit(
                    id=uid,
                    kind="node",
                    text=ent.name,
                    anchors=anchors(h.mentions),
                    scores={k: round(float(values[k]), 8) for k in cfg.node_scores},
                )
            )
            hops.append(
                {
                    "node": uid,
                    "from": [passages[p].id for p in h.sources],
                    "to": [passages[p].id for p in h.pages],
                }
            )
        return units, hops
    order = np.lexsort((np.arange(len(g.entities)), -g.entity_ppr))[:max_nodes]
    for j in order.tolist():
        ent = g.entities[j]
        values = {"ppr": g.entity_ppr[j], "dense": g.entity_dense[j], "seed": g.entity_seed[j]}
        units.append(
            Unit(
                id=uid_for(ent.name),
                kind="node",
                text=ent.name,
                anchors=anchors(ent.mentions),
                scores={k: round(float(values[k]), 8) for k in cfg.node_scores},
            )
        )
    return units, hops


def score_request(
    request: Request,
    name: str,
    frontend: str = "graph",
    *,
    meta: dict | None = None,
    max_nodes: int | None = None,
    graph_config: graph_mod.GraphConfig | None = None,
) -> Prior:
    """Score the passages of `request` against its question and emit a validated Prior.
    `graph_config` (default `graph.DEFAULT`) sets the graph frontend; `max_nodes` overrides its
    number of node units."""
    passages, question = request_parts(request)
    if not passages:
        raise FrontendError("the request has no passage segments to score")
    scored = score_passages(question, passages, frontend, graph_config)
    return prior_from_scored(
        request,
        name,
        frontend,
        passages,
        scored,
        meta=meta,
        max_nodes=max_nodes,
        graph_config=graph_config,
    )


def prior_from_scored(
    request: Request,
    name: str,
    frontend: str,
    passages: list[Segment],
    scored: Scored,
    *,
    meta: dict | None = None,
    max_nodes: int | None = None,
    graph_config: graph_mod.GraphConfig | None = None,
) -> Prior:
    """The validated Prior for scores already computed (`score_passages`, `with_graph`)."""
    cfg = graph_config or graph_mod.DEFAULT
    max_nodes = cfg.max_nodes if max_nodes is None else max_nodes
    params: dict = {"frontend": frontend, "primary_score": PRIMARY[frontend]}
    if "sparse" in scored.scores:
        params["sparse"] = {"method": "bm25s lucene", "k1": 1.5, "b": 0.75, "stopwords": "en"}
    if "dense" in scored.scores:
        params["dense"] = {"model": retrieval.DENSE_MODEL, "similarity": "cosine"}
    if "fusion" in scored.scores:
        params["fusion"] = {"method": "rrf", "k": retrieval.RRF_K, "of": ["sparse", "dense"]}
    if scored.graph is not None:
        params["graph"] = {
            "ner": "spacy en_core_web_sm",
            **cfg.params(),
            "max_nodes": max_nodes,
            "preset": next((k for k, v in graph_mod.CONFIGS.items() if v == cfg), "custom"),
            "entities": len(scored.graph.entities),
            "edges": scored.graph.edges,
            "question_entities": scored.graph.question_entities,
        }
    units, hops = _units(passages, scored, max_nodes, cfg)
    if hops:
        params["graph"]["hops"] = hops
    prior = Prior(
        name=name,
        request=request,
        units=units,
        frontend=Frontend(name=f"kapc-{frontend}", version=__version__, params=params),
        meta=meta or {},
    )
    return validated(prior)


def validated(prior: Prior) -> Prior:
    """Round-trip a prior through its JSON form; raises PriorError if it is not valid."""
    return decode_prior(encode_prior(prior, indent=0), source=f"<prior {prior.name}>")


def hotpotqa_prior(
    index: int | None = None,
    context_tokens: int = 4096,
    *,
    qid: str | None = None,
    frontend: str = "graph",
    seed: int | None = 0,
    model: str | None = None,
    max_nodes: int | None = None,
    graph_config: graph_mod.GraphConfig | None = None,
) -> Prior:
    """The prior for HotpotQA dev question `index` (or `qid`) at `context_tokens` tokens."""
    from kapc.frontend.longctx import build_hotpotqa

    lc = build_hotpotqa(index, context_tokens, qid=qid, seed=seed, model=model)
    return score_request(
        lc.request,
        f"hotpotqa-{lc.question_id}-{context_tokens}",
        frontend,
        meta=lc.meta(),
        max_nodes=max_nodes,
        graph_config=graph_config,
    )


def hotpotqa_shared_priors(
    indices,
    context_tokens: int = 16384,
    *,
    frontend: str = "graph",
    seed: int | None = 0,
    model: str | None = None,
) -> list[Prior]:
    """One prior per HotpotQA dev question of `indices`, all reading one shared long document
    (`longctx.build_hotpotqa_shared`): a batch of them prefills the document once."""
    from kapc.frontend.longctx import build_hotpotqa_shared

    docs = build_hotpotqa_shared(list(indices), context_tokens, seed=seed, model=model)
    return [
        score_request(
            lc.request,
            f"hotpotqa-shared-{lc.question_id}-{context_tokens}",
            frontend,
            meta=lc.meta(),
        )
        for lc in docs
    ]


def squad_prior(
    index: int | None = None,
    context_tokens: int = 4096,
    *,
    qid: str | None = None,
    frontend: str = "graph",
    seed: int | None = 0,
    model: str | None = None,
    max_nodes: int | None = None,
    graph_config: graph_mod.GraphConfig | None = None,
) -> Prior:
    """The prior for SQuAD 2.0 dev question `index` (or `qid`) at `context_tokens` tokens."""
    from kapc.frontend.longctx import build_squad

    lc = build_squad(index, context_tokens, qid=qid, seed=seed, model=model)
    return score_request(
        lc.request,
        f"squad-{lc.question_id}-{context_tokens}",
        frontend,
        meta=lc.meta(),
        max_nodes=max_nodes,
        graph_config=graph_config,
    )
