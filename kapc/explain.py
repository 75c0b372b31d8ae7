"""`kapc explain`: the IR after every pass under one fixed header, plus a readable view of which
parts of the prompt each pass keeps. Every line that is not IR is a `#` comment, so each section
of the output (with --full-text) is itself a valid `.kap` file."""

from __future__ import annotations

from collections.abc import Sequence

from kapc.intervals import union
from kapc.ir import Module, present
from kapc.parse import print_module

ELIDE = 72  # long enough to keep fingerprints whole


def header(stage: str) -> str:
    return f"# ----- IR after {stage} ----- #"


def section(stage: str, module: Module, full_text: bool) -> str:
    body = print_module(module, elide=None if full_text else ELIDE)
    view = prompt_view(module)
    return "\n".join([header(stage), body.rstrip("\n"), *view]) + "\n"


def prompt_view(module: Module) -> list[str]:
    """A table of the prompt's segments: tokens, prior, and what the latest stage does with them."""
    if module.prompt is None:
        if not module.evidence:
            return []
        rows: list[tuple[str, ...]] = [("passage", "prior")]
        rows += [(f"%{e.id}", f"{e.prior:.3f}") for e in module.evidence]
        return _table("passages by prior (ground)", rows)
    prior = {e.id: e.prior for e in module.evidence}
    keeps = {}
    for k in module.keep:
        if k.id is not None:
            keeps[k.id] = k.why
    rows = [("segment", "kind", "tokens", "prior", "kept")]
    spans = module.spans_by_id()
    for seg in module.segment:
        span = spans[seg.id].tokens
        status = "-" if module.select is None else keeps.get(seg.id, "dropped")
        score = f"{prior[seg.id]:.3f}" if seg.id in prior else ""
        rows.append((f"%{seg.id}", seg.kind, f"{span.start}..{span.end}", score, status))
    lines = _table(f"prompt: {module.prompt.tokens} tokens", rows)
    if module.select is not None:
        kept = union(k.tokens for k in module.keep)
        lines.append(
            f"# select: {module.select.kept} of {module.prompt.tokens} tokens kept "
            f"({module.select.mandatory} mandatory), budget {module.select.budget}; "
            f"kept ranges " + " ".join(f"{r.start}..{r.end}" for r in kept)
        )
        sep = module.select.separation
        if sep is not None:
            floor = module.fallback.min_separation if module.fallback is not None else None
            lines.append(
                f"# select: the priors set the kept passages {sep:.3f} above the dropped "
                f"(mean prior)"
                + (
                    ""
                    if floor is None
                    else f"; under {floor:.3f} the runtime decodes with the "
                    f"full context (prior confidence)" + (": this plan does" if sep < floor else "")
                )
            )
    if module.pages is not None:
        p = module.pages
        width = sum(len(r) for r in p.selected)
        lines.append(
            f"# pages: {width} of {p.blocks} blocks of {p.block_size} tokens, "
            f"{p.visible} visible tokens, s = {p.retained:.3f}; map: {_block_map(module)}"
        )
    if module.cost is not None:
        lines += cost_view(module)
    return lines


def unmeasured_gain(cost) -> str | None:
    """A warning for a plan that predicts a gain from the paper's memory-bound model alone: on a
    CPU that model predicts gains where plans lose (docs/cost-model.md), so a user must not take
    it for a measurement. None when the prediction is measured, or is a loss."""
    if cost.basis != "memory-bound" or not cost.pays:
        return None
    return (
        f"the predicted {cost.speedup:.2f}x is the paper's memory-bound model, not a "
        "measurement: on CPUs it predicts gains where plans decode slower than full context "
        "(docs/cost-model.md). Run `kapc calibrate measure` once on this machine and compile with "
        "--engine, so the plan predicts from measured step times and the vLLM hook decides "
        "each step from them"
    )


def length_gist(pays_from: int) -> str:
    """`Cost.pays_from` in words."""
    if pays_from == 0:
        return "pays at no prompt length up to the model's positions"
    return f"pays from prompts of {pays_from:,} tokens"


def cost_view(module: Module) -> list[str]:
    """What the cost model predicts, and what would change its mind."""
    c, fallback = present(module.cost, "cost"), present(module.fallback, "fallback")
    verdict = (
        "pays off"
        if c.pays
        else "predicted loss: runtime falls back to full context"
        if fallback.on_predicted_loss
        else "predicted loss"
    )
    p = f" p={c.p:.3f} ->" if c.p is not None else ""
    # a query-aware proposal reads its access budget, not the plan's pages: the cost is of that
    a = module.access
    s, of = c.s, ""
    if a is not None and a.mode != "static" and a.budget is not None:
        s, of = a.budget, f" ({a.mode} view)"
    lines = [
        f"# cost ({c.basis}): k={c.k}{p} h={c.h:.3f}, h - s = {c.h - s:.3f}{of}, "
        f"batch={c.batch}"
        f" -> predicted speedup {c.speedup:.3f}x ({verdict})"
    ]
    floor = fallback.min_acceptance
    if c.break_even is not None:
        why = (
            f"the runtime stops drafting below {floor:.3f}"
            if c.basis != "memory-bound"
            else f"the runtime's floor stays {floor:.3f} (only a measured profile sets it to break-even)"
        )
        lines.append(
            f"# cost: breaks even at acceptance h = {c.break_even:.3f} for s = {s:.3f}"
            f" and k = {c.k}; {why}"
        )
    elif c.by_k:
        lines.append(f"# cost: no acceptance makes this plan pay at k = {c.k}")
    if c.pays_from is not None:
        lines.append(
            f"# cost: {length_gist(c.pays_from)} at s = {s:.3f}, k = {c.k}, batch = "
            f"{c.batch} (the paper's KV_crit; this prompt: {present(module.prompt, 'prompt').tokens:,})"
        )
    if c.by_k:
        lines.append(
            "# cost: predicted speedup by k: "
            + "  ".join(f"{k}:{v:.2f}" + ("*" if k == c.k else "") for k, v in enumerate(c.by_k, 1))
        )
    return lines


def _block_map(module: Module, width: int = 64) -> str:
    """One character per group of blocks: '#' all selected, '+' some, '.' none."""
    p = present(module.pages, "pages")
    chosen = [False] * p.blocks
    for r in p.selected:
        for b in range(r.start, r.end):
            chosen[b] = True
    group = max(1, -(-p.blocks // width))
    out = []
    for i in range(0, p.blocks, group):
        part = chosen[i : i + group]
        out.append("#" if all(part) else "+" if any(part) else ".")
    return "".join(out)


def _table(title: str, rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"# {title}"]
    for r in rows:
        lines.append("#   " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return lines
