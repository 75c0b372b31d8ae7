"""Answer quality of a sweep's rows: answer metrics against the gold answers, agreement with the
full-context output of the same case, and the similarity judge's score (kept in
`OUT/similarity.json` so a resumed sweep embeds only what is new)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kapc.bench import metrics

SIMILARITY = "similarity.json"


def _pair_key(answer: str, reference: str) -> str:
    return hashlib.sha1(f"{answer}\0{reference}".encode()).hexdigest()


def _pairs(rows) -> list[tuple[str, str]]:
    return [(r["text"], g) for r in rows for g in (r["answers"] or [""])]


def _judge(pairs: list[tuple[str, str]]) -> dict[str, float]:
    judge = metrics.Judge()
    sims = judge.similarity([a for a, _ in pairs], [g for _, g in pairs])
    return {_pair_key(a, g): s for (a, g), s in zip(pairs, sims)}


def score(out: Path) -> int:
    """Judge every (answer, gold answer) pair not judged yet, in a process of its own (the
    encoder's libraries must not load into a process that runs vLLM in-process). Returns how many
    were judged."""
    from kapc.bench.run import RESULTS, read_rows

    path = Path(out) / SIMILARITY
    memo = json.loads(path.read_text()) if path.exists() else {}
    todo = [
        p
        for p in dict.fromkeys(_pairs(read_rows(Path(out) / RESULTS).values()))
        if _pair_key(*p) not in memo
    ]
    if not todo:
        return 0
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        memo.update(pool.submit(_judge, todo).result())
    from kapc.bench.cases import write_json

    write_json(path, memo)
    return len(todo)


def scored_rows(out: Path) -> list[dict]:
    """Every row with its quality fields: em, f1, contains (gold answer in the output),
    similarity and pass (the judge; None when not judged yet), and, for rows other than `full`,
    identical / prefix / agree_f1 against the full-context row of the same case."""
    from kapc.bench.run import RESULTS, read_rows

    rows = read_rows(Path(out) / RESULTS)
    path = Path(out) / SIMILARITY
    memo = json.loads(path.read_text()) if path.exists() else {}
    full = {
        (r["dataset"], r["workload"], r["length"], r["index"]): r
        for r in rows.values()
        if r["method"] == "full"
    }
    scored = []
    for r in rows.values():
        golds = r["answers"] or [""]
        r = dict(r, **metrics.answer_scores(r["text"], golds))
        sims = [memo.get(_pair_key(r["text"], g)) for g in golds]
        sim = None if any(s is None for s in sims) else max(sims)
        r.update(similarity=sim, passed=None if sim is None else metrics.passed(sim))
        ref = full.get((r["dataset"], r["workload"], r["length"], r["index"]))
        if ref is not None and r["method"] != "full":
            a = metrics.agreement(r["tokens"], ref["tokens"])
            r.update(identical=a["identical"], prefix=a["prefix"], agree_f1=a["token_f1"])
        scored.append(r)
    return scored
