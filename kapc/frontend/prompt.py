"""Building the request a frontend emits, and counting its tokens the way the compiler will see it.

The prompt is rendered by the compiler's own renderer (`kapc.prompt`: the model's chat template,
the passage and question formats) and counted with the model's own tokenizer (`tokenizers`, no
torch), so a frontend's budget in tokens is the compiler's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kapc.models import ModelAssets
from kapc.prior import Message, Request, Segment
from kapc.prompt import DEFAULT_INSTRUCTION, passage_text, question_text, render_request

__all__ = [
    "DEFAULT_INSTRUCTION",
    "PromptTokenizer",
    "chat_request",
    "passage_text",
    "prompt_tokenizer",
    "question_text",
]


def chat_request(
    passages: list[Segment], question: str, instruction: str = DEFAULT_INSTRUCTION
) -> Request:
    """The request shape every kapc frontend emits: a system message with the instruction, then
    one user message holding the passages in prompt order and the question last."""
    return Request(
        messages=[
            Message(role="system", segments=[Segment(text=instruction, kind="instruction")]),
            Message(
                role="user",
                segments=[*passages, Segment(text=question_text(question), kind="question")],
            ),
        ]
    )


@dataclass(frozen=True)
class PromptTokenizer:
    """A model's renderer and tokenizer, for rendering and counting."""

    model: str
    tokenizer: object  # tokenizers.Tokenizer
    assets: ModelAssets

    def render(self, request: Request) -> str:
        return render_request(request, self.assets).text

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def count_many(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        return [len(e.ids) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def request_tokens(self, request: Request) -> int:
        return self.count(self.render(request))


@functools.cache
def prompt_tokenizer(model: str | None = None) -> PromptTokenizer:
    """The renderer and tokenizer of `model` (None: the default SmolLM2-135M-Instruct)."""
    from kapc.models import load_assets
    from kapc.prompt import tokenizer_of

    assets = load_assets(model)
    return PromptTokenizer(
        model=assets.name, tokenizer=tokenizer_of(assets.tokenizer_json), assets=assets
    )
