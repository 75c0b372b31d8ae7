"""The one base class of every error kapc reports to a user as a message, not a traceback."""

import re


class KapcError(ValueError):
    pass


def excerpt(value: object, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters: an error names a bad value, it does not echo a
    100 KB one back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 15]}...({len(text)} chars)"


# A quoted span in a message another library wrote: 'value' or "key", then `$.json.path` (a path
# may hold a cut key and its steps, so it is cut only past several times the limit).
_QUOTED = ((re.compile(r"'[^'\n]*'|\"[^\"\n]*\""), 1), (re.compile(r"`[^`\n]*`"), 4))


def bounded(message: str, limit: int = 60) -> str:
    """`message` with every quoted value longer than `limit` characters cut, its length said:
    msgspec and json quote the offending value or dict key whole, and a prior whose enum field
    holds 100 KB must not get a 100 KB error line. Quoted strings are cut before the backquoted
    paths that hold them, so a path keeps its steps and loses only the long key."""
    for pattern, times in _QUOTED:
        width = limit * times

        def cut(m: re.Match[str], width: int = width) -> str:
            return _cut(m.group(0), width)

        message = pattern.sub(cut, message)
    return message


def _cut(quoted: str, limit: int) -> str:
    if len(quoted) <= limit:
        return quoted
    q = quoted[0]
    return f"{quoted[: limit - 15]}...{q} ({len(quoted) - 2} chars)"
