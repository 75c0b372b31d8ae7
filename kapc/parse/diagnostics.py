"""Errors that point at the input: `file:line:col: error: message`, the source line, carets."""

from __future__ import annotations

import unicodedata

from kapc.errors import KapcError


class KapError(KapcError):
    """A `.kap` file that cannot be read as IR. `str()` is the full, user-facing diagnostic."""

    def __init__(
        self,
        message: str,
        *,
        path: str = "<kap>",
        source: str = "",
        line: int = 0,
        column: int = 0,
        width: int = 1,
    ):
        self.message, self.path, self.line, self.column = message, path, line, column
        self.source, self.width = source, max(1, width)
        super().__init__(self.render())

    def render(self) -> str:
        if not self.line:
            return f"{self.path}: error: {self.message}"
        head = f"{self.path}:{self.line}:{self.column}: error: {self.message}"
        # Lines as the lexer counts them: only "\n" ends one (str.splitlines would also split at
        # U+2028, U+0085 or a form feed, and show the wrong line under the caret).
        lines = self.source.split("\n")
        if not self.source or not 0 < self.line <= len(lines):
            return head
        text = lines[self.line - 1].rstrip("\r")
        # Long lines (prompt text) are cut around the column so the carets stay readable.
        start = max(0, self.column - 60)
        shown = _visible(text[start : start + 120])
        prefix = "..." if start else ""
        carets = " " * (len(prefix) + self.column - 1 - start) + "^" * min(self.width, 120)
        return f"{head}\n  {prefix}{shown}\n  {carets}"


def _visible(line: str) -> str:
    """The line with control and line-separator characters shown as U+FFFD, one for one, so that
    a form feed or U+2028 neither breaks the terminal line nor moves the caret."""
    return "".join(
        "\ufffd" if c != "\t" and unicodedata.category(c) in ("Cc", "Zl", "Zp") else c for c in line
    )
