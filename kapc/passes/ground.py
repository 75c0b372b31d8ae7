"""ground: one prior per passage, from every score the frontend gave.

Reads `segment` and `unit`. Each score name is normalised to [0, 1] across the units that carry it
(min-max, or by rank with `norm=rank`), so that BM25's unbounded values and PPR's tiny ones weigh
alike. A passage's own part is the mean of its normalised scores; its graph part is the best
normalised score among the graph-derived units (nodes, triples, propositions) anchored in it.
With graph units present the prior is `(1 - graph-weight) * own + graph-weight * graph`.
Writes one `evidence` statement per passage segment, naming the units it came from.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import msgspec

from kapc import ir
from kapc.errors import excerpt
from kapc.passes.base import CompileContext, Pass


@dataclasses.dataclass(frozen=True)
class Ground(Pass):
    name = "ground"
    graph_weight: float = 0.5
    norm: str = "minmax"

    def option_problem(self) -> str | None:
        if self.norm not in ("minmax", "rank"):
            return f"norm must be minmax or rank, not {excerpt(self.norm)}"
        if not 0.0 <= self.graph_weight <= 1.0:
            return f"graph-weight must be within [0, 1], not {self.graph_weight}"
        return None

    def run(self, module: ir.Module, ctx: CompileContext) -> ir.Module:
        passages = [s.id for s in module.segment if s.kind == "passage"]
        own_units = [u for u in module.unit if u.kind == "passage"]
        graph_units = [u for u in module.unit if u.kind != "passage"]
        own_norm = _normalise(own_units, self.norm)
        graph_norm = _normalise(graph_units, self.norm)

        own: dict[str, list[float]] = defaultdict(list)
        sources: dict[str, list[str]] = defaultdict(list)
        for u in own_units:
            seg = ir.present(u.segment, "passage unit's segment")  # the checker sees to it
            own[seg].extend(own_norm[u.id])
            sources[seg].append(u.id)
        graph: dict[str, float] = defaultdict(float)
        for u in graph_units:
            best = max(graph_norm[u.id], default=0.0)
            for seg in dict.fromkeys(a.segment for a in u.anchors):
                graph[seg] = max(graph[seg], best)
                sources[seg].append(u.id)

        evidence = []
        for pid in passages:
            own_part = sum(own[pid]) / len(own[pid]) if own[pid] else 0.0
            prior = (
                own_part
                if not graph_units
                else (1 - self.graph_weight) * own_part + self.graph_weight * graph[pid]
            )
            # Six digits keep golden files readable and are far finer than any score's meaning.
            evidence.append(ir.Evidence(id=pid, prior=round(prior, 6), sources=tuple(sources[pid])))
        return msgspec.structs.replace(module, evidence=tuple(evidence))


def _normalise(units: list[ir.Unit], norm: str) -> dict[str, list[float]]:
    """unit id -> its scores, each normalised across all units carrying that score name."""
    by_name: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for u in units:
        for name, value in u.scores.items():
            by_name[name].append((u.id, value))
    out: dict[str, list[float]] = {u.id: [] for u in units}
    for values in by_name.values():
        if norm == "rank":
            order = sorted(values, key=lambda kv: kv[1])
            n = len(order)
            # Equal values share the rank of their first occurrence, so ties stay ties.
            first_rank: dict[float, int] = {}
            for i, (_, v) in enumerate(order):
                first_rank.setdefault(v, i)
            for uid, v in values:
                out[uid].append(first_rank[v] / (n - 1) if n > 1 else 1.0)
        else:
            # Halved first: scores near +-1e308 would overflow the difference to inf (then NaN).
            lo, hi = min(v for _, v in values) / 2, max(v for _, v in values) / 2
            for uid, v in values:
                out[uid].append((v / 2 - lo) / (hi - lo) if hi > lo else 1.0)
    return out
