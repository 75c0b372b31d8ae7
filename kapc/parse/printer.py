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
    parts = [keyword]
    for name, hint, required, default in statement_fields(type(stmt)):
        value = getattr(stmt, name)
        if name == "id":
            if value is not None:
                parts.append("%" + value)
            continue
        if not required and value == default:
            continue
        if elide and isinstance(value, str) and len(value) > elide:
            value = value[:elide] + "..."
        parts.append(f"{name}={format_value(value, hint)}")
    return " ".join(parts)


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
