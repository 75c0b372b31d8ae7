"""The `.kap` IR: immutable msgspec Structs, one per statement kind, gathered in one `Module`.

A module grows stage by stage; each pass fills in its own statements and never edits another's:

    kap        header: name, request mode, the passes run so far          (always)
    segment    the request's pieces, passages among them                  (always)
    unit       the frontend's evidence units with scores and anchors      (always)
    evidence   one combined prior per passage                             (ground)
    target     model, tokenizer and template fingerprints                 (align-spans)
    prompt     rendered prompt: characters, tokens, token hash            (align-spans)
    span       each segment's character and token span                    (align-spans)
    select     the budget and what it kept                                (select)
    keep       one kept token range and why                               (select)
    pages      KV pages of the engine's block size, retained ratio        (resolve-pages)
    view       the compact selected-KV view the proposal reads            (compact)
    verify     proposal length and acceptance rule                        (compact)
    access     which pages the proposal reads: the plan's, the query's, both  (compact)
    fallback   when the runtime falls back to full-context decoding       (compact)
    cost       the cost model's prediction                                (compact)

Ranges are half-open token or character offsets. The text form (printer/parser in `kapc.parse`)
is derived from these definitions: a field's type decides how its value is written.
"""

from __future__ import annotations

import typing
from typing import Annotated, Literal

import msgspec

REF = "ref"  # marks a str field written as `%id` in the text form
Ref = Annotated[str, REF]
WORD = "word"  # marks a str field written bare (a pass name, a policy name)
Word = Annotated[str, WORD]


class Node(msgspec.Struct, frozen=True, kw_only=True):
    pass


class Range(msgspec.Struct, frozen=True, array_like=True):
    """[start, end), written `start..end`."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


class Anchor(msgspec.Struct, frozen=True, array_like=True):
    """Characters [start, end) of segment `segment`, written `%segment@start..end`."""

    segment: str
    start: int
    end: int


SegmentKind = Literal["instruction", "question", "passage", "text"]
UnitKind = Literal["passage", "node", "triple", "proposition"]
KeepReason = Literal["sink", "instruction", "question", "template", "text", "evidence", "window"]


KAP_VERSION = 1  # the .kap text format's version; a reader refuses any other


class Header(Node, kw_only=True, frozen=True):
    version: int = KAP_VERSION
    name: str
    request: Literal["chat", "raw"]
    passes: tuple[Word, ...] = ()


class Segment(Node, kw_only=True, frozen=True):
    id: Ref
    message: int = 0  # index of the chat message it belongs to
    role: Literal["system", "user", "assistant", "none"] = "none"
    kind: SegmentKind = "text"
    title: str | None = None
    text: str


class Unit(Node, kw_only=True, frozen=True):
    id: Ref
    kind: UnitKind
    segment: Ref | None = None
    text: str = ""
    anchors: tuple[Anchor, ...] = ()
    scores: dict[str, float] = {}


class Evidence(Node, kw_only=True, frozen=True):
    id: Ref  # the passage segment it stands for
    prior: float
    sources: tuple[Ref, ...] = ()  # the units whose scores went into `prior`


class Target(Node, kw_only=True, frozen=True):
    model: str
    fingerprint: str
    tokenizer: str
    template: str
    parameters: int  # weight count, for the cost model
    kv_elements_per_token: int  # 2 * layers * kv_heads * head_dim


class Prompt(Node, kw_only=True, frozen=True):
    chars: int
    tokens: int
    hash: str


class Span(Node, kw_only=True, frozen=True):
    id: Ref
    chars: Range
    tokens: Range


class Select(Node, kw_only=True, frozen=True):
    budget: int  # tokens
    kept: int  # tokens kept, never above budget
    mandatory: int  # of which kept regardless of evidence (sink, instruction, question, window...)
    dropped: tuple[Ref, ...] = ()  # passages left out, best prior first
    # how far the frontend's priors set the kept passages apart from the dropped ones: the mean
    # prior of the kept minus that of the dropped (None: no passage dropped, nothing to separate)
    separation: float | None = None


class Keep(Node, kw_only=True, frozen=True):
    id: Ref | None = None
    tokens: Range
    why: KeepReason
    prior: float | None = None


class Pages(Node, kw_only=True, frozen=True):
    block_size: int
    blocks: int  # prompt blocks in all
    selected: tuple[Range, ...]  # logical block ranges, ascending, the tail block last
    retained: float  # visible prompt tokens / prompt tokens
    visible: int  # prompt tokens in the selected blocks


class View(Node, kw_only=True, frozen=True):
    blocks: int  # compact table width (selected blocks)
    padded_blocks: int  # width padded to a stable bucket
    tail_block: int  # logical block holding the last prompt token; generated tokens follow it
    tail_slot: int  # compact index of the tail block's first token


class Verify(Node, kw_only=True, frozen=True):
    k: int
    accept: Word  # "greedy" or "top{N}"


AccessMode = Literal["static", "dynamic", "hybrid"]
Proxy = Literal["query", "es-in", "es-mid", "es-mix"]


class Access(Node, kw_only=True, frozen=True):
    """The access policy (kapc.lower.kapb.AccessPolicy says what each value means): `static`
    reads the plan's pages; `dynamic` the pages the draft's query picks from per-page key bounds,
    `budget` of the prompt in all; `hybrid` the plan's pages plus the query's best, `budget` in
    all. `mix` (proxy es-mix) holds "in" or "mid" per layer, read from the calibration file
    `mix_file` (its digest in `mix_digest`)."""

    mode: AccessMode
    budget: float | None = None
    proxy: Proxy = "query"
    refresh: Literal["cycle"] = "cycle"
    mix: tuple[Literal["in", "mid"], ...] = ()
    mix_file: str | None = None
    mix_digest: str | None = None


class Fallback(Node, kw_only=True, frozen=True):
    max_retained: float
    min_acceptance: float
    acceptance_window: int
    on_predicted_loss: bool
    min_separation: float = 0.0  # prior confidence: below this `Select.separation`, full context


class Cost(Node, kw_only=True, frozen=True):
    dtype_bytes: int
    batch: int
    weight_bytes: int
    kv_bytes: int
    s: float
    h: float  # the acceptance rate (accepted / proposed) expected at k
    k: int
    speedup: float
    pays: bool
    p: float | None = None  # per-draft acceptance the prediction assumes (h follows from p and k)
    basis: str = "memory-bound"  # or the calibration profile's key
    break_even: float | None = (
        None  # the acceptance rate h at which the plan neither gains nor loses
    )
    by_k: tuple[float, ...] = ()  # predicted speedup at k = 1, 2, ...
    # the paper's KV_crit as a length: the shortest prompt (tokens) from which a plan of this s,
    # acceptance, k and batch pays; 0 where it pays at no length up to the model's positions,
    # None where it was not computed
    pays_from: int | None = None


T = typing.TypeVar("T")


class MissingStatement(ValueError):
    """A module read as if a pass had run that has not: a bug in the caller, not in the input
    (the checker refuses a module whose passes lack their statements)."""


def present(value: T | None, what: str) -> T:
    """A statement a pass wrote (or a field the checker requires), for code that runs after it."""
    if value is None:
        raise MissingStatement(f"the module lacks {what}")
    return value


class Module(Node, kw_only=True, frozen=True):
    """A whole plan at some stage. Statement order in the text is the field order here."""

    kap: Header
    segment: tuple[Segment, ...] = ()
    unit: tuple[Unit, ...] = ()
    evidence: tuple[Evidence, ...] = ()
    target: Target | None = None
    prompt: Prompt | None = None
    span: tuple[Span, ...] = ()
    select: Select | None = None
    keep: tuple[Keep, ...] = ()
    pages: Pages | None = None
    view: View | None = None
    verify: Verify | None = None
    access: Access | None = None
    fallback: Fallback | None = None
    cost: Cost | None = None

    def segments_by_id(self) -> dict[str, Segment]:
        return {s.id: s for s in self.segment}

    def spans_by_id(self) -> dict[str, Span]:
        return {s.id: s for s in self.span}


def _statement_table() -> dict[str, tuple[type[Node], bool]]:
    """keyword -> (statement struct, whether a module holds many of them), read off `Module`."""
    table = {}
    for name, hint in typing.get_type_hints(Module).items():
        many = typing.get_origin(hint) is tuple
        cls = (
            next(a for a in typing.get_args(hint) if isinstance(a, type) and issubclass(a, Node))
            if typing.get_args(hint)
            else hint
        )
        table[name] = (cls, many)
    return table


STATEMENTS = _statement_table()
