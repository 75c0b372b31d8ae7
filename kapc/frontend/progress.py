"""Progress reporting on stderr (rich): a spinner for one slow step, a bar for a loop."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def _console():
    from rich.console import Console
    return Console(stderr=True)


def _quiet() -> bool:
    return bool(os.environ.get("KAPC_QUIET")) or not sys.stderr.isatty()


@contextlib.contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner while a step that may take over a second runs (silent when stderr is no tty)."""
    if _quiet():
        yield
        return
    with _console().status(message):
        yield


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """A progress bar over `items` on stderr (silent when stderr is no tty)."""
    if _quiet():
        yield from items
        return
    from rich.progress import track as rich_track
    yield from rich_track(items, description=description, total=total, console=_console(),
                          transient=True)
