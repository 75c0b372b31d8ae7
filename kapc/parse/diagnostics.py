"""Errors that point at the input: `file:line:col: error: message`, the source line, carets."""

from __future__ import annotations

from kapc.errors import KapcError


class KapError(KapcError):
    """A `.kap` file that cannot be read as IR. `str()` is the full, user-facing diagnostic."""

    def __init__(self, message: str, *, path: str = "<kap>", source: str = "", line: int = 0,
                 column: int = 0, width: int = 1):
        self.message, self.path, self.line, self.column = message, path, line, column
        self.source, self.width = source, max(1, width)
        super().__init__(self.render())

    def render(self) -> str:
        if not self.line:
            return f"{self.path}: error: {self.message}"
        head = f"{self.path}:{self.line}:{self.column}: error: {self.message}"
        lines = self.source.splitlines()
        if not 0 < self.line <= len(lines):
            return head
        text = lines[self.line - 1]
        # Long lines (prompt text) are cut around the column so the carets stay readable.
        start = max(0, self.column - 60)
        shown = text[start:start + 120]
        prefix = "..." if start else ""
        carets = " " * (len(prefix) + self.column - 1 - start) + "^" * min(self.width, 120)
        return f"{head}\n  {prefix}{shown}\n  {carets}"
