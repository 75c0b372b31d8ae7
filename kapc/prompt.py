"""The one prompt renderer: a request into the one logical prompt, tokenized with character offsets.

Shared by the `align-spans` pass (which maps spans), lowering (which needs the token ids), the
frontend (which counts tokens as the compiler will), the runtimes' test and calibration prompts and
the benchmarks, so that all of them see exactly the same prompt. The chat template is rendered with jinja2 the way Hugging
Face's `apply_chat_template` does (sandboxed, trim_blocks, lstrip_blocks, generation prompt on);
a test checks the result against transformers itself.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kapc.errors import KapcError, excerpt
from kapc.ir import Module
from kapc.models import ModelAssets
from kapc.prior import Request


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


# The text formats of a retrieval prompt's pieces: every frontend, benchmark and calibration prompt
# writes passages and the question this way, so plans and measurements see the same prompts.
DEFAULT_INSTRUCTION = "Answer the question using the passages. Answer briefly."


def passage_text(title: str, body: str) -> str:
    """A passage as it appears in the prompt: title line, body, blank line."""
    return f"Title: {title}\n{body}\n\n"


def question_text(question: str) -> str:
    return f"Question: {question}"


@dataclass(frozen=True)
class Piece:
    """One piece of a prompt, in prompt order: its text, and for a chat request the index and role
    of the message it belongs to (consecutive pieces of one message are joined)."""

    text: str
    message: int = 0
    role: str = "user"


def render_pieces(
    pieces: Sequence[Piece], chat: bool, assets: ModelAssets, name=lambda i: f"piece {i}"
) -> RenderedText:
    """The one prompt renderer. A raw prompt is its pieces joined; a chat prompt is the model's
    chat template rendered over the messages the pieces make (generation prompt on), and a model
    without a chat template is refused. Returns the text and each piece's [start, end) in it;
    `name(i)` is what an error calls piece i."""
    if not chat:
        spans, pos = [], 0
        for piece in pieces:
            spans.append((pos, pos + len(piece.text)))
            pos += len(piece.text)
        return RenderedText("".join(p.text for p in pieces), tuple(spans))
    if not assets.chat_template:
        raise PromptError(f"model {assets.name} has no chat template; use a raw request")
    messages: list[dict] = []
    owners: list[list[Piece]] = []
    for i, piece in enumerate(pieces):
        if not messages or piece.message != len(messages) - 1:
            if piece.message != len(messages):
                raise PromptError(f"{name(i)}: message index {piece.message} out of order")
            messages.append({"role": piece.role})
            owners.append([])
        owners[-1].append(piece)
    for msg, own in zip(messages, owners):
        msg["content"] = "".join(piece.text for piece in own)
    # Hugging Face passes the special tokens a tokenizer has; an unset one is undefined, not None
    special = {k: v for k, v in assets.special.items() if v is not None}
    try:
        text = _template(assets.chat_template).render(
            messages=messages, add_generation_prompt=True, **special
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
    spans, cursor = [], 0
    for msg, own in zip(messages, owners):
        at = text.find(msg["content"], cursor)
        if at < 0:
            raise PromptError(
                f"the chat template of {assets.name} changes the content of a "
                f"{msg['role']} message, so passage spans cannot be located"
            )
        pos = at
        for piece in own:
            spans.append((pos, pos + len(piece.text)))
            pos += len(piece.text)
        cursor = pos
    return RenderedText(text, tuple(spans))


@dataclass(frozen=True)
class RenderedText:
    text: str
    spans: tuple[tuple[int, int], ...]  # each piece's [start, end) in `text`, in order


def render(module: Module, assets: ModelAssets) -> RenderedPrompt:
    """A module's prompt, with each segment's characters by segment id."""
    pieces = [Piece(seg.text, seg.message, seg.role) for seg in module.segment]
    out = render_pieces(
        pieces, module.kap.request != "raw", assets, lambda i: f"segment %{module.segment[i].id}"
    )
    return RenderedPrompt(out.text, {seg.id: s for seg, s in zip(module.segment, out.spans)})


def request_pieces(request: Request) -> list[Piece]:
    """A prior's request as pieces, one per segment in prompt order."""
    if request.messages is None:
        return [Piece(s.text) for s in request.raw or []]
    return [Piece(s.text, i, m.role) for i, m in enumerate(request.messages) for s in m.segments]


def render_request(request: Request, assets: ModelAssets) -> RenderedText:
    """A prior's request rendered as the compiler will render it; spans follow its segments."""
    return render_pieces(request_pieces(request), request.messages is not None, assets)


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
def tokenizer_of(tokenizer_json: bytes):
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
            enc = tokenizer_of(self.assets.tokenizer_json).encode(
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
