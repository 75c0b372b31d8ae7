"""Progress reporting on stderr (rich): a spinner for one slow step, a bar for a loop."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from kapc import settings

T = TypeVar("T")


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _quiet() -> bool:
    return settings.quiet() or not sys.stderr.isatty()


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

    yield from rich_track(
        items, description=description, total=total, console=_console(), transient=True
    )


def steps(items: list[T], label: str, describe=str) -> Iterator[T]:
    """A progress bar on a terminal; elsewhere (a log file, CI) one line per item on stderr with
    the time left, so a run of hours can be followed with `tail -f`. KAPC_QUIET silences both."""
    if settings.quiet():
        yield from items
        return
    if sys.stderr.isatty():
        yield from track(items, label, total=len(items))
        return
    t0 = time.perf_counter()
    for j, item in enumerate(items):
        left = (time.perf_counter() - t0) / j * (len(items) - j) if j else 0.0
        eta = f", about {left / 60:.0f} min left" if left >= 60 else ""
        print(f"{label} {j + 1}/{len(items)}: {describe(item)}{eta}", file=sys.stderr, flush=True)
        yield item
