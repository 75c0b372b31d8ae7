"""IR invariants, checked between passes (and on any `.kap` read from disk).

Separate from the passes so that a pass that breaks an invariant is caught where it happens, and
so that a hand-edited `.kap` gets the same scrutiny as one the compiler wrote."""

from __future__ import annotations

import math
import re

from kapc.intervals import union
from kapc.ir import Module
from kapc.errors import KapcError


class CheckError(KapcError):
    pass


def check_module(m: Module, where: str = "") -> None:
    problems = list(_problems(m))
    if problems:
        at = f" ({where})" if where else ""
        raise CheckError(f"invalid IR{at}: " + "; ".join(problems[:5])
                         + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))


def _problems(m: Module):  # noqa: C901 - one flat list of rules reads better than many helpers
    segs = m.segments_by_id()
    if len(segs) != len(m.segment):
        yield "segment ids are not unique"
    passages = {s.id for s in m.segment if s.kind == "passage"}
    last_message = -1
    for s in m.segment:
        if s.message < last_message or s.message > last_message + 1:
            yield f"segment %{s.id}: message index {s.message} out of order"
        last_message = s.message
        if m.kap.request == "chat" and s.role == "none":
            yield f"segment %{s.id}: a chat request needs a role"
    units = {}
    for u in m.unit:
        if u.id in units:
            yield f"unit %{u.id}: id used twice"
        units[u.id] = u
        if u.kind == "passage" and u.segment not in passages:
            yield f"unit %{u.id}: segment %{u.segment} is not a passage"
        for a in u.anchors:
            if a.segment not in passages:
                yield f"unit %{u.id}: anchor on %{a.segment}, which is not a passage"
            elif not 0 <= a.start <= a.end <= len(segs[a.segment].text):
                yield f"unit %{u.id}: anchor {a.start}..{a.end} outside %{a.segment}"
        for name, v in u.scores.items():
            if not math.isfinite(v):
                yield f"unit %{u.id}: score {name} is not finite"
    ran = set(m.kap.passes)

    if "ground" in ran:
        ev_ids = [e.id for e in m.evidence]
        if sorted(ev_ids) != sorted(passages):
            yield "evidence does not list every passage exactly once"
        for e in m.evidence:
            if not (math.isfinite(e.prior) and 0.0 <= e.prior <= 1.0):
                yield f"evidence %{e.id}: prior {e.prior} outside [0, 1]"
            for src in e.sources:
                if src not in units:
                    yield f"evidence %{e.id}: source %{src} is not a unit"

    if "align-spans" in ran:
        if m.prompt is None or m.target is None:
            yield "align-spans ran but there is no prompt/target"
            return
        n, chars = m.prompt.tokens, m.prompt.chars
        spans = m.spans_by_id()
        if set(spans) != set(segs) or len(spans) != len(m.span):
            yield "there must be exactly one span per segment"
        prev_end = 0
        for sp in m.span:
            seg = segs.get(sp.id)
            if seg is not None and len(sp.chars) != len(seg.text):
                yield f"span %{sp.id}: {len(sp.chars)} characters for a {len(seg.text)}-character segment"
            if sp.chars.start < prev_end or sp.chars.end > chars:
                yield f"span %{sp.id}: characters {sp.chars.start}..{sp.chars.end} overlap or leave the prompt"
            prev_end = sp.chars.end
            if sp.tokens.end > n:
                yield f"span %{sp.id}: tokens {sp.tokens.start}..{sp.tokens.end} past the prompt ({n})"

    if "select" in ran:
        if m.select is None:
            yield "select ran but there is no select statement"
            return
        for k in m.keep:
            if k.tokens.end > m.prompt.tokens:
                yield f"keep {k.tokens.start}..{k.tokens.end} past the prompt"
        kept = sum(len(r) for r in union(k.tokens for k in m.keep))
        if kept != m.select.kept:
            yield f"select says {m.select.kept} tokens kept, the keeps cover {kept}"
        if m.select.kept > m.select.budget:
            yield f"select keeps {m.select.kept} tokens, over the budget of {m.select.budget}"
        if m.select.mandatory > m.select.kept:
            yield "select: mandatory tokens exceed kept tokens"

    if "resolve-pages" in ran:
        p = m.pages
        if p is None:
            yield "resolve-pages ran but there is no pages statement"
            return
        n = m.prompt.tokens
        if p.blocks != -(-n // p.block_size):
            yield f"pages: {p.blocks} blocks for {n} tokens of block size {p.block_size}"
        if list(p.selected) != union(p.selected) or not p.selected:
            yield "pages: selected block ranges must be ascending, disjoint and non-empty"
        elif p.selected[-1].end != p.blocks:
            yield "pages: the tail block (holding the last prompt token) must be selected"
        else:
            if p.selected[0].start < 0:
                yield "pages: negative block"
            width = sum(len(r) for r in p.selected)
            visible = (width - 1) * p.block_size + (n - (p.blocks - 1) * p.block_size)
            if visible != p.visible:
                yield f"pages: visible is {p.visible}, the selected blocks hold {visible} prompt tokens"
            blocks = union(p.selected)
            for k in m.keep:
                if len(k.tokens) and not any(r.start * p.block_size <= k.tokens.start and
                                             k.tokens.end <= r.end * p.block_size for r in blocks):
                    # a keep may span adjacent selected runs only if they are one run; union merged them
                    yield f"pages: kept tokens {k.tokens.start}..{k.tokens.end} lie outside the selected blocks"
            if abs(p.retained - round(p.visible / n, 6)) > 1e-12:
                yield f"pages: retained {p.retained} is not visible/tokens"

    if "compact" in ran:
        if None in (m.view, m.verify, m.fallback, m.cost):
            yield "compact ran but view/verify/fallback/cost is missing"
            return
        width = sum(len(r) for r in m.pages.selected)
        if m.view.blocks != width or m.view.padded_blocks < width:
            yield "view: block count does not match the selected pages"
        if m.view.tail_block != m.pages.blocks - 1:
            yield "view: tail block is not the last prompt block"
        if not re.fullmatch(r"greedy|top[2-9]", m.verify.accept) or m.verify.k < 1:
            yield f"verify: k={m.verify.k} accept={m.verify.accept} is not a valid policy"
        if not math.isfinite(m.cost.speedup) or m.cost.speedup <= 0:
            yield f"cost: speedup {m.cost.speedup} is not a positive number"
