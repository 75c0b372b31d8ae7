"""Answer quality: the SQuAD / HotpotQA answer metrics, agreement between two outputs, and an
offline similarity judge.

`normalize_answer`, `exact_match` and `f1` follow the official SQuAD v1.1 evaluation script (and
HotpotQA's, which copies it): lower-case, strip punctuation, drop the articles a/an/the, collapse
whitespace; F1 over the bag of normalised tokens. Against several gold answers a prediction takes
its best score. `yes`/`no`/`noanswer` answers score F1 only on an exact match, as HotpotQA does.

The similarity judge (`Judge`) stands in, offline, for the paper's LLM judge: the cosine
similarity of the bundled all-MiniLM-L6-v2 sentence embeddings of the answer and the reference
answer, clipped to [0, 1]; an answer passes at `PASS_AT` = 0.5. It measures closeness of meaning
only roughly and is not the paper's four-part judge (docs/bench.md says so next to the numbers).
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence

PASS_AT = 0.5
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)
_SPECIAL = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _best(fn, prediction: str, golds: Sequence[str]) -> float:
    return max((fn(prediction, g) for g in golds), default=0.0)


def _em1(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def _f1(prediction: str, gold: str) -> float:
    p, g = normalize_answer(prediction), normalize_answer(gold)
    if (p in _SPECIAL or g in _SPECIAL) and p != g:
        return 0.0
    return token_f1(p.split(), g.split())


def token_f1(pred_tokens: Sequence, gold_tokens: Sequence) -> float:
    """F1 of two bags of tokens (1.0 when both are empty)."""
    if not pred_tokens and not gold_tokens:
        return 1.0
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised gold answer."""
    return _best(_em1, prediction, golds)


def f1(prediction: str, golds: Sequence[str]) -> float:
    """The best token F1 of the prediction against the gold answers."""
    return _best(_f1, prediction, golds)


def contains_answer(prediction: str, golds: Sequence[str]) -> float:
    """1.0 when a normalised gold answer occurs, on word boundaries, in the normalised prediction
    (a long answer that explains itself rarely matches exactly but should contain the answer)."""
    p = f" {normalize_answer(prediction)} "
    return float(any(g and f" {g} " in p for g in map(normalize_answer, golds)))


def agreement(tokens: Sequence[int], reference: Sequence[int]) -> dict:
    """How far an output's token ids are from a reference output's (full-context decoding):
    `identical`, the length of the common prefix as a fraction of the reference, and token F1."""
    n = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        n += 1
    return {
        "identical": list(tokens) == list(reference),
        "prefix": n / len(reference) if reference else float(not tokens),
        "token_f1": token_f1(list(tokens), list(reference)),
    }


def answer_scores(prediction: str, golds: Sequence[str]) -> dict:
    return {
        "em": exact_match(prediction, golds),
        "f1": f1(prediction, golds),
        "contains": contains_answer(prediction, golds),
    }


class Judge:
    """Similarity in [0, 1] from the bundled MiniLM sentence encoder (kapc.frontend.retrieval's
    dense model), with a memo so a repeated text is embedded once."""

    def __init__(self) -> None:
        from kapc.frontend.retrieval import dense_model

        self._model = dense_model()
        self._memo: dict[str, object] = {}

    def _embed(self, texts: list[str]):
        new = [t for t in dict.fromkeys(texts) if t not in self._memo]
        if new:
            vecs = self._model.encode(
                new, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
            )
            self._memo.update(zip(new, vecs))
        return [self._memo[t] for t in texts]

    def similarity(self, answers: list[str], references: list[str]) -> list[float]:
        """Pairwise similarity of answers[i] with references[i]: the best of the whole answer and
        each of its sentences (a long answer states its answer in one sentence and explains it
        in others); an empty answer scores 0."""
        out = []
        for ans, ref in zip(answers, references):
            parts = [ans.strip(), *sentences(ans)] if ans.strip() else []
            if not parts:
                out.append(0.0)
                continue
            vecs, (v,) = self._embed(parts), self._embed([ref.strip()])
            out.append(min(1.0, max(0.0, max(float(u @ v) for u in vecs))))
        return out


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def sentences(text: str) -> list[str]:
    """The sentences of a text (split after . ! ? and at line breaks), without empty ones."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def passed(similarity: float) -> bool:
    return similarity >= PASS_AT
