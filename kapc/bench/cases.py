"""What `kapc bench` decodes: one prior per (dataset, question, length) from the offline frontend,
the two workloads' requests made from it, and the prompt-materialisation baselines.

Priors are built once and kept under `OUT/priors/` (the frontend is the slow part of setting up),
with the frontend's own time in `meta["bench"]["frontend_s"]`. Both workloads share the system
instruction and differ only in the line after the question, so their prompts share every KV block
up to the question and a sweep prefills each context once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import time
from pathlib import Path

import msgspec

from kapc.prior import Message, Prior, Request, Segment, decode_prior, encode_prior

# "hotpotqa-shared": the questions of a batch read one long document (kapc.frontend.longctx.
# build_hotpotqa_shared), so a long context is prefilled once per batch instead of once a row.
DATASETS = ("hotpotqa", "squad", "hotpotqa-shared")
LENGTHS = (1024, 2048, 4096, 8192)
INSTRUCTION = "Answer the question using the passages."
# The ask after the question, per workload. `short`: the HotpotQA short answer; `long`: an answer
# with its explanation, decoded to EOS (what a user of a RAG service pays for).
WORKLOADS = {
    "short": "Answer in a few words.",
    "long": (
        "Answer the question, then explain in two or three sentences how the passages "
        "support the answer."
    ),
}
ASK_ROOM = 32  # tokens kept free for the longest ask


@dataclasses.dataclass(frozen=True)
class CaseKey:
    dataset: str
    index: int
    length: int

    @property
    def name(self) -> str:
        return f"{self.dataset}/{self.index}-{self.length}"


def question_indices(dataset: str, n: int, first: int = 0) -> list[int]:
    """The first `n` usable dev questions from `first` on (SQuAD 2.0: answerable ones only, since
    an unanswerable question has no gold answer to score)."""
    from kapc.frontend import data

    if dataset in ("hotpotqa", "hotpotqa-shared"):
        total = len(data.load_hotpotqa())
        return list(range(first, min(first + n, total)))
    if dataset == "squad":
        return [q.index for q in data.load_squad()[first:] if not q.is_impossible][:n]
    raise ValueError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")


def prior_path(out: Path, key: CaseKey) -> Path:
    return Path(out) / "priors" / key.dataset / f"{key.index}-{key.length}.json"


def build_prior(
    key: CaseKey,
    context_tokens: int,
    frontend: str = "graph",
    model: str | None = None,
    chunk: tuple[int, ...] = (),
) -> Prior:
    """The frontend's prior for one case, its own time in `meta["bench"]`. A shared-document
    case reads the document of its batch's questions (`chunk`)."""
    from kapc.frontend.hybrid import score_request
    from kapc.frontend.longctx import build_hotpotqa, build_squad

    t0 = time.perf_counter()
    if key.dataset == "hotpotqa-shared":
        lc = _shared_document(tuple(chunk or (key.index,)), context_tokens, model)[
            (chunk or (key.index,)).index(key.index)
        ]
    else:
        build = build_hotpotqa if key.dataset == "hotpotqa" else build_squad
        lc = build(key.index, context_tokens, instruction=INSTRUCTION, model=model)
    meta = dict(lc.meta(), bench={"length": key.length, "context_tokens": context_tokens})
    prior = score_request(
        lc.request, f"{key.dataset}-{lc.question_id}-{key.length}", frontend, meta=meta
    )
    prior.meta["bench"]["frontend_s"] = round(time.perf_counter() - t0, 4)
    return prior


@functools.lru_cache(maxsize=4)
def _shared_document(chunk: tuple[int, ...], context_tokens: int, model: str | None):
    from kapc.frontend.longctx import build_hotpotqa_shared

    return build_hotpotqa_shared(chunk, context_tokens, instruction=INSTRUCTION, model=model)


def build_priors(
    out: Path,
    keys: list[CaseKey],
    context_tokens: dict[int, int],
    frontend: str = "graph",
    model: str | None = None,
    chunks: dict[tuple[str, int], tuple[int, ...]] | None = None,
) -> int:
    """Build and save every missing prior (run in a process of its own: the frontend's libraries
    must not share a process with an in-process vLLM engine). `chunks`: each shared-document
    case's batch of questions. Returns how many were built."""
    from kapc.frontend.progress import steps

    missing = [k for k in keys if not prior_path(out, k).exists()]
    for key in steps(missing, "kapc bench: frontend: prior", lambda k: k.name):
        prior = build_prior(
            key,
            context_tokens[key.length],
            frontend,
            model,
            (chunks or {}).get((key.dataset, key.index), ()),
        )
        path = prior_path(out, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(encode_prior(prior))
        os.replace(tmp, path)  # an interrupted sweep never leaves half a prior behind
    return len(missing)


def load_prior(out: Path, key: CaseKey) -> Prior:
    path = prior_path(out, key)
    return decode_prior(path.read_bytes(), source=str(path))


def for_workload(prior: Prior, workload: str) -> Prior:
    """The prior with the workload's ask after the question (scores and anchors are unchanged:
    they point into the passages)."""
    ask = WORKLOADS[workload]

    def seg(s: Segment) -> Segment:
        return msgspec.structs.replace(s, text=f"{s.text}\n{ask}") if s.kind == "question" else s

    msgs = [
        msgspec.structs.replace(m, segments=[seg(s) for s in m.segments])
        for m in prior.request.messages or []
    ]
    return msgspec.structs.replace(
        prior, name=f"{prior.name}-{workload}", request=Request(messages=msgs)
    )


# ---------------------------------------------------------------------------------------------
# The paper's prompt-materialisation baselines: shorter prompts, decoded normally.


def _parts(prior: Prior) -> tuple[list[Segment], list[Segment], Segment]:
    """(system segments, passage segments in prompt order, the question segment)."""
    system = [s for m in prior.request.messages if m.role == "system" for s in m.segments]
    user = [s for m in prior.request.messages if m.role == "user" for s in m.segments]
    return (
        system,
        [s for s in user if s.kind == "passage"],
        next(s for s in user if s.kind == "question"),
    )


def _request(system: list[Segment], passages: list[Segment], question: Segment) -> Request:
    return Request(
        messages=[
            Message(role="system", segments=system),
            Message(role="user", segments=[*passages, question]),
        ]
    )


def physical_concat(prior: Prior, kept_ids: list[str]) -> Request:
    """The plan's selected evidence passages (`kept_ids`: select's evidence keeps), materialised
    as the prompt in their prompt order, with the instruction and the question."""
    system, passages, question = _parts(prior)
    keep = set(kept_ids)
    return _request(system, [p for p in passages if p.id in keep], question)


def random_concat(prior: Prior, budget: int, seed: str, model: str | None = None) -> Request:
    """Passages drawn at random (seeded by `seed`) while the prompt stays within `budget` tokens,
    kept in their prompt order."""
    from kapc.frontend.prompt import prompt_tokenizer

    pt = prompt_tokenizer(model)
    system, passages, question = _parts(prior)
    order = list(range(len(passages)))
    random.Random(seed).shuffle(order)
    chosen: list[int] = []
    total = pt.request_tokens(_request(system, [], question))
    for i in order:
        n = pt.count(passages[i].text) + 1
        if total + n <= budget:
            chosen.append(i)
            total += n
    # a passage's count in context can differ from its count alone by a token at the seams
    while (
        chosen
        and pt.request_tokens(_request(system, [passages[i] for i in sorted(chosen)], question))
        > budget
    ):
        chosen.pop()
    return _request(system, [passages[i] for i in sorted(chosen)], question)


def local_window(prior: Prior, budget: int, model: str | None = None) -> Request:
    """Fixed windows of the serialised context, with no use of the priors: the first and the last
    tokens of the passages (half the budget each, the StreamingLLM shape of sink and recent
    window), so the prompt stays within `budget` tokens."""
    from kapc.frontend.prompt import prompt_tokenizer

    pt = prompt_tokenizer(model)
    system, passages, question = _parts(prior)
    context = "".join(p.text for p in passages)
    ids = pt.tokenizer.encode(context, add_special_tokens=False).ids
    room = budget - pt.request_tokens(_request(system, [], question)) - 4
    while room > 0:
        if room >= len(ids):
            text = context
        else:
            head, tail = ids[: room // 2], ids[len(ids) - (room - room // 2) :]
            text = pt.tokenizer.decode(head) + "\n...\n" + pt.tokenizer.decode(tail) + "\n\n"
        req = _request(system, [Segment(text=text, kind="passage", id="w0")], question)
        if pt.request_tokens(req) <= budget:
            return req
        room -= 8  # decoding and re-encoding may merge tokens differently at the seams
    return _request(system, [], question)


def prompt_ids(request: Request, model: str | None = None) -> list[int]:
    """The token ids of a request rendered with the model's chat template (as the compiler's
    align-spans renders it)."""
    from kapc.frontend.prompt import prompt_tokenizer

    pt = prompt_tokenizer(model)
    return list(pt.tokenizer.encode(pt.render(request), add_special_tokens=False).ids)


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
