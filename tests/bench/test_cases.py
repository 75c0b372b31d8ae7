"""The workloads and the prompt baselines on a prior made by hand, with the real tokenizer and
chat template: what each baseline keeps, that it stays within its budget, and that the bench's
rendering of a request is the compiler's prompt."""

from __future__ import annotations

import pytest

from kapc.bench import cases
from kapc.frontend.prompt import chat_request
from kapc.prior import Prior, Segment, Unit

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(scope="module")
def prior():
    passages = [
        Segment(
            text=f"Title: Place {i}\n"
            + " ".join(WORDS[(i + j) % 12] for j in range(60))
            + f" end{i}.\n\n",
            kind="passage",
            id=f"p{i}",
            title=f"Place {i}",
        )
        for i in range(12)
    ]
    request = chat_request(passages, "Question: Which place ends with end7?", cases.INSTRUCTION)
    units = [
        Unit(id=p.id, kind="passage", segment=p.id, scores={"dense": 1.0 / (1 + abs(i - 7))})
        for i, p in enumerate(passages)
    ]
    return Prior(name="hand", request=request, units=units, meta={"question_id": "q"})


def _passage_ids(request):
    return [s.id for m in request.messages for s in m.segments if s.kind == "passage"]


def test_workload_adds_its_ask_after_the_question(prior):
    for w, ask in cases.WORKLOADS.items():
        p = cases.for_workload(prior, w)
        q = p.request.messages[-1].segments[-1]
        assert q.kind == "question" and q.text.endswith("end7?\n" + ask)
        assert _passage_ids(p.request) == _passage_ids(prior.request)
        assert p.name == f"hand-{w}" and p.units == prior.units
    short, long = (
        cases.prompt_ids(cases.for_workload(prior, w).request) for w in ("short", "long")
    )
    common = next(i for i, (a, b) in enumerate(zip(short, long)) if a != b)
    assert common > 0.9 * len(short)  # the workloads share every block up to the ask


def test_physical_concat_keeps_the_plans_passages_in_prompt_order(prior):
    req = cases.physical_concat(prior, ["p9", "p2", "p7"])
    assert _passage_ids(req) == ["p2", "p7", "p9"]
    assert req.messages[0] == prior.request.messages[0]  # the instruction
    assert req.messages[-1].segments[-1] == prior.request.messages[-1].segments[-1]


def test_random_concat_is_seeded_and_within_budget(prior):
    budget = 400
    a = cases.random_concat(prior, budget, seed="s1")
    assert len(cases.prompt_ids(a)) <= budget
    assert _passage_ids(a) == _passage_ids(cases.random_concat(prior, budget, seed="s1"))
    picks = {
        tuple(_passage_ids(cases.random_concat(prior, budget, seed=f"s{i}"))) for i in range(6)
    }
    assert len(picks) > 1  # the seed decides, not the priors
    ids = _passage_ids(a)
    assert ids == sorted(ids, key=lambda x: int(x[1:])) and len(ids) >= 2


def test_local_window_keeps_the_ends_of_the_context_within_budget(prior):
    budget = 400
    req = cases.local_window(prior, budget)
    n = len(cases.prompt_ids(req))
    assert budget - 24 <= n <= budget
    text = req.messages[-1].segments[0].text
    assert text.startswith("Title: Place 0") and "end11." in text and "end7." not in text
    # a budget above the whole prompt keeps the whole context
    whole = cases.local_window(prior, 10_000).messages[-1].segments[0].text
    assert whole == "".join(s.text for s in prior.request.messages[-1].segments[:-1])


def test_bench_prompt_is_the_compilers_prompt(prior, ctx):
    from kapc.compiler import compile_to_kapb
    from kapc.lower.kapb import decode_plan

    p = cases.for_workload(prior, "long")
    plan = decode_plan(compile_to_kapb(p, ctx=ctx, verify=False))
    assert [int(t) for t in plan.prompt_token_ids] == cases.prompt_ids(p.request)


def test_question_indices():
    from kapc.frontend import data

    assert cases.question_indices("hotpotqa", 3, first=10) == [10, 11, 12]
    squad = cases.question_indices("squad", 20)
    qs = data.load_squad()
    assert len(squad) == 20 and all(qs[i].answers and not qs[i].is_impossible for i in squad)
    with pytest.raises(ValueError, match="unknown dataset"):
        cases.question_indices("nq", 1)
