"""Rebuild the adapter examples in this folder from HotpotQA dev question 1 ("What government
position was held by the woman who portrayed Corliss Archer in the film Kiss and Tell?").

    .venv/bin/python examples/adapters/make_examples.py

The passages are the question's real paragraphs. The scores come from kapc's own offline graph
frontend (kapc.frontend.hybrid), since HippoRAG, GraphRAG and LightRAG need an LLM to build their
graphs; the entities and relationships are the ones an LLM extractor would plausibly return for
these paragraphs, written out by hand. Each file has the shape its frontend really returns
(see docs/frontend.md).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
INDEX = 1
TOP = 6  # passages per example


def _chunk_id(text: str) -> str:
    return "chunk-" + hashlib.md5(text.encode()).hexdigest()


def main() -> None:
    from kapc.frontend.data import hotpotqa_question
    from kapc.frontend.hybrid import score_passages
    from kapc.frontend.longctx import _segments

    q = hotpotqa_question(index=INDEX)
    paragraphs = list(q.paragraphs)
    segs = _segments(paragraphs)
    scored = score_passages(q.question, segs, "graph")
    order = sorted(range(len(paragraphs)), key=lambda i: (-scored.scores["ppr"][i], i))[:TOP]
    top = [paragraphs[i] for i in order]

    # HippoRAG 2: QuerySolution.to_dict() of retrieve(); docs are "title\ntext" as in its corpora.
    hippo = [
        {
            "question": q.question,
            "answer": None,
            "gold_answers": [q.answer],
            "docs": [f"{p.title}\n{p.text}" for p in top],
            "doc_scores": [round(float(scored.scores["ppr"][i]), 4) for i in order],
            "gold_docs": [f"{p.title}\n{p.text}" for p in paragraphs if p.title in q.gold_titles],
        }
    ]

    # GraphRAG local search: (response, context_data) with context_data as records
    # (graphrag.utils.api.reformat_context_data); GraphRAG's extractor upper-cases names.
    entities = [
        (
            "SHIRLEY TEMPLE",
            "Shirley Temple Black was an American actress, singer, dancer, "
            "businesswoman and diplomat; she served as Chief of Protocol of the United States.",
            4,
        ),
        (
            "KISS AND TELL",
            "Kiss and Tell is a 1945 American comedy film starring Shirley Temple "
            "as Corliss Archer.",
            2,
        ),
        (
            "CORLISS ARCHER",
            "Corliss Archer is the teenage title character of the radio program "
            "Meet Corliss Archer, played by Shirley Temple in Kiss and Tell.",
            3,
        ),
        (
            "A KISS FOR CORLISS",
            "A 1949 comedy film, sequel to Kiss and Tell, starring Shirley "
            "Temple in her final starring role.",
            2,
        ),
        ("JANET WALDO", "American radio and voice actress who played Corliss Archer on radio.", 1),
    ]
    relations = [
        (
            "SHIRLEY TEMPLE",
            "KISS AND TELL",
            "Shirley Temple stars as Corliss Archer in Kiss and Tell.",
            9.0,
            2,
        ),
        ("SHIRLEY TEMPLE", "CORLISS ARCHER", "Shirley Temple portrayed Corliss Archer.", 8.0, 2),
        (
            "A KISS FOR CORLISS",
            "KISS AND TELL",
            "A Kiss for Corliss is the sequel to Kiss and Tell.",
            7.0,
            1,
        ),
        (
            "SHIRLEY TEMPLE",
            "A KISS FOR CORLISS",
            "Shirley Temple's final starring role was in A Kiss for Corliss.",
            6.0,
            1,
        ),
        ("JANET WALDO", "CORLISS ARCHER", "Janet Waldo voiced Corliss Archer on radio.", 5.0, 1),
    ]
    graphrag = {
        "query": q.question,
        "response": "",
        "context_data": {
            "reports": [],
            "entities": [
                {
                    "id": str(i),
                    "entity": n,
                    "description": d,
                    "number of relationships": k,
                    "in_context": True,
                }
                for i, (n, d, k) in enumerate(entities)
            ],
            "relationships": [
                {
                    "id": str(i),
                    "source": s,
                    "target": t,
                    "description": d,
                    "weight": w,
                    "links": links,
                    "in_context": True,
                }
                for i, (s, t, d, w, links) in enumerate(relations)
            ],
            "claims": [],
            "sources": [{"id": str(i), "text": f"{p.title}\n{p.text}"} for i, p in enumerate(top)],
        },
    }

    # LightRAG: aquery_data() / POST /query/data. LightRAG does not echo the query; kapc reads it
    # from a top-level `query` field added here (or --question).
    chunk_ids = {p.title: _chunk_id(p.text) for p in top}
    refs = {p.title: str(i + 1) for i, p in enumerate(top)}

    def sources_of(*names: str) -> str:
        hits = [
            chunk_ids[p.title]
            for p in top
            if any(n.lower() in (p.title + " " + p.text).lower() for n in names)
        ]
        return "<SEP>".join(hits)

    def ref_of(*names: str) -> str:
        for p in top:
            if any(n.lower() in (p.title + " " + p.text).lower() for n in names):
                return refs[p.title]
        return "1"

    def file_of(*names: str) -> str:
        for p in top:
            if any(n.lower() in (p.title + " " + p.text).lower() for n in names):
                return f"{p.title}.txt"
        return "unknown_source"

    title_case = {
        "SHIRLEY TEMPLE": "Shirley Temple",
        "KISS AND TELL": "Kiss and Tell",
        "CORLISS ARCHER": "Corliss Archer",
        "A KISS FOR CORLISS": "A Kiss for Corliss",
        "JANET WALDO": "Janet Waldo",
    }
    types = {
        "SHIRLEY TEMPLE": "person",
        "KISS AND TELL": "artwork",
        "CORLISS ARCHER": "person",
        "A KISS FOR CORLISS": "artwork",
        "JANET WALDO": "person",
    }
    lightrag = {
        "query": q.question,
        "status": "success",
        "message": "Query executed successfully",
        "data": {
            "entities": [
                {
                    "entity_name": title_case[n],
                    "entity_type": types[n],
                    "description": d,
                    "source_id": sources_of(title_case[n]),
                    "file_path": file_of(title_case[n]),
                    "reference_id": ref_of(title_case[n]),
                }
                for n, d, _ in entities
            ],
            "relationships": [
                {
                    "src_id": title_case[s],
                    "tgt_id": title_case[t],
                    "description": d,
                    "keywords": "film role, portrayal",
                    "weight": w,
                    "source_id": sources_of(title_case[s], title_case[t]),
                    "file_path": file_of(title_case[s]),
                    "reference_id": ref_of(title_case[s]),
                }
                for s, t, d, w, _ in relations
            ],
            "chunks": [
                {
                    "reference_id": refs[p.title],
                    "content": p.text,
                    "file_path": f"{p.title}.txt",
                    "chunk_id": chunk_ids[p.title],
                }
                for p in top
            ],
            "references": [
                {"reference_id": refs[p.title], "file_path": f"{p.title}.txt"} for p in top
            ],
        },
        "metadata": {
            "query_mode": "mix",
            "keywords": {
                "high_level": ["Government position", "Film portrayal"],
                "low_level": ["Corliss Archer", "Kiss and Tell", "Woman"],
            },
            "processing_info": {
                "total_entities_found": len(entities),
                "total_relations_found": len(relations),
                "entities_after_truncation": len(entities),
                "relations_after_truncation": len(relations),
                "final_chunks_count": len(top),
            },
        },
    }

    # Plain scored passages.
    passages = {
        "question": q.question,
        "passages": [
            {
                "id": f"p{k}",
                "title": p.title,
                "text": p.text,
                "scores": {
                    "dense": round(float(scored.scores["dense"][i]), 4),
                    "sparse": round(float(scored.scores["sparse"][i]), 4),
                },
            }
            for k, (i, p) in enumerate(zip(order, top))
        ],
    }

    for name, obj in [
        ("hipporag", hippo),
        ("graphrag", graphrag),
        ("lightrag", lightrag),
        ("passages", passages),
    ]:
        (HERE / f"{name}.json").write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {HERE / name}.json")


if __name__ == "__main__":
    main()
