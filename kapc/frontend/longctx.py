"""Long contexts the paper's way: a question's own paragraphs, then query-specific hard negatives.

For a HotpotQA question the prompt holds, in this order:

1. the question's own 10 paragraphs (2 gold, 8 distractors) in the dataset's order;
2. hard negatives: paragraphs of *other* questions, ranked by BM25 similarity to this question,
   never one whose title equals a title of this question's own paragraphs (gold included).

The negatives come from one ordered list per (question, seed), so the prompt for a longer target
is a prefix-extension of the prompt for a shorter one. The seed shuffles that list inside
consecutive blocks of `BLOCK` ranks (hardest negatives stay near the front); `seed=None` keeps
the pure BM25 rank. A target is in model tokens over the rendered chat prompt (chat template
included); paragraphs are added while the next one still fits, so the prompt is at most the target
and short of it by less than one paragraph.

A target below the length of the question's own paragraphs keeps the gold paragraphs and drops
distractors from the end; such prompts are still deterministic but no longer prefix-nested.

SQuAD 2.0 works the same way with one own paragraph (the one the question was asked on) and
negatives from the other paragraphs of the dev set (same article included).
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kapc.frontend import data
from kapc.frontend.errors import FrontendError, require
from kapc.frontend.prompt import DEFAULT_INSTRUCTION, chat_request, passage_text, prompt_tokenizer
from kapc.models import load_assets, prepare
from kapc.prior import Request, Segment

BLOCK = 8
BM25_INSTALL = "bm25s==0.3.16"


@dataclass(frozen=True)
class LongContext:
    """One long-context prompt and what is known of its answer."""

    dataset: str
    question_id: str
    question_index: int
    question: str
    answers: tuple[str, ...]
    passages: tuple[data.Paragraph, ...]  # prompt order
    origins: tuple[str, ...]  # per passage: "gold", "distractor" or "negative"
    target_tokens: int
    prompt_tokens: int
    request: Request
    seed: int | None
    model: str
    extra: dict = field(default_factory=dict)

    @property
    def passage_ids(self) -> tuple[str, ...]:
        return tuple(f"p{i}" for i in range(len(self.passages)))

    @property
    def gold(self) -> tuple[int, ...]:
        return tuple(i for i, o in enumerate(self.origins) if o == "gold")

    @property
    def segments(self) -> list[Segment]:
        """The passage segments, in prompt order."""
        assert self.request.messages is not None
        return [s for s in self.request.messages[-1].segments if s.kind == "passage"]

    def meta(self) -> dict:
        gold_ids = [f"p{i}" for i in self.gold]
        return {
            "dataset": self.dataset,
            "question_id": self.question_id,
            "question_index": self.question_index,
            "question": self.question,
            "answer": self.answers[0] if self.answers else "",
            "answers": list(self.answers),
            "gold_titles": [self.passages[i].title for i in self.gold],
            "gold_passages": gold_ids,
            "passage_origins": list(self.origins),
            "context_tokens": self.target_tokens,
            "prompt_tokens": self.prompt_tokens,
            "model": self.model,
            "seed": self.seed,
            **self.extra,
        }


# ---------------------------------------------------------------------------------------------
# BM25 over a paragraph pool


def _bm25_tokenize(texts: list[str]):
    bm25s = require("bm25s", BM25_INSTALL)
    return bm25s.tokenize(texts, stopwords="en", show_progress=False)


def _query_tokens(text: str) -> list[str]:
    bm25s = require("bm25s", BM25_INSTALL)
    toks = bm25s.tokenize([text], stopwords="en", return_ids=False, show_progress=False)
    return list(toks[0]) if toks else []


class _Pool:
    """A paragraph pool with a BM25 index over `title + text`."""

    def __init__(self, paragraphs: tuple[data.Paragraph, ...], retriever) -> None:
        self.paragraphs = paragraphs
        self.retriever = retriever
        self.title_to_ids: dict[str, list[int]] = {}
        for i, p in enumerate(paragraphs):
            self.title_to_ids.setdefault(p.title, []).append(i)

    def scores(self, query: str) -> np.ndarray:
        toks = [t for t in _query_tokens(query) if t in self.retriever.vocab_dict]
        if not toks:
            return np.zeros(len(self.paragraphs), dtype=np.float32)
        return np.asarray(self.retriever.get_scores(toks), dtype=np.float32)


def _cache_dir() -> Path:
    from kapc.models import cache_root

    return cache_root() / "frontend"


def _build_index(paragraphs: tuple[data.Paragraph, ...], label: str, key: str | None):
    """A BM25 index over the pool, from the on-disk cache when `key` names a saved one."""
    bm25s = require("bm25s", BM25_INSTALL)
    where = _cache_dir() / f"bm25-{label}-{key}" if key else None
    if where is not None and (where / "ok").exists():
        try:
            return bm25s.BM25.load(str(where), show_progress=False)
        except Exception:  # a damaged cache is rebuilt, never trusted
            shutil.rmtree(where, ignore_errors=True)
    from kapc.frontend.progress import status

    with status(f"indexing {len(paragraphs)} {label} paragraphs with BM25 (once)"):
        tokens = _bm25_tokenize([f"{p.title}\n{p.text}" for p in paragraphs])
        retriever = bm25s.BM25()
        retriever.index(tokens, show_progress=False)
    if where is not None:
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=where.parent, prefix=where.name + "."))
            retriever.save(str(tmp), show_progress=False)
            (tmp / "ok").write_text("ok\n")
            os.replace(tmp, where)
        except OSError:
            pass  # the cache is an optimisation only
    return retriever


def _file_key(path: Path) -> str:
    import bm25s

    st = path.stat()
    raw = f"{path.name}:{st.st_size}:{st.st_mtime_ns}:{bm25s.__version__}:v1"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


@functools.cache
def hotpotqa_pool() -> _Pool:
    paragraphs, _ = data.hotpotqa_paragraph_pool()
    key = _file_key(data.data_dir() / "hotpotqa.json")
    return _Pool(paragraphs, _build_index(paragraphs, "hotpotqa", key))


@functools.cache
def squad_pool() -> _Pool:
    paragraphs = data.squad_paragraphs()
    return _Pool(paragraphs, _build_index(paragraphs, "squad", None))


def _ordered_negatives(
    pool: _Pool,
    query: str,
    exclude_ids: set[int],
    exclude_titles: set[str],
    seed: int | None,
    salt: str,
    dedupe_titles: bool,
) -> Iterator[int]:
    """Pool indices of the negatives for one question, in the one fixed order, lazily: a prompt
    needs tens of negatives out of tens of thousands, so only the blocks read are filtered and
    shuffled. The order is the same as shuffling the whole list at once (each RNG is consumed in
    the same sequence)."""
    scores = pool.scores(query)
    n = len(scores)
    idx = np.arange(n)
    # Rank by score (descending), ties by pool position: fully deterministic.
    order = np.lexsort((idx, -scores))
    n_pos = int((scores > 0).sum())  # the descending order puts every positive score first

    def candidates() -> Iterator[int]:
        yield from order[:n_pos].tolist()
        # Paragraphs that share no term with the question come last, in a seeded order.
        rest = order[n_pos:].tolist()
        random.Random(f"{seed}:{salt}:rest").shuffle(rest)
        yield from rest

    def filtered() -> Iterator[int]:
        seen_titles = set(exclude_titles)
        for i in candidates():
            if i in exclude_ids:
                continue
            title = pool.paragraphs[i].title
            if title in seen_titles:
                continue
            if dedupe_titles:
                seen_titles.add(title)
            yield i

    if seed is None:
        yield from filtered()
        return
    rng = random.Random(f"{seed}:{salt}:blocks")
    block: list[int] = []
    for i in filtered():
        block.append(i)
        if len(block) == BLOCK:
            rng.shuffle(block)
            yield from block
            block = []
    if block:
        rng.shuffle(block)
        yield from block


class _Lazy:
    """A sequence read from an iterator on demand (iteration and integer indexing), keeping what
    was read."""

    def __init__(self, it: Iterator[int]) -> None:
        self._it = it
        self._items: list[int] = []

    def _fill(self, n: int) -> bool:
        while len(self._items) < n:
            try:
                self._items.append(next(self._it))
            except StopIteration:
                return False
        return True

    def __getitem__(self, k: int) -> int:
        if k < 0:
            raise IndexError("negative indices are not supported")
        if not self._fill(k + 1):
            raise IndexError(k)
        return self._items[k]

    def __iter__(self) -> Iterator[int]:
        k = 0
        while self._fill(k + 1):
            yield self._items[k]
            k += 1


@functools.lru_cache(maxsize=4096)
def _hotpot_negatives(index: int, seed: int | None) -> _Lazy:
    q = data.hotpotqa_question(index=index)
    pool = hotpotqa_pool()
    # The question's own titles (gold and distractors) never come back as negatives; nor does a
    # second paragraph under a title already used.
    own_titles = {p.title for p in q.paragraphs}
    return _Lazy(
        _ordered_negatives(
            pool, q.question, set(), own_titles, seed, f"hotpotqa:{q.id}", dedupe_titles=True
        )
    )


@functools.lru_cache(maxsize=4096)
def _squad_negatives(index: int, seed: int | None) -> _Lazy:
    q = data.squad_question(index=index)
    pool = squad_pool()
    # SQuAD titles name articles: other paragraphs of the same article are fair negatives.
    return _Lazy(
        _ordered_negatives(
            pool, q.question, {q.paragraph}, set(), seed, f"squad:{q.id}", dedupe_titles=False
        )
    )


# ---------------------------------------------------------------------------------------------
# Fitting a target length


def _segments(paragraphs: list[data.Paragraph]) -> list[Segment]:
    return [
        Segment(text=passage_text(p.title, p.text), kind="passage", id=f"p{i}", title=p.title)
        for i, p in enumerate(paragraphs)
    ]


def _fit(
    base: list[data.Paragraph],
    base_origins: list[str],
    negatives,
    question: str,
    target: int,
    model: str | None,
    instruction: str,
):
    """Longest prefix of `base + negatives` whose rendered prompt fits `target` tokens."""
    pt = prompt_tokenizer(model)
    positions = load_assets(model).context_tokens()
    if target > positions:
        raise FrontendError(
            f"context tokens {target:,}: {pt.model} holds {positions:,} positions; "
            f"ask for {positions:,} or fewer"
        )

    def total(paragraphs: list[data.Paragraph]) -> int:
        return pt.request_tokens(chat_request(_segments(paragraphs), question, instruction))

    base_tokens = total(base)
    if base_tokens > target:
        # Keep gold, drop distractors from the end until it fits.
        keep = list(range(len(base)))
        for j in reversed(range(len(base))):
            if base_origins[j] == "gold":
                continue
            keep.remove(j)
            if total([base[k] for k in keep]) <= target:
                break
        chosen = [base[k] for k in keep]
        n = total(chosen)
        if n > target:
            raise FrontendError(
                f"the question's gold paragraphs alone take {n} tokens, more than the target "
                f"{target}; ask for at least {n} context tokens"
            )
        return chosen, [base_origins[k] for k in keep], n
    # Estimate with per-passage counts (a passage costs about one token more in context, where
    # its blank line splits from the next title), then settle exactly by bisection. `seen` holds
    # the negatives pulled so far, in order, so nothing pulled is ever skipped.
    it = iter(negatives)
    seen: list[data.Paragraph] = []
    limit = target * 1.02 + 64
    estimate = base_tokens
    n_est = 0
    exhausted = False
    while estimate <= limit:
        if n_est == len(seen):
            chunk = [p for _, p in zip(range(32), it)]
            if not chunk:
                exhausted = True
                break
            seen.extend(chunk)
            lens = pt.count_many([passage_text(p.title, p.text) for p in chunk])
            counts = dict(zip(range(len(seen) - len(chunk), len(seen)), lens))
        estimate += counts[n_est] + 1
        n_est += 1
    negs = seen[:n_est]
    lo, hi = 0, len(negs)  # invariant: lo negatives fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total(base + negs[:mid]) <= target:
            lo = mid
        else:
            hi = mid - 1
    if lo == len(negs) and not exhausted:
        # The estimate ran short (it never has in practice): extend one paragraph at a time.
        rest = _chain(seen[n_est:], it)
        for p in rest:
            if total(base + negs + [p]) > target:
                break
            negs.append(p)
        lo = len(negs)
    chosen = base + negs[:lo]
    return chosen, base_origins + ["negative"] * lo, total(chosen)


def _chain(first, rest):
    yield from first
    yield from rest


def _check_target(context_tokens: int) -> None:
    if context_tokens <= 0:
        raise FrontendError(f"context tokens must be positive, got {context_tokens}")


def build_hotpotqa(
    index: int | None = None,
    context_tokens: int = 4096,
    *,
    qid: str | None = None,
    seed: int | None = 0,
    model: str | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
) -> LongContext:
    """The long-context prompt for HotpotQA dev question `index` (or `qid`) at `context_tokens`."""
    _check_target(context_tokens)
    q = data.hotpotqa_question(index=index, qid=qid)
    gold = set(q.gold_titles)
    base = list(q.paragraphs)
    origins = ["gold" if p.title in gold else "distractor" for p in base]
    prepare(model)  # the tokenizer is extracted while the index is built
    pool = hotpotqa_pool()

    def negatives():
        for i in _hotpot_negatives(q.index, seed):
            yield pool.paragraphs[i]

    chosen, chosen_origins, n = _fit(
        base, origins, negatives(), q.question, context_tokens, model, instruction
    )
    segs = _segments(chosen)
    pt = prompt_tokenizer(model)
    return LongContext(
        dataset="hotpotqa",
        question_id=q.id,
        question_index=q.index,
        question=q.question,
        answers=(q.answer,),
        passages=tuple(chosen),
        origins=tuple(chosen_origins),
        target_tokens=context_tokens,
        prompt_tokens=n,
        request=chat_request(segs, q.question, instruction),
        seed=seed,
        model=pt.model,
        extra={
            "type": q.type,
            "level": q.level,
            "supporting_facts": [[t, k] for t, k in q.supporting_facts],
        },
    )


def build_squad(
    index: int | None = None,
    context_tokens: int = 4096,
    *,
    qid: str | None = None,
    seed: int | None = 0,
    model: str | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
) -> LongContext:
    """The long-context prompt for SQuAD 2.0 dev question `index` (or `qid`) at `context_tokens`:
    the question's paragraph first, then BM25-ranked negatives from the rest of the dev set."""
    _check_target(context_tokens)
    q = data.squad_question(index=index, qid=qid)
    paragraphs = data.squad_paragraphs()
    base = [paragraphs[q.paragraph]]
    prepare(model)  # the tokenizer is extracted while the index is built
    pool = squad_pool()

    def negatives():
        for i in _squad_negatives(q.index, seed):
            yield pool.paragraphs[i]

    chosen, origins, n = _fit(
        base, ["gold"], negatives(), q.question, context_tokens, model, instruction
    )
    pt = prompt_tokenizer(model)
    return LongContext(
        dataset="squad",
        question_id=q.id,
        question_index=q.index,
        question=q.question,
        answers=q.answers,
        passages=tuple(chosen),
        origins=tuple(origins),
        target_tokens=context_tokens,
        prompt_tokens=n,
        request=chat_request(_segments(chosen), q.question, instruction),
        seed=seed,
        model=pt.model,
        extra={"is_impossible": q.is_impossible, "article": q.title},
    )


# ---------------------------------------------------------------------------------------------
# One long document, several questions


def build_hotpotqa_shared(
    indices: tuple[int, ...] | list[int],
    context_tokens: int = 16384,
    *,
    seed: int | None = 0,
    model: str | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
) -> list[LongContext]:
    """One long document read by several HotpotQA dev questions, one LongContext per question.

    The document holds every question's own ten paragraphs (gold and distractors), question by
    question in `indices` order, then the first question's hard negatives to `context_tokens`;
    each question's request is that document followed by its own question. So every request of
    a batch shares the whole document as a cached prefix (a long context is prefilled once, not
    once per question), each question's gold passages sit at a different depth (the last
    question's deepest), and the other questions' paragraphs are distractors to it. Where the
    questions' own paragraphs do not fit, distractors are dropped from the end, never gold."""
    _check_target(context_tokens)
    questions = [data.hotpotqa_question(index=i) for i in indices]
    if not questions:
        raise FrontendError("a shared document needs at least one question")
    prepare(model)  # the tokenizer is extracted while the index is built
    pool = hotpotqa_pool()
    base: list[data.Paragraph] = []
    seen_titles: set[str] = set()
    all_gold = {t for q in questions for t in q.gold_titles}
    for q in questions:
        for p in q.paragraphs:
            if p.title not in seen_titles:
                seen_titles.add(p.title)
                base.append(p)
    origins = ["gold" if p.title in all_gold else "distractor" for p in base]

    def negatives():
        for i in _hotpot_negatives(questions[0].index, seed):
            p = pool.paragraphs[i]
            if p.title not in seen_titles:
                yield p

    # fit with the longest question, so that every question's prompt fits the target
    longest = max((q.question for q in questions), key=len)
    chosen, _, _ = _fit(base, origins, negatives(), longest, context_tokens, model, instruction)
    segs = _segments(chosen)
    pt = prompt_tokenizer(model)
    key = ",".join(str(q.index) for q in questions)
    out = []
    for q in questions:
        gold, own = set(q.gold_titles), {p.title for p in q.paragraphs}
        request = chat_request(segs, q.question, instruction)
        out.append(
            LongContext(
                dataset="hotpotqa",
                question_id=q.id,
                question_index=q.index,
                question=q.question,
                answers=(q.answer,),
                passages=tuple(chosen),
                origins=tuple(
                    "gold" if p.title in gold else "distractor" if p.title in own else "negative"
                    for p in chosen
                ),
                target_tokens=context_tokens,
                prompt_tokens=pt.request_tokens(request),
                request=request,
                seed=seed,
                model=pt.model,
                extra={
                    "type": q.type,
                    "level": q.level,
                    "shared_document": key,
                    "supporting_facts": [[t, k] for t, k in q.supporting_facts],
                },
            )
        )
    return out
