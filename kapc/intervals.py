"""Half-open integer ranges: union and covered length, shared by passes, checker and lowering."""

from __future__ import annotations

from collections.abc import Iterable

from kapc.ir import Range


def union(ranges: Iterable[Range]) -> list[Range]:
    """Sorted, disjoint, non-touching ranges covering the same integers; empty ranges vanish."""
    out: list[Range] = []
    for r in sorted((r for r in ranges if r.end > r.start), key=lambda r: r.start):
        if out and r.start <= out[-1].end:
            if r.end > out[-1].end:
                out[-1] = Range(out[-1].start, r.end)
        else:
            out.append(r)
    return out


def covered(ranges: Iterable[Range]) -> int:
    return sum(len(r) for r in union(ranges))
