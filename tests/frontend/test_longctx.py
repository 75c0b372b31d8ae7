"""Long contexts: the question's own paragraphs, then hard negatives, nested across lengths."""

from __future__ import annotations

import pytest

from kapc.frontend import data, longctx
from kapc.frontend.prompt import passage_text
from kapc.prior import Prior, decode_prior, encode_prior
from tests.frontend.common import QUESTIONS, TARGETS


def test_prompt_shape(contexts):
    lc = contexts[(1, 2048)]
    msgs = lc.request.messages
    assert [m.role for m in msgs] == ["system", "user"]
    assert [s.kind for s in msgs[0].segments] == ["instruction"]
    user = msgs[1].segments
    assert [s.kind for s in user[:-1]] == ["passage"] * len(lc.passages)
    assert user[-1].kind == "question" and user[-1].text == f"Question: {lc.question}"
    for i, (seg, p) in enumerate(zip(user, lc.passages)):
        assert seg.id == f"p{i}" and seg.title == p.title
        assert seg.text == passage_text(p.title, p.text)
    # A valid prior request.
    decode_prior(encode_prior(Prior(name="x", request=lc.request, meta=lc.meta())))


@pytest.mark.parametrize("qi", QUESTIONS)
def test_longer_prompts_extend_shorter_ones(contexts, qi):
    q = data.hotpotqa_question(index=qi)
    prev = None
    for n in TARGETS:
        lc = contexts[(qi, n)]
        if len(lc.passages) < len(q.paragraphs):
            continue  # below the question's own paragraphs: not nested (documented)
        assert lc.passages[:10] == q.paragraphs  # own paragraphs first, original order
        if prev is not None:
            assert lc.passages[: len(prev.passages)] == prev.passages
            assert len(lc.passages) > len(prev.passages)
        prev = lc
    assert prev is not None and prev.target_tokens == TARGETS[-1]


@pytest.mark.parametrize("qi", QUESTIONS)
def test_token_counts_fit_the_target(contexts, tokenizer, qi):
    for n in TARGETS:
        lc = contexts[(qi, n)]
        assert lc.prompt_tokens == tokenizer.request_tokens(lc.request)  # exact, recounted
        assert lc.prompt_tokens <= n
        # Short of the target by less than the next paragraph (and by at most 5% at 4K and up).
        nxt = (
            longctx._hotpot_negatives(qi, 0)[len(lc.passages) - 10]
            if len(lc.passages) >= 10
            else None
        )
        if nxt is not None:
            p = longctx.hotpotqa_pool().paragraphs[nxt]
            next_tokens = tokenizer.count(passage_text(p.title, p.text)) + 2
            assert n - lc.prompt_tokens < next_tokens
        if n >= 4096:
            assert n - lc.prompt_tokens <= 0.05 * n


def test_gold_paragraphs_always_present(contexts):
    for (qi, n), lc in contexts.items():
        q = data.hotpotqa_question(index=qi)
        titles = [p.title for p in lc.passages]
        assert set(q.gold_titles) <= set(titles), (qi, n)
        assert [titles[i] for i in lc.gold] == [t for t in titles if t in q.gold_titles]
        assert sorted(lc.meta()["gold_titles"]) == sorted(q.gold_titles)


def test_negatives_are_other_questions_paragraphs(contexts):
    for (qi, _n), lc in contexts.items():
        q = data.hotpotqa_question(index=qi)
        own = {p.title for p in q.paragraphs}
        negs = [p for p, o in zip(lc.passages, lc.origins) if o == "negative"]
        assert all(p.title not in own for p in negs)
        assert len({p.title for p in lc.passages}) == len(lc.passages)


def test_negatives_are_query_specific(contexts):
    # The hardest negatives share words with the question.
    lc = contexts[(0, 4096)]
    first = [p for p, o in zip(lc.passages, lc.origins) if o == "negative"][:8]
    assert sum("Derrickson" in p.text or "Ed Wood" in p.text for p in first) >= 4


def test_deterministic_for_a_seed(contexts):
    longctx._hotpot_negatives.cache_clear()
    again = longctx.build_hotpotqa(1, 4096)
    assert again.request == contexts[(1, 4096)].request
    other = longctx.build_hotpotqa(1, 4096, seed=7)
    assert other.passages[:10] == again.passages[:10]
    assert other.passages != again.passages  # the seed reorders negatives within blocks
    ranked = longctx.build_hotpotqa(1, 4096, seed=None)
    assert {p.title for p in ranked.passages[10:18]} == {p.title for p in again.passages[10:18]}


def test_below_the_own_paragraphs_keeps_gold():
    lc = longctx.build_hotpotqa(0, 600)
    assert lc.prompt_tokens <= 600
    assert {lc.passages[i].title for i in lc.gold} == {"Scott Derrickson", "Ed Wood"}
    with pytest.raises(longctx.FrontendError, match="gold paragraphs alone"):
        longctx.build_hotpotqa(0, 100)


def test_by_id_matches_by_index(contexts):
    lc = contexts[(7, 2048)]
    assert longctx.build_hotpotqa(qid=lc.question_id, context_tokens=2048).request == lc.request


def test_squad_long_context(tokenizer):
    a = longctx.build_squad(0, 1024)
    b = longctx.build_squad(0, 3000)
    assert b.passages[: len(a.passages)] == a.passages
    assert a.origins[0] == "gold" and "France" in a.passages[0].text
    assert a.prompt_tokens <= 1024 and b.prompt_tokens <= 3000
    assert b.prompt_tokens == tokenizer.request_tokens(b.request)
    assert 3000 - b.prompt_tokens <= 0.05 * 3000 + 200


def test_a_shared_document_is_one_prefix_with_each_questions_gold_at_its_own_depth():
    from kapc.frontend.prompt import prompt_tokenizer

    indices = (0, 1, 2)
    rows = longctx.build_hotpotqa_shared(indices, 4096)
    assert [r.question_index for r in rows] == list(indices)
    assert len({r.passages for r in rows}) == 1  # one document for all
    pt = prompt_tokenizer()
    ids = [pt.tokenizer.encode(pt.render(r.request), add_special_tokens=False).ids for r in rows]
    # every prompt is the same document followed by its own question, within the target
    question_tokens = max(len(pt.tokenizer.encode(r.question).ids) for r in rows) + 16
    common = 0
    while all(len(x) > common and x[common] == ids[0][common] for x in ids):
        common += 1
    assert common >= min(map(len, ids)) - question_tokens
    assert all(r.prompt_tokens == len(x) <= 4096 for r, x in zip(rows, ids))
    depths = []
    for r in rows:
        q = data.hotpotqa_question(index=r.question_index)
        gold = [i for i, o in enumerate(r.origins) if o == "gold"]
        assert {r.passages[i].title for i in gold} == set(q.gold_titles)
        depths.append(min(gold))
        assert r.meta()["shared_document"] == "0,1,2"
    assert depths == sorted(depths) and len(set(depths)) == len(depths)


def test_shared_document_priors_score_each_question_over_the_one_document():
    """What the long-context decode benchmark prefills once per batch: one prior per question,
    all over the same passages, each scored for its own question."""
    from kapc.frontend.hybrid import hotpotqa_shared_priors

    priors = hotpotqa_shared_priors((0, 1), 2048, frontend="graph")
    assert [p.meta["question_index"] for p in priors] == [0, 1]
    passages = [
        [s.text for m in p.request.messages for s in m.segments if s.kind == "passage"]
        for p in priors
    ]
    assert passages[0] == passages[1] and passages[0]
    assert priors[0].meta["question"] != priors[1].meta["question"]
    assert all(p.meta["shared_document"] == "0,1" for p in priors)
    # each question's own gold passages score among its best
    for p in priors:
        gold = set(p.meta["gold_passages"])
        scores = {u.segment: u.scores["ppr"] for u in p.units if u.kind == "passage"}
        best = sorted(scores, key=scores.get, reverse=True)[: len(gold) + 3]
        assert gold & set(best)
