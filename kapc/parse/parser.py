"""Parse `.kap` text into a `Module`.

Two steps: lark (LALR, grammar in `kap.lark`) turns text into statements; each statement is then
checked against its IR Struct (keyword, attribute names, value types) with every error pointing at
the offending token."""

from __future__ import annotations

import difflib
import json
import typing
from functools import lru_cache
from importlib import resources
from pathlib import Path

import lark

from kapc.ir import REF, STATEMENTS, WORD, Anchor, Module, Range
from kapc.parse.diagnostics import KapError
from kapc.parse.printer import statement_fields


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    grammar = resources.files("kapc.parse").joinpath("kap.lark").read_text()
    return lark.Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=True)


_TOKEN_NAMES = {
    "ATTR": "an attribute (name=value)", "NAME": "a name", "REF": "a reference (%id)",
    "ANCHOR": "an anchor (%id@start..end)", "RANGE": "a range (start..end)",
    "NUMBER": "a number", "STRING": "a string", "LSQB": "'['", "RSQB": "']'", "LBRACE": "'{'",
    "RBRACE": "'}'", "COMMA": "','", "EQUAL": "'='", "$END": "end of file",
}


def parse_module(text: str, path: str = "<kap>") -> Module:
    def fail(message: str, line: int, column: int, width: int = 1) -> typing.NoReturn:
        raise KapError(message, path=path, source=text, line=line, column=column, width=width)

    try:
        tree = _parser().parse(text)
    except lark.UnexpectedCharacters as exc:
        char = text[exc.pos_in_stream]
        fail("unterminated string (or a raw control character inside it)" if char == '"'
             else f"unexpected character {char!r}", exc.line, exc.column)
    except lark.UnexpectedToken as exc:
        tok = exc.token
        expected = sorted({_TOKEN_NAMES.get(e, e) for e in exc.expected})
        got = "end of file" if tok.type == "$END" else repr(str(tok))
        line, col = (tok.line, tok.column) if tok.type != "$END" else _end_position(text)
        fail(f"unexpected {got}; expected {' or '.join(expected)}", line, col, len(str(tok)) or 1)
    except lark.UnexpectedEOF:
        fail("unexpected end of file", *_end_position(text))

    collected: dict[str, list] = {k: [] for k in STATEMENTS}
    first_at: dict[str, lark.Token] = {}
    for stmt in tree.children:
        keyword, ref, *attrs = stmt.children
        if keyword not in STATEMENTS:
            hint = difflib.get_close_matches(str(keyword), STATEMENTS, n=1)
            fail(f"unknown statement {str(keyword)!r}" + (f"; did you mean {hint[0]!r}?" if hint else ""),
                 keyword.line, keyword.column, len(keyword))
        cls, many = STATEMENTS[keyword]
        if not many and collected[keyword]:
            prev = first_at[keyword]
            fail(f"a second {keyword!r} statement (the first is at line {prev.line})",
                 keyword.line, keyword.column, len(keyword))
        first_at.setdefault(str(keyword), keyword)
        collected[keyword].append(_build(cls, keyword, ref, attrs, fail))

    if not collected["kap"]:
        fail("a .kap module starts with a `kap` statement (kap version=1 name=\"...\" request=chat)",
             1, 1)
    fields = {k: (tuple(v) if STATEMENTS[k][1] else (v[0] if v else None)) for k, v in collected.items()}
    return Module(**fields)


def parse_file(path: str | Path) -> Module:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KapError(f"cannot read: {exc}", path=str(path)) from None
    return parse_module(text, str(path))


def _end_position(text: str) -> tuple[int, int]:
    lines = text.splitlines() or [""]
    return len(lines), len(lines[-1]) + 1


def _build(cls, keyword, ref, attrs, fail):
    fields = {name: (hint, required) for name, hint, required, _ in statement_fields(cls)}
    values = {}
    if ref is not None:
        if "id" not in fields:
            fail(f"{keyword!s} statements take no %id", ref.line, ref.column, len(ref))
        values["id"] = str(ref)[1:]
    for attr in attrs:
        key_tok, value_tree = attr.children
        key = str(key_tok).rstrip("=") if attr.data == "attr" else json.loads(key_tok)
        if key not in fields or key == "id":
            hint = difflib.get_close_matches(key, [f for f in fields if f != "id"], n=1)
            fail(f"{keyword!s} has no attribute {key!r}" + (f"; did you mean {hint[0]!r}?" if hint else ""),
                 key_tok.line, key_tok.column, len(key_tok))
        if key in values:
            fail(f"attribute {key!r} given twice", key_tok.line, key_tok.column, len(key_tok))
        values[key] = _convert(value_tree, fields[key][0], f"{keyword!s}.{key}", fail)
    missing = [n for n, (_, required) in fields.items() if required and n not in values]
    if missing:
        fail(f"{keyword!s} is missing " + ", ".join(f"{m!r}" for m in missing)
             + (" (write it as %id after the keyword)" if "id" in missing else ""),
             keyword.line, keyword.column, len(keyword))
    return cls(**values)


def _position(tree) -> tuple[int, int, int]:
    if isinstance(tree, lark.Token):
        return tree.line, tree.column, len(tree)
    meta = tree.meta
    width = meta.end_column - meta.column if meta.line == meta.end_line else 1
    return meta.line, meta.column, width


def _convert(tree, hint, what: str, fail):
    """Turn a parsed value into the Python value `hint` asks for, or fail at its position."""
    kind = tree.data if isinstance(tree, lark.Tree) else None
    tok = tree.children[0] if kind in ("string", "number", "range", "anchor", "ref", "name") else None

    def wrong(expected: str) -> typing.NoReturn:
        shown = str(tok) if tok is not None else {"list": "a list", "map": "a map"}.get(kind, kind)
        if len(shown) > 40:
            shown = shown[:37] + "..."
        fail(f"{what}: expected {expected}, got {shown}", *_position(tok if tok is not None else tree))

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        if REF in args[1:]:
            if kind != "ref":
                wrong("a reference (%id)")
            return str(tok)[1:]
        if WORD in args[1:]:
            if kind != "name":
                wrong("a name")
            return str(tok)
        return _convert(tree, args[0], what, fail)
    if origin in (typing.Union, type(int | None)):
        if kind == "name" and str(tok) == "none" and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(tree, inner, what, fail)
    if origin is typing.Literal:
        if kind != "name" or str(tok) not in args:
            wrong("one of " + ", ".join(map(str, args)))
        return str(tok)
    if hint is bool:
        if kind != "name" or str(tok) not in ("true", "false"):
            wrong("true or false")
        return str(tok) == "true"
    if hint is int:
        if kind != "number" or not str(tok).lstrip("-").isdigit():
            wrong("an integer")
        return int(tok)
    if hint is float:
        if kind != "number":
            wrong("a number")
        return float(tok)
    if hint is str:
        if kind != "string":
            wrong("a string")
        return json.loads(tok)
    if hint is Range:
        if kind != "range":
            wrong("a range (start..end)")
        start, end = map(int, str(tok).split(".."))
        if end < start:
            wrong("a range whose end is not before its start")
        return Range(start, end)
    if hint is Anchor:
        if kind != "anchor":
            wrong("an anchor (%segment@start..end)")
        seg, rng = str(tok)[1:].rsplit("@", 1)
        start, end = map(int, rng.split(".."))
        return Anchor(seg, start, end)
    if origin is tuple:
        if kind != "list":
            wrong("a list [...]")
        return tuple(_convert(c, args[0], what, fail) for c in tree.children if c is not None)
    if origin is dict:
        if kind != "map":
            wrong("a map {name=value, ...}")
        out = {}
        for attr in (c for c in tree.children if c is not None):
            key_tok, value_tree = attr.children
            key = str(key_tok).rstrip("=") if attr.data == "attr" else json.loads(key_tok)
            out[key] = _convert(value_tree, args[1], f"{what}.{key}", fail)
        return out
    raise TypeError(f"no text form for {hint!r}")
