"""Building the request a frontend emits, and counting its tokens the way the compiler will see it.

The chat prompt is rendered with the model's own chat template (jinja2, the way Hugging Face
renders it: `trim_blocks`, `lstrip_blocks`, generation prompt added) and counted with the model's
own tokenizer (`tokenizers`, no torch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kapc.prior import Message, Request, Segment

DEFAULT_INSTRUCTION = "Answer the question using the passages. Answer briefly."


def passage_text(title: str, body: str) -> str:
    """A passage as it appears in the prompt: title line, body, blank line."""
    return f"Title: {title}\n{body}\n\n"


def question_text(question: str) -> str:
    return f"Question: {question}"


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
    """The model's tokenizer and chat template, for rendering and counting."""

    model: str
    tokenizer: object  # tokenizers.Tokenizer
    template: object  # jinja2.Template
    special: dict

    def render(self, request: Request) -> str:
        if request.messages is None:
            return "".join(s.text for s in request.raw or [])
        messages = [
            {"role": m.role, "content": "".join(s.text for s in m.segments)}
            for m in request.messages
        ]
        return self.template.render(
            messages=messages,
            add_generation_prompt=True,
            **{k: v or "" for k, v in self.special.items()},
        )

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
    """The tokenizer and chat template of `model` (None: the default SmolLM2-135M-Instruct)."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox
    import tokenizers

    from kapc.models import load_assets

    assets = load_assets(model)
    tok = tokenizers.Tokenizer.from_str(assets.tokenizer_json.decode())
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    template_src = assets.chat_template or (
        "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    return PromptTokenizer(
        model=assets.name,
        tokenizer=tok,
        template=env.from_string(template_src),
        special=dict(assets.special),
    )
