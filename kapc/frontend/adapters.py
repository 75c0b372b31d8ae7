"""Adapters: other frontends' retrieval outputs as kapc priors.

Each adapter reads the JSON its frontend produces (or the Python objects, already parsed) and
returns a validated `Prior` whose request is kapc's usual chat prompt (instruction, then the
retrieved passages in the order the frontend ranked them, then the question):

* `from_hipporag`: HippoRAG 2's `retrieve()` result, a `QuerySolution` as `to_dict()` writes it
  (`question`, `docs`, `doc_scores` from PPR, optionally `answer`, `gold_answers`, `gold_docs`),
  or a list of them (pick one with `index`). A doc whose first line is followed by more text is
  read as `title\\ntext`, the way HippoRAG's own corpora are built.
* `from_graphrag`: Microsoft GraphRAG's local-search context, the `context_data` tables as
  records (what `graphrag.utils.api.reformat_context_data` returns: `entities`,
  `relationships`, `sources` (the text units), `reports`, `claims`), wrapped as
  `{"query": ..., "context_data": {...}}` or given bare with `question=`.
* `from_lightrag`: LightRAG's query data (`aquery_data` / `POST /query/data`): `data.entities`,
  `data.relationships`, `data.chunks`, `data.references`, `metadata`; the question comes from a
  top-level `query` field, `metadata.query`, or `question=`.
* `from_passages`: a plain list of scored passages `[{"id", "title", "text", "scores"}]`,
  wrapped as `{"question": ..., "passages": [...]}` or given bare with `question=`.

Passages become `passage` segments and `passage` units with the frontend's scores; graph items
(entities, relationships) become `node` and `triple` units anchored at the character spans where
their names occur in the passage segments (LightRAG's `source_id` chunk lists narrow where to
look). An item that occurs in no passage cannot be anchored and is listed in
`meta.unanchored` instead. Frontends that give an order but no score (GraphRAG) get a `rank`
score of 1 / (1 + position).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kapc import __version__
from kapc.frontend.errors import FrontendError
from kapc.frontend.hybrid import validated
from kapc.frontend.prompt import DEFAULT_INSTRUCTION, chat_request, passage_text
from kapc.prior import Anchor, Frontend, Prior, PriorError, Segment, Unit

_ID = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]*$")
MAX_ANCHORS = 32


@dataclass
class _Passage:
    source_id: str
    title: str | None
    body: str
    scores: dict[str, float] = field(default_factory=dict)


@dataclass
class _Item:
    """A graph item to anchor: `names` are looked up in the passages (all of them for a triple's
    two ends), optionally only in `where` (source ids of passages)."""

    kind: str  # node | triple
    source_id: str
    text: str
    names: list[str]
    scores: dict[str, float]
    where: list[str] | None = None


def _num(value: Any, what: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise FrontendError(f"{what}: expected a number, got {value!r}") from None
    if x != x or x in (float("inf"), float("-inf")):
        raise FrontendError(f"{what}: expected a finite number, got {value!r}")
    return x


def _safe_id(raw: str, prefix: str, i: int, used: set[str]) -> str:
    cand = str(raw) if raw is not None else ""
    if not _ID.match(cand) or len(cand) > 200:
        slug = re.sub(r"[^A-Za-z0-9_.:-]+", "_", cand).strip("_")[:80]
        if slug and _ID.match(slug):
            cand = slug
        elif slug and _ID.match(prefix + slug):
            cand = prefix + slug
        else:
            cand = f"{prefix}{i}"
    base, k = cand, 2
    while cand in used:
        cand, k = f"{base}.{k}", k + 1
    used.add(cand)
    return cand


def _find_spans(text: str, name: str) -> list[tuple[int, int]]:
    name = name.strip().strip('"').strip()
    if len(name) < 2:
        return []
    pat = re.compile(r"(?<!\w)" + re.escape(name) + r"(?!\w)", re.IGNORECASE)
    return [(m.start(), m.end()) for m in pat.finditer(text)]


def _build(
    question: str,
    passages: list[_Passage],
    items: list[_Item],
    *,
    name: str,
    frontend: str,
    params: dict,
    meta: dict,
    instruction: str,
) -> Prior:
    if not question or not question.strip():
        raise FrontendError("no question: the input names none; pass one explicitly")
    if not passages:
        raise FrontendError("the input holds no passages to put in the prompt")
    used: set[str] = set()
    segs: list[Segment] = []
    by_source: dict[str, Segment] = {}
    units: list[Unit] = []
    unit_ids: set[str] = set()
    for i, p in enumerate(passages):
        sid = _safe_id(p.source_id, "p", i, used)
        text = passage_text(p.title, p.body.strip()) if p.title else f"{p.body.strip()}\n\n"
        seg = Segment(text=text, kind="passage", id=sid, title=p.title)
        segs.append(seg)
        by_source.setdefault(str(p.source_id), seg)
        units.append(
            Unit(
                id=_safe_id(sid, "p", i, unit_ids),
                kind="passage",
                segment=sid,
                text=p.title or "",
                scores=dict(p.scores),
            )
        )
    seg_pos = {s.id: k for k, s in enumerate(segs)}
    unanchored: list[str] = []
    for j, item in enumerate(items):
        pool = segs
        if item.where:
            pool = [by_source[w] for w in item.where if w in by_source] or segs
        anchors: list[Anchor] = []
        if item.kind == "triple":
            # Prefer passages that mention both ends; else any that mentions either.
            both = [s for s in pool if all(_find_spans(s.text, n) for n in item.names)]
            pool = both or pool
        for seg in pool:
            for n in item.names:
                for a, b in _find_spans(seg.text, n):
                    anchors.append(Anchor(segment=seg.id, start=a, end=b))
        anchors = sorted(set(anchors), key=lambda x: (seg_pos[x.segment], x.start, x.end))[
            :MAX_ANCHORS
        ]
        if not anchors:
            unanchored.append(item.text)
            continue
        prefix = "ent:" if item.kind == "node" else "rel:"
        uid = _safe_id(f"{prefix}{item.source_id}", prefix, j, unit_ids)
        units.append(
            Unit(id=uid, kind=item.kind, text=item.text, anchors=anchors, scores=item.scores)
        )
    if unanchored:
        meta = {**meta, "unanchored": unanchored}
    prior = Prior(
        name=name,
        request=chat_request(segs, question.strip(), instruction),
        units=units,
        frontend=Frontend(name=frontend, version=__version__, params=params),
        meta=meta,
    )
    try:
        return validated(prior)
    except PriorError as exc:
        raise FrontendError(f"the {frontend} input does not make a valid prior: {exc}") from None


def _rank_score(i: int) -> float:
    return round(1.0 / (1 + i), 8)


# ---------------------------------------------------------------------------------------------
# HippoRAG 2


def _split_title(doc: str) -> tuple[str | None, str]:
    head, sep, rest = doc.strip().partition("\n")
    if sep and rest.strip() and len(head) <= 200:
        return head.strip(), rest.strip()
    return None, doc.strip()


def from_hipporag(
    obj: Any, *, question: str | None = None, index: int = 0, instruction: str = DEFAULT_INSTRUCTION
) -> Prior:
    """HippoRAG 2's retrieval result (a QuerySolution dict, or a list of them) as a Prior."""
    if isinstance(obj, list):
        if not obj:
            raise FrontendError("HippoRAG input: the list of query solutions is empty")
        if not 0 <= index < len(obj):
            raise FrontendError(
                f"HippoRAG input: index {index} is out of range (0..{len(obj) - 1})"
            )
        obj = obj[index]
    if not isinstance(obj, dict):
        raise FrontendError(
            "HippoRAG input: expected a QuerySolution object ({question, docs, doc_scores, ...})"
        )
    docs = obj.get("docs")
    if not isinstance(docs, list) or not all(isinstance(d, str) for d in docs):
        raise FrontendError("HippoRAG input: `docs` must be a list of passage strings")
    scores = obj.get("doc_scores")
    if scores is None:
        scores = [None] * len(docs)
    if not isinstance(scores, list) or len(scores) != len(docs):
        raise FrontendError(
            f"HippoRAG input: `doc_scores` must be a list as long as `docs` ({len(docs)})"
        )
    passages = []
    for i, (doc, s) in enumerate(zip(docs, scores)):
        title, body = _split_title(doc)
        sc = {"rank": _rank_score(i)}
        if s is not None:
            sc["ppr"] = _num(s, f"HippoRAG input: doc_scores[{i}]")
        passages.append(_Passage(source_id=f"p{i}", title=title, body=body, scores=sc))
    q = question or obj.get("question") or ""
    meta = {"source": "hipporag"}
    for k in ("answer", "gold_answers", "gold_docs"):
        if obj.get(k) is not None:
            meta[k] = obj[k]
    return _build(
        q,
        passages,
        [],
        name="hipporag",
        frontend="hipporag",
        params={"score": "ppr", "primary_score": "ppr"},
        meta=meta,
        instruction=instruction,
    )


# ---------------------------------------------------------------------------------------------
# Microsoft GraphRAG (local search)


def _records(value: Any, what: str) -> list[dict]:
    if value is None:
        return []
    if isinstance(value, dict) and all(isinstance(v, list) for v in value.values()) and value:
        # A DataFrame written with to_dict(orient="list"): columns of equal length.
        cols = list(value)
        n = len(value[cols[0]])
        return [{c: value[c][i] for c in cols} for i in range(n)]
    if not isinstance(value, list) or not all(isinstance(r, dict) for r in value):
        raise FrontendError(f"GraphRAG input: `{what}` must be a list of records")
    return value


def from_graphrag(
    obj: Any, *, question: str | None = None, instruction: str = DEFAULT_INSTRUCTION
) -> Prior:
    """GraphRAG local-search context data as a Prior: text units (`sources`) are the passages,
    in the order the context builder ranked them; entities become node units and relationships
    triple units."""
    if not isinstance(obj, dict):
        raise FrontendError(
            "GraphRAG input: expected an object with `context_data` (or the context data itself)"
        )
    ctx = obj.get("context_data", obj)
    if not isinstance(ctx, dict):
        raise FrontendError("GraphRAG input: `context_data` must be an object of tables")
    q = question or obj.get("query") or obj.get("question") or ""
    sources = _records(ctx.get("sources"), "sources")
    entities = _records(ctx.get("entities"), "entities")
    relationships = _records(ctx.get("relationships"), "relationships")
    passages = []
    for i, r in enumerate(sources):
        if "text" not in r:
            raise FrontendError(f"GraphRAG input: sources[{i}] has no `text`")
        passages.append(
            _Passage(
                source_id=f"tu:{r.get('id', i)}",
                title=r.get("title"),
                body=str(r["text"]),
                scores={"rank": _rank_score(i)},
            )
        )
    items = []
    for i, r in enumerate(entities):
        name = r.get("entity") or r.get("title") or r.get("name")
        if not name:
            raise FrontendError(f"GraphRAG input: entities[{i}] has no `entity` name")
        sc = {"rank": _rank_score(i)}
        if r.get("number of relationships") is not None:
            sc["degree"] = _num(
                r["number of relationships"],
                f"GraphRAG input: entities[{i}].number of relationships",
            )
        items.append(
            _Item(
                kind="node",
                source_id=str(r.get("id", i)),
                text=str(name),
                names=[str(name)],
                scores=sc,
            )
        )
    for i, r in enumerate(relationships):
        src, tgt = r.get("source"), r.get("target")
        if not src or not tgt:
            raise FrontendError(f"GraphRAG input: relationships[{i}] needs `source` and `target`")
        sc = {"rank": _rank_score(i)}
        for k in ("weight", "links"):
            if r.get(k) is not None:
                sc[k] = _num(r[k], f"GraphRAG input: relationships[{i}].{k}")
        desc = r.get("description") or ""
        items.append(
            _Item(
                kind="triple",
                source_id=str(r.get("id", i)),
                text=f"{src} -> {tgt}: {desc}".strip().rstrip(":"),
                names=[str(src), str(tgt)],
                scores=sc,
            )
        )
    meta = {
        "source": "graphrag",
        "reports": len(_records(ctx.get("reports"), "reports")),
        "claims": len(_records(ctx.get("claims"), "claims")),
    }
    for k in ("answer", "gold_answers", "gold_titles"):
        if obj.get(k) is not None:
            meta[k] = obj[k]
    return _build(
        q,
        passages,
        items,
        name="graphrag-local",
        frontend="graphrag-local",
        params={"search": "local", "primary_score": "rank"},
        meta=meta,
        instruction=instruction,
    )


# ---------------------------------------------------------------------------------------------
# LightRAG


def from_lightrag(
    obj: Any, *, question: str | None = None, instruction: str = DEFAULT_INSTRUCTION
) -> Prior:
    """LightRAG's structured query data as a Prior: chunks are the passages (in LightRAG's
    order), entities node units and relationships triple units, searched for in the chunks their
    `source_id` names."""
    if not isinstance(obj, dict):
        raise FrontendError(
            "LightRAG input: expected the query-data object "
            "({status, data: {entities, relationships, chunks}, metadata})"
        )
    if obj.get("status") not in (None, "success"):
        raise FrontendError(
            f"LightRAG input: the query failed ({obj.get('status')}: {obj.get('message', '')})"
        )
    data = obj.get("data", obj)
    if not isinstance(data, dict):
        raise FrontendError("LightRAG input: `data` must be an object")
    meta_in = obj.get("metadata") or {}
    q = question or obj.get("query") or meta_in.get("query") or ""
    chunks = data.get("chunks") or []
    refs = {
        str(r.get("reference_id")): r.get("file_path")
        for r in data.get("references") or []
        if isinstance(r, dict)
    }
    if not isinstance(chunks, list):
        raise FrontendError("LightRAG input: `data.chunks` must be a list")
    passages = []
    for i, c in enumerate(chunks):
        if not isinstance(c, dict) or "content" not in c:
            raise FrontendError(f"LightRAG input: data.chunks[{i}] has no `content`")
        title = c.get("title")
        if title is None:
            fp = c.get("file_path") or refs.get(str(c.get("reference_id")))
            title = Path(fp).stem if fp and fp not in ("unknown_source",) else None
        passages.append(
            _Passage(
                source_id=str(c.get("chunk_id") or f"chunk{i}"),
                title=title,
                body=str(c["content"]),
                scores={"rank": _rank_score(i)},
            )
        )

    def where(rec: dict) -> list[str] | None:
        sid = rec.get("source_id")
        return [s for s in str(sid).split("<SEP>") if s] if sid else None

    items = []
    for i, e in enumerate(data.get("entities") or []):
        name = e.get("entity_name") or e.get("entity")
        if not name:
            raise FrontendError(f"LightRAG input: data.entities[{i}] has no `entity_name`")
        items.append(
            _Item(
                kind="node",
                source_id=str(name),
                text=str(name),
                names=[str(name)],
                scores={"rank": _rank_score(i)},
                where=where(e),
            )
        )
    for i, r in enumerate(data.get("relationships") or []):
        src, tgt = r.get("src_id"), r.get("tgt_id")
        if not src or not tgt:
            raise FrontendError(
                f"LightRAG input: data.relationships[{i}] needs `src_id` and `tgt_id`"
            )
        sc = {"rank": _rank_score(i)}
        if r.get("weight") is not None:
            sc["weight"] = _num(r["weight"], f"LightRAG input: data.relationships[{i}].weight")
        desc = r.get("description") or ""
        items.append(
            _Item(
                kind="triple",
                source_id=f"{src}--{tgt}",
                text=f"{src} -> {tgt}: {desc}".strip().rstrip(":"),
                names=[str(src), str(tgt)],
                scores=sc,
                where=where(r),
            )
        )
    meta = {"source": "lightrag"}
    if meta_in.get("query_mode"):
        meta["query_mode"] = meta_in["query_mode"]
    if meta_in.get("keywords"):
        meta["keywords"] = meta_in["keywords"]
    for k in ("answer", "gold_answers", "gold_titles"):
        if obj.get(k) is not None:
            meta[k] = obj[k]
    return _build(
        q,
        passages,
        items,
        name="lightrag",
        frontend="lightrag",
        params={"mode": meta_in.get("query_mode", ""), "primary_score": "rank"},
        meta=meta,
        instruction=instruction,
    )


# ---------------------------------------------------------------------------------------------
# Plain scored passages


def from_passages(
    obj: Any, *, question: str | None = None, instruction: str = DEFAULT_INSTRUCTION
) -> Prior:
    """`{"question": ..., "passages": [{"id", "title", "text", "scores"}]}` (or the bare list)."""
    meta: dict = {"source": "passages"}
    if isinstance(obj, dict):
        q = question or obj.get("question") or ""
        items = obj.get("passages")
        for k, v in obj.items():
            if k not in ("question", "passages"):
                meta[k] = v
    else:
        q, items = question or "", obj
    if not isinstance(items, list):
        raise FrontendError(
            "passages input: expected a list of passages [{id, title, text, scores}]"
        )
    passages = []
    names: set[str] = set()
    for i, p in enumerate(items):
        if not isinstance(p, dict) or not isinstance(p.get("text"), str):
            raise FrontendError(f"passages input: passages[{i}] needs a `text` string")
        scores = p.get("scores") or {}
        if not isinstance(scores, dict):
            raise FrontendError(f"passages input: passages[{i}].scores must be an object")
        sc = {
            str(k): _num(v, f"passages input: passages[{i}].scores.{k}") for k, v in scores.items()
        }
        names.update(sc)
        passages.append(
            _Passage(
                source_id=str(p.get("id", f"p{i}")), title=p.get("title"), body=p["text"], scores=sc
            )
        )
    return _build(
        q,
        passages,
        [],
        name="passages",
        frontend="passages",
        params={"scores": sorted(names)},
        meta=meta,
        instruction=instruction,
    )


ADAPTERS = {
    "hipporag": from_hipporag,
    "graphrag": from_graphrag,
    "lightrag": from_lightrag,
    "passages": from_passages,
}


def load_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise FrontendError(f"{path}: cannot read: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise FrontendError(f"{path}: not valid JSON: {exc}") from None


def adapt_file(kind: str, path: str | Path, **kwargs) -> Prior:
    """Read `path` and run the `kind` adapter on it; errors name the file."""
    if kind not in ADAPTERS:
        raise FrontendError(f"unknown adapter {kind!r}; choose one of {', '.join(ADAPTERS)}")
    try:
        return ADAPTERS[kind](load_json(path), **kwargs)
    except FrontendError as exc:
        msg = str(exc)
        raise FrontendError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
