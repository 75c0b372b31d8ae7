"""Print a `Module` as `.kap` text. The form of every value follows from its field's type, so a
new IR field prints (and parses) without touching this file."""

from __future__ import annotations

import json
import math
import re
import typing
from functools import cache

import msgspec

from kapc.ir import REF, STATEMENTS, WORD, Anchor, Module, Node, Range

_BARE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# Lines are kept to WIDTH characters where the values allow: a statement that does not fit goes on
# over indented continuation lines, a long list or map breaks between items, and a long string
# breaks with a `\`-newline continuation (the parser drops it and the indentation after it).
WIDTH = 100
INDENT = "    "
# One character of a JSON string's escaped text: an escape sequence is never split.
_ATOM = re.compile(r"\\u[0-9a-fA-F]{4}|\\.|[^\\]")


@cache
def statement_fields(cls: type[Node]) -> tuple[tuple[str, object, bool, object], ...]:
    """(name, type hint with extras, required, default) for every field of a statement."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in msgspec.structs.fields(cls):
        required = f.required
        default = (
            None
            if required
            else (f.default if f.default is not msgspec.NODEFAULT else f.default_factory())
        )
        out.append((f.name, hints[f.name], required, default))
    return tuple(out)


def print_module(module: Module, elide: int | None = None) -> str:
    """The canonical text. With `elide`, strings longer than that are cut and marked with `...`
    (for reading; such text does not parse back to the same module)."""
    lines = []
    for keyword, (_cls, many) in STATEMENTS.items():
        value = getattr(module, keyword)
        for stmt in value if many else ([] if value is None else [value]):
            lines.append(print_statement(keyword, stmt, elide))
    return "\n".join(lines) + "\n"


def print_statement(keyword: str, stmt: Node, elide: int | None = None) -> str:
    head, attrs = keyword, []
    for name, hint, required, default in statement_fields(type(stmt)):
        value = getattr(stmt, name)
        if name == "id":
            if value is not None:
                head += " %" + value
            continue
        if not required and value == default:
            continue
        if elide and isinstance(value, str) and len(value) > elide:
            value = value[:elide] + "..."
        attrs.append((name, value, hint))
    flat = [f"{name}={format_value(value, hint)}" for name, value, hint in attrs]
    line = " ".join([head, *flat])
    if len(line) <= WIDTH:
        return line
    lines = [head]
    for text, (name, value, hint) in zip(flat, attrs):
        if len(lines[-1]) + 1 + len(text) <= WIDTH:
            lines[-1] += " " + text
        elif len(INDENT) + len(text) <= WIDTH:
            lines.append(INDENT + text)
        else:
            lines.extend(_broken(f"{name}=", value, hint))
    return "\n".join(lines)


def _broken(prefix: str, value, hint) -> list[str]:
    """An attribute too long for one line, over several: a string in chunks joined by
    continuations, a list or map one line of items at a time; anything else whole."""
    while typing.get_origin(hint) is typing.Annotated or typing.get_origin(hint) in (
        typing.Union,
        type(int | None),
    ):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    text = format_value(value, hint)
    if isinstance(value, str) and text.startswith('"'):
        return _broken_string(INDENT + prefix, text)
    if isinstance(value, (tuple, dict)) and value:
        return _broken_items(INDENT + prefix + text[0], _items(value, hint), text[-1])
    return [INDENT + prefix + text]


def _broken_string(first: str, text: str) -> list[str]:
    """`text` (a JSON string, quotes included) from `first` on, cut into lines of at most WIDTH
    characters, each but the last ending in a continuation; a cut falls after a space where one
    is near the end of the line."""
    atoms, lines, line = _ATOM.findall(text[1:-1]), [], first + '"'
    room = WIDTH - 1  # the continuation's backslash
    i = 0
    while i < len(atoms):
        take, size = 0, len(line)
        while i + take < len(atoms) and size + len(atoms[i + take]) <= room:
            size += len(atoms[i + take])
            take += 1
        if i + take < len(atoms):
            space = max((j for j in range(take) if atoms[i + j] == " "), default=-1)
            if space >= take - 24 and space > 0:
                take = space + 1
            take = max(take, 1)
        line += "".join(atoms[i : i + take])
        i += take
        if i < len(atoms):
            lines.append(line + "\\")
            line = INDENT * 2
            if atoms[i] == " ":  # the reader drops a continuation line's indentation
                atoms[i] = "\\u0020"
    lines.append(line + '"')
    return lines


def _items(value, hint) -> list[str]:
    if isinstance(value, tuple):
        (item,) = typing.get_args(hint)[:1]
        return [format_value(v, item) for v in value]
    _, item = typing.get_args(hint)
    keys = (k if _BARE.match(k) else json.dumps(k, ensure_ascii=False) for k in value)
    return [f"{k}={format_value(v, item)}" for k, v in zip(keys, value.values())]


def _broken_items(first: str, items: list[str], close: str) -> list[str]:
    lines, line = [], first
    for n, item in enumerate(items):
        piece = item + ("," if n < len(items) - 1 else close)
        if line == first:  # the first item stays beside the opening bracket
            line += piece
        elif len(line) + 1 + len(piece) > WIDTH:
            lines.append(line)
            line = INDENT * 2 + piece
        else:
            line += " " + piece
    lines.append(line)
    return lines


def format_value(value, hint) -> str:
    if value is None:
        return "none"
    if typing.get_origin(hint) is typing.Annotated:
        base, *extras = typing.get_args(hint)
        if REF in extras:
            return "%" + value
        if WORD in extras:
            return value
        return format_value(value, base)
    if typing.get_origin(hint) in (typing.Union, type(int | None)):
        arg = next(a for a in typing.get_args(hint) if a is not type(None))
        return format_value(value, arg)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Range):
        return f"{value.start}..{value.end}"
    if isinstance(value, Anchor):
        return f"%{value.segment}@{value.start}..{value.end}"
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot print non-finite number {value!r}")
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        if typing.get_origin(hint) is typing.Literal:
            return value
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, tuple):
        (item,) = typing.get_args(hint)[:1]
        return "[" + ", ".join(format_value(v, item) for v in value) + "]"
    if isinstance(value, dict):
        _, item = typing.get_args(hint)
        keys = (k if _BARE.match(k) else json.dumps(k, ensure_ascii=False) for k in value)
        return (
            "{"
            + ", ".join(f"{k}={format_value(v, item)}" for k, v in zip(keys, value.values()))
            + "}"
        )
    raise TypeError(f"no text form for {type(value).__name__}")
