"""The prior format: what a retrieval frontend knows about one request, as `prior.json`.

A prior carries three things:

* the request, as chat messages (or one raw prompt) whose content is a sequence of named segments,
  so that every passage's character span in the rendered prompt is known exactly;
* the evidence units the frontend produced (passages, graph nodes, triples, propositions), each with
  provenance back to passage segments (character anchors) and the frontend's scores by name;
* metadata about the frontend that made it.

The format evolves append-only: new fields get defaults and `version` says which revision wrote it.
Unknown fields are refused so that a typo never silently drops information.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec

from kapc.errors import KapcError, bounded
from kapc.files import FileError, read_input, without_bom

PRIOR_FORMAT: Final = "kapc.prior"
PRIOR_VERSION = 1

SegmentKind = Literal["instruction", "question", "passage", "text"]
Role = Literal["system", "user", "assistant"]
UnitKind = Literal["passage", "node", "triple", "proposition"]

# `(?!\n)`: Python's `$` also matches before a final newline, and an id "p1\n" would not read
# back from .kap; the pattern stays valid JSON Schema (ECMA) syntax.
Id = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_.:-]*$(?!\n)", max_length=200)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class Segment(_Strict, kw_only=True, frozen=True):
    """A contiguous piece of a message. Passages must carry an `id`; their text is the passage as
    it appears in the prompt (title line and trailing separator included, if the frontend puts them there)."""

    text: str
    kind: SegmentKind = "text"
    id: Id | None = None
    title: str | None = None


class Message(_Strict, kw_only=True, frozen=True):
    role: Role
    segments: list[Segment]


class Request(_Strict, kw_only=True, frozen=True):
    """Either `messages` (rendered with the model's chat template, generation prompt added) or `raw`
    (segments concatenated verbatim, no template)."""

    messages: list[Message] | None = None
    raw: list[Segment] | None = None


class Anchor(_Strict, kw_only=True, frozen=True):
    """A character range [start, end) inside the text of passage segment `segment`."""

    segment: Id
    start: NonNegInt
    end: NonNegInt


class Unit(_Strict, kw_only=True, frozen=True):
    """One evidence unit. `passage` units name their segment in `segment`; graph-derived units
    (`node`, `triple`, `proposition`) point at the passages they came from through `anchors`.
    `scores` maps a score name (dense, sparse, rerank, ppr, or any other) to a value where larger
    means more relevant."""

    id: Id
    kind: UnitKind
    segment: Id | None = None
    text: str = ""
    anchors: list[Anchor] = []
    scores: dict[str, float] = {}


class Frontend(_Strict, kw_only=True, frozen=True):
    name: str
    version: str = ""
    params: dict[str, Any] = {}


class Prior(_Strict, kw_only=True, frozen=True):
    format: Literal["kapc.prior"] = PRIOR_FORMAT
    version: Annotated[int, msgspec.Meta(ge=1)] = PRIOR_VERSION
    name: str
    request: Request
    units: list[Unit] = []
    frontend: Frontend = Frontend(name="unknown")
    # What the frontend knows of the right answer, for evaluation only (never read by the passes).
    meta: dict[str, Any] = {}


class PriorError(KapcError):
    """A prior.json that cannot be used; the message names the file and the JSON path."""


_decoder = msgspec.json.Decoder(Prior)
_encoder = msgspec.json.Encoder()


def decode_prior(data: bytes | str, source: str = "<prior>") -> Prior:
    if not isinstance(data, str):
        try:
            data = without_bom(bytes(data))
        except FileError as exc:
            raise PriorError(f"{source}: $: {exc}") from None
    try:
        prior = _decoder.decode(data)
    except RecursionError:
        raise PriorError(
            f"{source}: {_deepest(data)}: JSON nested deeper than this reader "
            f"follows (docs/limits.md)"
        ) from None
    except msgspec.ValidationError as exc:
        # msgspec writes the path as `$.units[3].kind`, but a dict value only as `scores[...]`,
        # and the document itself with no path at all
        message = str(exc) if " - at `$" in str(exc) else f"{exc} - at `$`"
        raise PriorError(
            f"{source}: invalid prior: {bounded(_name_dict_keys(data, message))}"
        ) from None
    except msgspec.DecodeError as exc:
        raise PriorError(
            f"{source}: not valid JSON: {bounded(_with_line(data, str(exc)))}"
        ) from None
    if prior.version > PRIOR_VERSION:
        raise PriorError(
            f"{source}: $.version: prior format version {prior.version} is newer than this kapc "
            f"reads (up to {PRIOR_VERSION}); upgrade kapc"
        )
    _check_references(prior, source)
    return prior


_PATH_STEP = re.compile(r"\.([A-Za-z_][\w-]*)|\[(\d+|\.\.\.)\]")
_JSON_TYPE = {
    str: "str",
    bool: "bool",
    int: "int",
    float: "float",
    type(None): "null",
    list: "array",
    dict: "object",
}


def _name_dict_keys(data: bytes | str, message: str) -> str:
    """Replace the `[...]` msgspec writes for a value inside a dict with the key that holds the
    offending value (the first whose JSON type is the one the message says it got, or for "Number
    out of range" the first number that overflows a double)."""
    m = re.search(r"(?:got `(\w+)` )?- at `(\$[^`]*\[\.\.\.\][^`]*)`", message)
    if not m or (m.group(1) is None and "out of range" not in message):
        return message
    got, path = m.groups()
    try:
        node = json.loads(data)  # the standard library reads 1e999 (as inf), which msgspec refuses
    except (ValueError, RecursionError):
        return message
    steps = [(k, i) for k, i in _PATH_STEP.findall(path[1:])]

    def resolve(node, steps, prefix):
        for n, (key, idx) in enumerate(steps):
            if idx == "...":
                if not isinstance(node, dict):
                    return None
                for k, v in node.items():
                    found = resolve(v, steps[n + 1 :], f"{prefix}[{k!r}]")
                    if found is not None:
                        return found
                return None
            try:
                node = node[key] if key else node[int(idx)]
            except (KeyError, IndexError, TypeError):
                return None
            prefix += f".{key}" if key else f"[{idx}]"
        if got is None:
            return prefix if isinstance(node, float) and not math.isfinite(node) else None
        return prefix if _JSON_TYPE.get(type(node)) == got else None

    named = resolve(node, steps, "$")
    return message.replace(path, named.replace("'", '"')) if named else message


def _with_line(data: bytes | str, message: str) -> str:
    """msgspec says `(byte 1234)`; people read line and column."""
    m = re.search(r"\(byte (\d+)\)", message)
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if not m:
        if "truncated" not in message:
            return message
        at = len(raw)  # msgspec: "Input data was truncated"; the end is where it stops
        line = raw.count(b"\n") + 1
        col = at - (raw.rfind(b"\n") + 1) + 1
        return f"{message} at line {line}, column {col} (end of file)"
    at = min(int(m.group(1)), len(raw))
    line = raw.count(b"\n", 0, at) + 1
    col = at - (raw.rfind(b"\n", 0, at) + 1) + 1
    return f"{message[: m.start()].rstrip()} at line {line}, column {col} (byte {at})"


def _deepest(data: bytes | str) -> str:
    """Where JSON text reaches its deepest nesting, as `line L, column C`: msgspec reports only
    that it recursed too deep. Vectorised, since this runs on inputs of up to 64 MiB."""
    import numpy as np

    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    a = np.frombuffer(raw, dtype=np.uint8)
    # a quote is escaped when an odd run of backslashes precedes it
    backslash = a == 0x5C
    last_plain = np.maximum.accumulate(np.where(~backslash, np.arange(a.size), -1))
    run_before = np.concatenate(([0], np.arange(a.size) - last_plain))[:-1]
    quote = (a == 0x22) & (run_before % 2 == 0)
    inside = (np.cumsum(quote) % 2 == 1) & ~quote
    opens = ((a == 0x5B) | (a == 0x7B)) & ~inside
    closes = ((a == 0x5D) | (a == 0x7D)) & ~inside
    depth = np.cumsum(opens.astype(np.int64) - closes.astype(np.int64))
    if not depth.size:
        return "line 1, column 1"
    at = int(np.argmax(depth))
    line = int(np.count_nonzero(a[:at] == 0x0A)) + 1
    col = at - (raw.rfind(b"\n", 0, at) + 1) + 1
    return f"line {line}, column {col} (depth {int(depth[at])})"


def load_prior(path: str | Path) -> Prior:
    return decode_prior(read_input(path, "prior.json"), str(path))


def encode_prior(prior: Prior, indent: int = 1) -> bytes:
    raw = _encoder.encode(prior)
    return msgspec.json.format(raw, indent=indent) if indent else raw


def prior_schema() -> dict[str, Any]:
    return msgspec.json.schema(Prior)


def request_segments(request: Request) -> list[Segment]:
    if request.messages is not None:
        return [seg for msg in request.messages for seg in msg.segments]
    return list(request.raw or [])


def _check_references(prior: Prior, source: str) -> None:
    """Semantic checks msgspec cannot express; each names the JSON path at fault."""
    req = prior.request
    if (req.messages is None) == (req.raw is None):
        raise PriorError(f"{source}: $.request: give exactly one of `messages` or `raw`")
    passages: dict[str, Segment] = {}
    seen: set[str] = set()
    if req.messages is not None:
        if not req.messages:
            raise PriorError(f"{source}: $.request.messages: at least one message is needed")
        where = [
            (f"$.request.messages[{i}].segments[{j}]", s)
            for i, m in enumerate(req.messages)
            for j, s in enumerate(m.segments)
        ]
    else:
        where = [(f"$.request.raw[{j}]", s) for j, s in enumerate(req.raw or [])]
    if req.messages is not None:
        for i, m in enumerate(req.messages):
            if not m.segments:
                raise PriorError(
                    f"{source}: $.request.messages[{i}].segments: a message needs at "
                    f'least one segment (an empty message is one segment with text "")'
                )
    for path, seg in where:
        if seg.id is not None:
            if seg.id in seen:
                raise PriorError(f"{source}: {path}.id: duplicate segment id {seg.id!r}")
            seen.add(seg.id)
        if seg.kind == "passage":
            if seg.id is None:
                raise PriorError(f"{source}: {path}: a passage segment needs an `id`")
            passages[seg.id] = seg
    unit_ids: set[str] = set()
    for i, unit in enumerate(prior.units):
        path = f"$.units[{i}]"
        if unit.id in unit_ids:
            raise PriorError(f"{source}: {path}.id: duplicate unit id {unit.id!r}")
        unit_ids.add(unit.id)
        if unit.kind == "passage":
            if unit.segment is None:
                raise PriorError(f"{source}: {path}.segment: a passage unit must name its segment")
            if unit.segment not in passages:
                raise PriorError(f"{source}: {path}.segment: no passage segment {unit.segment!r}")
        elif not unit.anchors:
            raise PriorError(
                f"{source}: {path}.anchors: a {unit.kind} unit needs at least one anchor"
            )
        for j, anchor in enumerate(unit.anchors):
            anchored = passages.get(anchor.segment)
            if anchored is None:
                raise PriorError(
                    f"{source}: {path}.anchors[{j}].segment: no passage segment {anchor.segment!r}"
                )
            if not anchor.start <= anchor.end <= len(anchored.text):
                raise PriorError(
                    f"{source}: {path}.anchors[{j}]: range {anchor.start}..{anchor.end} is outside "
                    f"passage {anchor.segment!r} ({len(anchored.text)} characters)"
                )
        for name, value in unit.scores.items():
            if value != value or value in (float("inf"), float("-inf")):
                raise PriorError(
                    f"{source}: {path}.scores.{name}: score must be finite, got {value}"
                )
