"""Render a module's request into the one logical prompt and tokenize it, with character offsets.

Shared by the `align-spans` pass (which maps spans) and lowering (which needs the token ids), so
that both see exactly the same prompt. The chat template is rendered with jinja2 the way Hugging
Face's `apply_chat_template` does (sandboxed, trim_blocks, lstrip_blocks, generation prompt on);
a test checks the result against transformers itself.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
from dataclasses import dataclass

import numpy as np

from kapc.errors import KapcError, excerpt
from kapc.ir import Module
from kapc.models import ModelAssets


class PromptError(KapcError):
    pass


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    segment_chars: dict[str, tuple[int, int]]  # segment id -> [start, end) in `text`


@dataclass(frozen=True)
class Tokens:
    ids: np.ndarray  # int32
    starts: np.ndarray  # char offset where each token starts
    ends: np.ndarray  # char offset where each token ends

    def spans_of(self, starts, ends) -> tuple[np.ndarray, np.ndarray]:
        """For character ranges [start, end): the tokens that overlap each, as [first, last).
        An empty character range maps to the empty token range where it stands."""
        first = np.searchsorted(self.ends, np.asarray(starts), side="right")
        last = np.searchsorted(self.starts, np.asarray(ends), side="left")
        return first, np.maximum(first, last)

    def segment_spans(self, rendered: RenderedPrompt, module: Module) -> list[tuple[int, int]]:
        """Each segment's token span [first, last), in segment order."""
        chars = [rendered.segment_chars[seg.id] for seg in module.segment]
        firsts, lasts = self.spans_of([c[0] for c in chars], [c[1] for c in chars])
        return list(zip(firsts.tolist(), lasts.tolist()))

    @functools.cached_property
    def hash(self) -> str:
        return "sha256:" + hashlib.sha256(self.ids.astype("<i4").tobytes()).hexdigest()


def render(module: Module, assets: ModelAssets) -> RenderedPrompt:
    segments = module.segment
    if module.kap.request == "raw":
        text, pos, chars = [], 0, {}
        for seg in segments:
            chars[seg.id] = (pos, pos + len(seg.text))
            text.append(seg.text)
            pos += len(seg.text)
        return RenderedPrompt("".join(text), chars)

    if not assets.chat_template:
        raise PromptError(f"model {assets.name} has no chat template; use a raw request")
    messages: list[dict] = []
    owners: list[list] = []
    for seg in segments:
        if not messages or seg.message != len(messages) - 1:
            if seg.message != len(messages):
                raise PromptError(f"segment %{seg.id}: message index {seg.message} out of order")
            messages.append({"role": seg.role})
            owners.append([])
        owners[-1].append(seg)
    for msg, segs in zip(messages, owners):
        msg["content"] = "".join(seg.text for seg in segs)
    try:
        text = _template(assets.chat_template).render(
            messages=messages, add_generation_prompt=True, **assets.special
        )
    except PromptError:
        raise
    except Exception as exc:  # noqa: BLE001 - a broken template fails in any way jinja can
        raise PromptError(
            f"the chat template of {assets.name} fails: {type(exc).__name__}: "
            f"{excerpt(str(exc), 200)}"
        ) from None

    # Find each message's content in the rendered text, in order; a template that rewrites content
    # (strips it, say) would make character spans meaningless, so that is an error.
    chars, cursor = {}, 0
    for msg, segs in zip(messages, owners):
        at = text.find(msg["content"], cursor)
        if at < 0:
            raise PromptError(
                f"the chat template of {assets.name} changes the content of a "
                f"{msg['role']} message, so passage spans cannot be located"
            )
        pos = at
        for seg in segs:
            chars[seg.id] = (pos, pos + len(seg.text))
            pos += len(seg.text)
        cursor = pos
    return RenderedPrompt(text, chars)


@functools.lru_cache(maxsize=4)
def _template(source: str):
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise PromptError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
        x, indent=indent, ensure_ascii=False
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


@functools.lru_cache(maxsize=8)
def _tokenizer(tokenizer_json: bytes):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own untyped errors
        raise PromptError(
            f"the model's tokenizer.json cannot be loaded: {excerpt(str(exc), 200)}"
        ) from None


class Tokenization:
    """Tokenizes prompts with one model's tokenizer, remembering recent results: `explain` and
    `compile` render the same prompt more than once, and benchmarks time the passes apart from
    tokenization by warming this first."""

    def __init__(self, assets: ModelAssets):
        self.assets = assets
        self._memo: dict[tuple[str, bool], Tokens] = {}
        self._rendered: tuple | None = None  # the last (request, segments) rendered, and its result

    def __call__(self, text: str, add_special_tokens: bool) -> Tokens:
        key = (text, add_special_tokens)
        hit = self._memo.get(key)
        if hit is None:
            enc = _tokenizer(self.assets.tokenizer_json).encode(
                text, add_special_tokens=add_special_tokens
            )
            offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
            hit = Tokens(
                np.asarray(enc.ids, dtype=np.int32), offsets[:, 0].copy(), offsets[:, 1].copy()
            )
            if len(self._memo) > 16:
                self._memo.clear()
            self._memo[key] = hit
        return hit

    def prompt(self, module: Module) -> tuple[RenderedPrompt, Tokens]:
        key = (module.kap.request, module.segment)
        if self._rendered is None or self._rendered[0] != key:
            self._rendered = (key, render(module, self.assets))
        rendered = self._rendered[1]
        limit = self.assets.max_prompt_chars()
        if len(rendered.text) > limit:
            # Refused before tokenizing: a native tokenizer given megabytes of text may abort the
            # whole process, and no such prompt fits the model anyway.
            raise PromptError(
                f"the rendered prompt is {len(rendered.text):,} characters; {self.assets.name} "
                f"holds {self.assets.context_tokens():,} tokens of at most "
                f"{self.assets.max_token_chars} characters each, so at most {limit:,} characters fit"
            )
        try:
            rendered.text.encode("utf-8")
        except UnicodeEncodeError as exc:
            seg = next(
                (sid for sid, (a, b) in rendered.segment_chars.items() if a <= exc.start < b), None
            )
            raise PromptError(
                f"the prompt holds a lone surrogate (U+{ord(rendered.text[exc.start]):04X})"
                + (f" in segment %{seg}" if seg else "")
                + "; text must be Unicode "
                "characters"
            ) from None
        # A chat template already writes every special token it wants; raw prompts get the
        # tokenizer's own (BOS, if it adds one), as Hugging Face does for plain text.
        return rendered, self(rendered.text, add_special_tokens=module.kap.request == "raw")
