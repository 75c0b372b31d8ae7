"""Parse `.kap` text into a `Module`.

Two steps: lark (LALR, grammar in `kap.lark`) turns text into statements; each statement is then
checked against its IR Struct (keyword, attribute names, value types) with every error pointing at
the offending token."""

from __future__ import annotations

import difflib
import json
import math
import re
import threading
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

import lark

from kapc.errors import excerpt
from kapc.files import FileError, read_input, without_bom
from kapc.ir import KAP_VERSION, REF, STATEMENTS, WORD, Anchor, Module, Range
from kapc.limits import MAX_KAP_TOKENS
from kapc.parse.diagnostics import KapError
from kapc.parse.printer import statement_fields


class _TokenBudget(threading.local):
    """Counts the lexical tokens of the parse in progress and stops it past MAX_KAP_TOKENS: parse
    time and memory grow with tokens (about 30 us and 1 KB each), so this bounds both."""

    left = MAX_KAP_TOKENS

    def __call__(self, tok: lark.Token) -> lark.Token:
        self.left -= 1
        if self.left < 0:
            raise _TooManyTokens(tok)
        return tok


class _TooManyTokens(Exception):
    def __init__(self, tok: lark.Token):
        self.tok = tok


_budget = _TokenBudget()


# A continuation inside a string: a backslash that ends a line (not the second half of an escaped
# backslash), then the next line's indentation.
_CONTINUATION = re.compile(r"(\\\\)|\\\n[ \t]*")


# how the parser reports an error at a position: (message, line, column, width) -> never returns
Fail = typing.Callable[..., typing.NoReturn]


def string_value(token: str) -> str:
    """A STRING token's value: JSON's string syntax, less line continuations."""
    return json.loads(_CONTINUATION.sub(lambda m: m.group(1) or "", token))


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    grammar = resources.files("kapc.parse").joinpath("kap.lark").read_text()
    terminals = ("ATTR", "NAME", "REF", "ANCHOR", "RANGE", "NUMBER", "STRING")
    return lark.Lark(
        grammar,
        parser="lalr",
        propagate_positions=True,
        maybe_placeholders=True,
        lexer_callbacks={t: _budget for t in terminals},
    )


_TOKEN_NAMES = {
    "ATTR": "an attribute (name=value)",
    "NAME": "a name",
    "REF": "a reference (%id)",
    "ANCHOR": "an anchor (%id@start..end)",
    "RANGE": "a range (start..end)",
    "NUMBER": "a number",
    "STRING": "a string",
    "LSQB": "'['",
    "RSQB": "']'",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "COMMA": "','",
    "EQUAL": "'='",
    "$END": "end of file",
}


@dataclass(frozen=True)
class SourceMap:
    """Where each statement of a parsed module stands, so that errors found later (the IR
    checker) point at the input as parse errors do. Keys: (keyword, index among that keyword's
    statements)."""

    path: str
    text: str
    at: dict[tuple[str, int], tuple[int, int, int]] = field(default_factory=dict)

    def error(self, message: str, keyword: str | None = None, index: int = 0) -> KapError:
        line, column, width = self.at.get((keyword, index), (0, 0, 1)) if keyword else (0, 0, 1)
        return KapError(
            message, path=self.path, source=self.text, line=line, column=column, width=width
        )


def parse_module(text: str, path: str = "<kap>") -> Module:
    return parse_located(text, path)[0]


def parse_located(text: str, path: str = "<kap>") -> tuple[Module, SourceMap]:
    """Parse `.kap` text; also return where each statement stands."""

    def fail(message: str, line: int | None, column: int | None, width: int = 1) -> typing.NoReturn:
        # lark types a token's position as optional; every token the lexer made has one
        raise KapError(
            message, path=path, source=text, line=line or 1, column=column or 1, width=width
        )

    _budget.left = MAX_KAP_TOKENS
    try:
        tree = _parser().parse(text)
    except _TooManyTokens as exc:
        fail(
            f"more than {MAX_KAP_TOKENS:,} tokens: larger than a .kap may be (docs/limits.md); "
            f"compile the prior.json instead",
            exc.tok.line,
            exc.tok.column,
        )
    except lark.UnexpectedCharacters as exc:
        char = text[exc.pos_in_stream or 0]
        fail(
            "unterminated string (or a raw control character inside it)"
            if char == '"'
            else f"unexpected character {ascii(char)}",
            exc.line,
            exc.column,
        )
    except lark.UnexpectedToken as exc:
        tok = exc.token
        expected = sorted({_TOKEN_NAMES.get(e, e) for e in exc.expected})
        got = "end of file" if tok.type == "$END" else excerpt(str(tok), 40)
        line, col = (tok.line, tok.column) if tok.type != "$END" else _end_position(text)
        fail(f"unexpected {got}; expected {' or '.join(expected)}", line, col, len(str(tok)) or 1)
    except lark.UnexpectedEOF:
        fail("unexpected end of file", *_end_position(text))

    where = SourceMap(path, text)
    collected: dict[str, list] = {k: [] for k in STATEMENTS}
    first_at: dict[str, lark.Token] = {}
    for stmt in tree.children:
        # the grammar's shape: stmt: NAME [REF] attr*
        keyword = typing.cast(lark.Token, typing.cast(lark.Tree, stmt).children[0])
        ref = typing.cast("lark.Token | None", typing.cast(lark.Tree, stmt).children[1])
        attrs = typing.cast(lark.Tree, stmt).children[2:]
        if keyword not in STATEMENTS:
            hint = difflib.get_close_matches(str(keyword), STATEMENTS, n=1)
            fail(
                f"unknown statement {excerpt(str(keyword), 40)}"
                + (f"; did you mean {hint[0]!r}?" if hint else ""),
                keyword.line,
                keyword.column,
                len(keyword),
            )
        name = str(keyword)
        cls, many = STATEMENTS[name]
        if not many and collected[name]:
            prev = first_at[name]
            fail(
                f"a second {str(keyword)!r} statement (the first is at line {prev.line})",
                keyword.line,
                keyword.column,
                len(keyword),
            )
        first_at.setdefault(name, keyword)
        where.at[(name, len(collected[name]))] = (
            keyword.line or 1,
            keyword.column or 1,
            len(keyword),
        )
        collected[name].append(_build(cls, keyword, ref, attrs, fail))

    if not collected["kap"]:
        fail(
            'a .kap module starts with a `kap` statement (kap version=1 name="..." request=chat)',
            1,
            1,
        )
    header = collected["kap"][0]
    if header.version != KAP_VERSION:
        at = first_at["kap"]
        newer = (
            "newer than this kapc reads; upgrade kapc"
            if header.version > KAP_VERSION
            else "not a version kapc ever wrote"
        )
        fail(
            f".kap version {header.version} is {newer} (this kapc reads version {KAP_VERSION})",
            at.line,
            at.column,
            len(at),
        )
    fields: dict[str, typing.Any] = {
        k: (tuple(v) if STATEMENTS[k][1] else (v[0] if v else None)) for k, v in collected.items()
    }
    return Module(**fields), where


def parse_file(path: str | Path) -> Module:
    return parse_module(read_kap_text(path), str(path))


def parse_file_located(path: str | Path) -> tuple[Module, SourceMap]:
    return parse_located(read_kap_text(path), str(path))


def read_kap_text(path: str | Path) -> str:
    """A `.kap` file's text: bounded in size, and UTF-8 (an undecodable byte is reported at its
    line and column)."""
    try:
        data = without_bom(read_input(path, ".kap"))
    except FileError as exc:
        if str(exc).startswith(str(path)):
            raise
        raise KapError(str(exc), path=str(path), line=1, column=1) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        column = len(data[line_start : exc.start].decode("utf-8", "replace")) + 1  # characters
        raise KapError(
            f"not UTF-8: byte 0x{data[exc.start]:02x} at byte offset {exc.start}",
            path=str(path),
            line=line,
            column=column,
        ) from None
    return text


def _end_position(text: str) -> tuple[int, int]:
    lines = text.split("\n")
    if len(lines) > 1 and not lines[-1]:
        lines.pop()  # a final newline ends the last line; it does not start another
    return len(lines), len(lines[-1]) + 1


def _build(cls, keyword, ref, attrs, fail: Fail):
    fields = {name: (hint, required) for name, hint, required, _ in statement_fields(cls)}
    values = {}
    if ref is not None:
        if "id" not in fields:
            fail(f"{keyword!s} statements take no %id", ref.line, ref.column, len(ref))
        values["id"] = str(ref)[1:]
    for attr in attrs:
        key_tok, value_tree = attr.children
        key = str(key_tok).rstrip("=") if attr.data == "attr" else string_value(key_tok)
        if key not in fields or key == "id":
            hint = difflib.get_close_matches(key, [f for f in fields if f != "id"], n=1)
            fail(
                f"{keyword!s} has no attribute {excerpt(key, 40)}"
                + (f"; did you mean {hint[0]!r}?" if hint else ""),
                key_tok.line,
                key_tok.column,
                len(key_tok),
            )
        if key in values:
            fail(f"attribute {key!r} given twice", key_tok.line, key_tok.column, len(key_tok))
        values[key] = _convert(value_tree, fields[key][0], f"{keyword!s}.{key}", fail)
    missing = [n for n, (_, required) in fields.items() if required and n not in values]
    if missing:
        fail(
            f"{keyword!s} is missing "
            + ", ".join(f"{m!r}" for m in missing)
            + (" (write it as %id after the keyword)" if "id" in missing else ""),
            keyword.line,
            keyword.column,
            len(keyword),
        )
    return cls(**values)


def _integer(digits: str, wrong) -> int:
    """An integer that fits the signed 64 bits every .kap consumer stores it in."""
    if len(digits.lstrip("-")) > 19 or not -(1 << 63) <= int(digits) < (1 << 63):
        wrong("an integer of at most 64 bits")
    return int(digits)


def _position(tree) -> tuple[int, int, int]:
    if isinstance(tree, lark.Token):
        return tree.line or 1, tree.column or 1, len(tree)
    meta = tree.meta
    width = meta.end_column - meta.column if meta.line == meta.end_line else 1
    return meta.line, meta.column, width


def _convert(tree, hint, what: str, fail: Fail) -> typing.Any:
    """Turn a parsed value into the Python value `hint` asks for, or fail at its position."""
    kind: str | None = str(tree.data) if isinstance(tree, lark.Tree) else None
    tok: typing.Any = (
        tree.children[0] if kind in ("string", "number", "range", "anchor", "ref", "name") else None
    )

    def wrong(expected: str) -> typing.NoReturn:
        shown = (
            str(tok)
            if tok is not None
            else {"list": "a list", "map": "a map"}.get(kind or "", kind or "")
        )
        if len(shown) > 40:
            shown = shown[:37] + "..."
        fail(
            f"{what}: expected {expected}, got {shown}",
            *_position(tok if tok is not None else tree),
        )

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
        return _integer(str(tok), wrong)
    if hint is float:
        if kind != "number":
            wrong("a number")
        number = float(tok)
        if not math.isfinite(number):
            wrong("a finite number")
        return number
    if hint is str:
        if kind != "string":
            wrong("a string")
        value = string_value(tok)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            wrong("a string of Unicode characters (a \\u escape names a lone surrogate)")
        return value
    if hint is Range:
        if kind != "range":
            wrong("a range (start..end)")
        start, end = (_integer(x, wrong) for x in str(tok).split(".."))
        if end < start:
            wrong("a range whose end is not before its start")
        return Range(start, end)
    if hint is Anchor:
        if kind != "anchor":
            wrong("an anchor (%segment@start..end)")
        seg, rng = str(tok)[1:].rsplit("@", 1)
        start, end = (_integer(x, wrong) for x in rng.split(".."))
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
            key = str(key_tok).rstrip("=") if attr.data == "attr" else string_value(key_tok)
            if key in out:
                fail(
                    f"{what}: key {excerpt(key, 40)} given twice",
                    key_tok.line,
                    key_tok.column,
                    len(key_tok),
                )
            out[key] = _convert(value_tree, args[1], f"{what}.{key}", fail)
        return out
    raise TypeError(f"no text form for {hint!r}")
