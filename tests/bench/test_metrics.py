"""The answer metrics on cases worked out by hand (SQuAD / HotpotQA normalisation, EM, F1), the
agreement measure and the judge's pass rule."""

from __future__ import annotations

import pytest

from kapc.bench import metrics as M


@pytest.mark.parametrize(
    "raw,norm",
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  an   Apple, a pear and THE plum. ", "apple pear and plum"),
        ("Theatre of the Absurd", "theatre of absurd"),  # "the" inside a word stays
        ("1,000 km/h", "1000 kmh"),
        ("", ""),
    ],
)
def test_normalize_answer(raw, norm):
    assert M.normalize_answer(raw) == norm


def test_exact_match_takes_the_best_gold():
    assert M.exact_match("the Eiffel tower.", ["Eiffel Tower"]) == 1.0
    assert M.exact_match("Paris", ["London", "paris"]) == 1.0
    assert M.exact_match("Paris, France", ["Paris"]) == 0.0


def test_f1_by_hand():
    # normalised: [cat, sat, on, mat] against [cat, on, mat]: 3 common, P 3/4, R 1
    assert M.f1("The cat sat on the mat", ["cat on mat"]) == pytest.approx(2 * 0.75 / 1.75)
    # repeated tokens count as often as both sides have them: [a_b, a_b] vs [a_b]: P 1/2, R 1
    assert M.f1("x x", ["x"]) == pytest.approx(2 / 3)
    assert M.f1("dog", ["cat"]) == 0.0
    assert M.f1("Paris", ["Lyon", "Paris France"]) == pytest.approx(2 * 1 * 0.5 / 1.5)


def test_yes_no_answers_score_only_when_exact():
    assert M.f1("yes it is", ["yes"]) == 0.0  # HotpotQA's rule for yes/no/noanswer
    assert M.f1("Yes.", ["yes"]) == 1.0
    assert M.f1("no", ["no one"]) == 0.0


def test_contains_answer_on_word_boundaries():
    assert M.contains_answer("It was built in Paris, France.", ["paris"]) == 1.0
    assert M.contains_answer("A Parisian landmark", ["Paris"]) == 0.0
    assert M.contains_answer("The answer is The Beatles", ["Beatles"]) == 1.0
    assert M.contains_answer("anything", [""]) == 0.0


def test_agreement_with_a_reference_output():
    assert M.agreement([1, 2, 3], [1, 2, 3]) == {"identical": True, "prefix": 1.0, "token_f1": 1.0}
    a = M.agreement([1, 2, 9, 9], [1, 2, 3, 4])
    assert not a["identical"] and a["prefix"] == 0.5
    assert a["token_f1"] == pytest.approx(0.5)
    assert M.agreement([], [])["identical"]


def test_pass_rate_threshold_and_sentences():
    assert M.PASS_AT == 0.5
    assert M.passed(0.5) and not M.passed(0.4999)
    assert M.sentences("Paris. It is the capital!\nSee passage 2?  ") == [
        "Paris.",
        "It is the capital!",
        "See passage 2?",
    ]
