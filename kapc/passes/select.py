"""select: choose evidence units under a KV budget, keeping what decoding always needs.

Reads `evidence`, `prompt` and `span`. Always kept (mandatory): the first `sink` tokens (attention
sinks), every segment that is not a passage (instruction, question, free text), the chat template's
own tokens between segments, and the last `window` tokens. Passages are then taken whole, best
prior first (ties: earlier passage first), while they fit in what is left of the budget; a passage
that does not fit is skipped and smaller ones further down may still go in. Units, not pages: pages
are `resolve-pages`' business.

The budget is `budget-tokens`, or `budget-ratio` of the prompt when that is not given. A budget
that covers the whole prompt, or one below the mandatory tokens, is an error: both mean a plan
cannot help.

Evidence-driven selection: `keep-top=N` keeps at most the N best passages, and `min-prior=x`
only passages whose prior is at least x; the budget is then a ceiling, not a target. A fixed
fraction of the prompt grows with the context around the same evidence; the evidence does not,
so with these options s falls as the context grows (EarlySelectKV: 40% at 4K to 5.5% at 128K).
The more passages compete, the likelier a gold one ranks just below the N best: `keep-growth=g`
adds g passages to N for every doubling of the prompt's passages beyond `growth-from` (16), which
holds recall level while s still falls (docs/passes.md has the measurements).
"""

from __future__ import annotations

import dataclasses
import math

import msgspec
import numpy as np

from kapc import ir
from kapc.intervals import union
from kapc.limits import MAX_PROMPT_TOKENS
from kapc.passes.base import CompileContext, Pass, PassError


def separation(evidence, dropped) -> float | None:
    """How far the priors set the kept passages apart from the dropped: the mean prior of the
    kept minus the mean prior of the dropped, in the priors' own [0, 1] units (None where no
    passage was dropped). Flat priors, a frontend that found nothing to tell passages apart,
    give about 0: their pages are a guess, which the plan's prior-confidence rule refuses."""
    gone = set(dropped)
    kept = [e.prior for e in evidence if e.id not in gone]
    left = [e.prior for e in evidence if e.id in gone]
    if not left:
        return None
    return round((float(np.mean(kept)) if kept else 0.0) - float(np.mean(left)), 6)


@dataclasses.dataclass(frozen=True)
class Select(Pass):
    name = "select"
    requires = ("ground", "align-spans")
    budget_tokens: int = 0  # 0: use budget-ratio
    budget_ratio: float = 0.2
    sink: int = 4
    window: int = 32
    keep_top: int = 0  # 0: as many passages as the budget allows
    min_prior: float = 0.0
    keep_growth: float = 0.0  # passages added to keep-top per doubling of the passages ...
    growth_from: int = 16  # ... beyond this many

    def passage_cap(self, passages: int) -> int:
        """How many passages at most (0: no cap) for a prompt of `passages` passages."""
        if not self.keep_top:
            return 0
        doublings = math.log2(max(1.0, passages / self.growth_from))
        return self.keep_top + int(round(self.keep_growth * doublings))

    def budget(self, prompt_tokens: int) -> int:
        if self.budget_tokens:
            return self.budget_tokens
        return math.floor(self.budget_ratio * prompt_tokens)

    def option_problem(self) -> str | None:
        for name in ("budget_tokens", "sink", "window", "keep_top"):
            if not 0 <= getattr(self, name) <= MAX_PROMPT_TOKENS:
                return (
                    f"{name.replace('_', '-')} must be within 0..{MAX_PROMPT_TOKENS}, not "
                    f"{getattr(self, name)}"
                )
        if not 0.0 < self.budget_ratio <= 1.0:
            return f"budget-ratio must be within (0, 1], not {self.budget_ratio}"
        if not 0.0 <= self.min_prior <= 1.0:
            return f"min-prior must be within [0, 1] (priors are), not {self.min_prior}"
        if not 0.0 <= self.keep_growth <= 64.0:
            return f"keep-growth must be within [0, 64], not {self.keep_growth}"
        if not 1 <= self.growth_from <= MAX_PROMPT_TOKENS:
            return f"growth-from must be within 1..{MAX_PROMPT_TOKENS}, not {self.growth_from}"
        return None

    def run(self, module: ir.Module, ctx: CompileContext) -> ir.Module:
        n = ir.present(module.prompt, "prompt").tokens
        budget = self.budget(n)
        if budget >= n:
            raise PassError(
                f"select: the budget of {budget} tokens is not below the prompt's {n} tokens, so the "
                f"plan would read the whole KV cache; lower the budget or decode without a plan"
            )

        spans = module.spans_by_id()
        keeps: list[ir.Keep] = [ir.Keep(tokens=ir.Range(0, min(self.sink, n)), why="sink")]
        for seg in module.segment:
            if seg.kind != "passage":
                keeps.append(ir.Keep(id=seg.id, tokens=spans[seg.id].tokens, why=seg.kind))
        # Template tokens: whatever no segment covers (role headers, separators, generation prompt).
        pos = 0
        for r in union(s.tokens for s in module.span):
            if r.start > pos:
                keeps.append(ir.Keep(tokens=ir.Range(pos, r.start), why="template"))
            pos = r.end
        if pos < n:
            keeps.append(ir.Keep(tokens=ir.Range(pos, n), why="template"))
        keeps.append(ir.Keep(tokens=ir.Range(max(0, n - self.window), n), why="window"))
        # A token mask keeps the greedy loop linear in the prompt length (5,000 units at 128K tokens).
        mask = np.zeros(n, dtype=bool)
        for k in keeps:
            mask[k.tokens.start : k.tokens.end] = True
        mandatory = int(mask.sum())
        if mandatory > budget:
            raise PassError(
                f"select: the budget of {budget} tokens is below the {mandatory} tokens that must stay "
                f"visible (attention sink, instruction, question, template, recent window); raise the "
                f"budget or shrink sink/window"
            )

        order = sorted(enumerate(module.evidence), key=lambda ie: (-ie[1].prior, ie[0]))
        dropped = []
        used = mandatory
        taken = 0
        cap = self.passage_cap(len(module.evidence))
        for _, ev in order:
            span = spans[ev.id].tokens
            cost = len(span) - int(np.count_nonzero(mask[span.start : span.end]))
            wanted = (not cap or taken < cap) and ev.prior >= self.min_prior
            if wanted and used + cost <= budget:
                keeps.append(ir.Keep(id=ev.id, tokens=span, why="evidence", prior=ev.prior))
                mask[span.start : span.end] = True
                used += cost
                taken += 1
            else:
                dropped.append(ev.id)
        keeps.sort(key=lambda k: (k.tokens.start, k.tokens.end))
        select = ir.Select(
            budget=budget,
            kept=used,
            mandatory=mandatory,
            dropped=tuple(dropped),
            separation=separation(module.evidence, dropped),
        )
        return msgspec.structs.replace(module, select=select, keep=tuple(keeps))
