"""IR invariants, checked between passes (and on any `.kap` read from disk).

Separate from the passes so that a pass that breaks an invariant is caught where it happens, and
so that a hand-edited `.kap` gets the same scrutiny as one the compiler wrote. Nothing here trusts
what it reads: sizes are bounded before anything is divided by them or allocated from them, so a
hostile module gets a list of problems, never a crash in a later pass. Given the module's
`SourceMap`, an error names the file, line and statement at fault, as a parse error does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from kapc.errors import KapcError
from kapc.intervals import union
from kapc.ir import Module
from kapc.limits import MAX_BATCH, MAX_BLOCK_SIZE, MAX_K, MAX_PROMPT_TOKENS
from kapc.parse import SourceMap
from kapc.policy import PolicyError, access_policy, access_problem, parse_accept

# Which statements each pass writes: a module that says a pass ran must hold them, and one that
# holds them must say it ran.
WRITES = {
    "align-spans": ("target", "prompt"),
    "select": ("select",),
    "resolve-pages": ("pages",),
    "compact": ("view", "verify", "access", "fallback", "cost"),
}
ORDER = ("ground", "align-spans", "select", "resolve-pages", "compact")
REQUIRES = {
    "select": ("ground", "align-spans"),
    "resolve-pages": ("select",),
    "compact": ("resolve-pages",),
}

Problem = tuple[tuple[str, int] | None, str]  # (statement: keyword and index, or None; message)


class CheckError(KapcError):
    pass


def check_module(m: Module, where: str = "", source: SourceMap | None = None) -> None:
    problems = list(_problems(m))
    if not problems:
        return
    at = f" ({where})" if where else ""
    messages = [msg for _, msg in problems]
    text = (
        f"invalid IR{at}: "
        + "; ".join(messages[:5])
        + (f"; and {len(messages) - 5} more" if len(messages) > 5 else "")
    )
    if source is not None:
        stmt = problems[0][0]
        text = source.error(text, *(stmt if stmt else ("kap", 0))).render()
    raise CheckError(text)


def _problems(m: Module) -> Iterator[Problem]:
    header = list(_header(m))
    if header:
        yield from header  # the stage checks below read the statements the header promises
        return
    yield from _request(m)
    ran = set(m.kap.passes)
    for name, check in (
        ("ground", _ground),
        ("align-spans", _align_spans),
        ("select", _select),
        ("resolve-pages", _pages),
        ("compact", _compact),
    ):
        if name in ran:
            problems = list(check(m))
            yield from problems
            if problems:
                return  # later stages are read through this one; their checks would mislead


def _header(m: Module) -> Iterator[Problem]:
    done: list[str] = []
    for p in m.kap.passes:
        if p not in ORDER:
            yield ("kap", 0), f"kap: unknown pass {p!r} in passes (passes: {', '.join(ORDER)})"
        elif p in done:
            yield ("kap", 0), f"kap: pass {p!r} listed twice in passes"
        else:
            missing = [r for r in REQUIRES.get(p, ()) if r not in done]
            if missing:
                yield ("kap", 0), f"kap: pass {p!r} listed before {', '.join(map(repr, missing))}"
        done.append(p)
    for p, keywords in WRITES.items():
        for kw in keywords:
            present = getattr(m, kw) is not None
            if p in done and not present:
                yield ("kap", 0), f"kap: passes lists {p!r}, but there is no {kw!r} statement"
            elif present and p not in done:
                yield (kw, 0), f"{kw}: written by {p!r}, which passes does not list"
    for kw in ("evidence", "span", "keep"):
        writer = {"evidence": "ground", "span": "align-spans", "keep": "select"}[kw]
        if getattr(m, kw) and writer not in done:
            yield (kw, 0), f"{kw}: written by {writer!r}, which passes does not list"


def _request(m: Module) -> Iterator[Problem]:
    segs = m.segments_by_id()
    if len(segs) != len(m.segment):
        yield ("segment", 0), "segment ids are not unique"
    passages = {s.id for s in m.segment if s.kind == "passage"}
    last_message = -1
    for i, s in enumerate(m.segment):
        if s.message < last_message or s.message > last_message + 1 or s.message < 0:
            yield ("segment", i), f"segment %{s.id}: message index {s.message} out of order"
        last_message = s.message
        if m.kap.request == "chat" and s.role == "none":
            yield ("segment", i), f"segment %{s.id}: a chat request needs a role"
    units: set[str] = set()
    for i, u in enumerate(m.unit):
        if u.id in units:
            yield ("unit", i), f"unit %{u.id}: id used twice"
        units.add(u.id)
        if u.kind == "passage" and u.segment not in passages:
            yield ("unit", i), f"unit %{u.id}: segment %{u.segment} is not a passage"
        for a in u.anchors:
            if a.segment not in passages:
                yield ("unit", i), f"unit %{u.id}: anchor on %{a.segment}, which is not a passage"
            elif not 0 <= a.start <= a.end <= len(segs[a.segment].text):
                yield ("unit", i), f"unit %{u.id}: anchor {a.start}..{a.end} outside %{a.segment}"
        for name, v in u.scores.items():
            if not math.isfinite(v):
                yield ("unit", i), f"unit %{u.id}: score {name} is not finite"


def _ground(m: Module) -> Iterator[Problem]:
    passages = sorted(s.id for s in m.segment if s.kind == "passage")
    units = {u.id for u in m.unit}
    if sorted(e.id for e in m.evidence) != passages:
        yield ("evidence", 0), "evidence does not list every passage exactly once"
    for i, e in enumerate(m.evidence):
        if not (math.isfinite(e.prior) and 0.0 <= e.prior <= 1.0):
            yield ("evidence", i), f"evidence %{e.id}: prior {e.prior} outside [0, 1]"
        for src in e.sources:
            if src not in units:
                yield ("evidence", i), f"evidence %{e.id}: source %{src} is not a unit"


def _align_spans(m: Module) -> Iterator[Problem]:
    prompt, t = m.prompt, m.target
    if prompt is None or t is None:
        return  # _header reports a stage's missing statements
    n, chars = prompt.tokens, prompt.chars
    if not 1 <= n <= MAX_PROMPT_TOKENS:
        yield ("prompt", 0), f"prompt: {n} tokens, outside 1..{MAX_PROMPT_TOKENS}"
        return
    if chars < 0:
        yield ("prompt", 0), f"prompt: {chars} characters"
    segs = m.segments_by_id()
    spans = m.spans_by_id()
    if set(spans) != set(segs) or len(spans) != len(m.span):
        yield ("span", 0), "there must be exactly one span per segment, in segment order"
    prev_end = 0
    for i, sp in enumerate(m.span):
        seg = segs.get(sp.id)
        if seg is not None and len(sp.chars) != len(seg.text):
            yield (
                ("span", i),
                (
                    f"span %{sp.id}: {len(sp.chars)} characters for a "
                    f"{len(seg.text)}-character segment"
                ),
            )
        if sp.chars.start < prev_end or sp.chars.end > chars:
            yield (
                ("span", i),
                (
                    f"span %{sp.id}: characters {sp.chars.start}..{sp.chars.end} "
                    f"overlap or leave the prompt"
                ),
            )
        prev_end = sp.chars.end
        if sp.tokens.end > n:
            yield (
                ("span", i),
                (f"span %{sp.id}: tokens {sp.tokens.start}..{sp.tokens.end} past the prompt ({n})"),
            )
    if t.parameters < 1 or t.kv_elements_per_token < 1:
        yield ("target", 0), "target: parameters and kv_elements_per_token must be positive"


def _select(m: Module) -> Iterator[Problem]:
    prompt, sel = m.prompt, m.select
    if prompt is None or sel is None:
        return  # _header reports a stage's missing statements
    n = prompt.tokens
    for i, k in enumerate(m.keep):
        if k.tokens.end > n:
            yield ("keep", i), f"keep {k.tokens.start}..{k.tokens.end} past the prompt"
    kept = sum(len(r) for r in union(k.tokens for k in m.keep))
    if kept != sel.kept:
        yield ("select", 0), f"select says {sel.kept} tokens kept, the keeps cover {kept}"
    if sel.kept > sel.budget:
        yield ("select", 0), f"select keeps {sel.kept} tokens, over the budget of {sel.budget}"
    if not 0 <= sel.mandatory <= sel.kept:
        yield (
            ("select", 0),
            f"select: mandatory tokens ({sel.mandatory}) outside 0..kept ({sel.kept})",
        )
    if kept == 0:
        yield ("select", 0), "select keeps no tokens: a proposal needs at least the prompt's tail"


def _pages(m: Module) -> Iterator[Problem]:
    p, prompt = m.pages, m.prompt
    if p is None or prompt is None:
        return  # _header reports a stage's missing statements
    n = prompt.tokens
    if not 1 <= p.block_size <= MAX_BLOCK_SIZE:
        yield ("pages", 0), f"pages: block size {p.block_size} outside 1..{MAX_BLOCK_SIZE}"
        return
    if p.blocks != -(-n // p.block_size):
        yield ("pages", 0), f"pages: {p.blocks} blocks for {n} tokens of block size {p.block_size}"
        return
    if (
        list(p.selected) != union(p.selected)
        or not p.selected
        or any(not len(r) for r in p.selected)
    ):
        yield ("pages", 0), "pages: selected block ranges must be ascending, disjoint and non-empty"
        return
    if p.selected[-1].end != p.blocks:
        yield ("pages", 0), "pages: the tail block (holding the last prompt token) must be selected"
        return
    if p.selected[0].start < 0:
        yield ("pages", 0), "pages: negative block"
        return
    width = sum(len(r) for r in p.selected)
    visible = (width - 1) * p.block_size + (n - (p.blocks - 1) * p.block_size)
    if visible != p.visible:
        yield (
            ("pages", 0),
            f"pages: visible is {p.visible}, the selected blocks hold {visible} prompt tokens",
        )
    for i, k in enumerate(m.keep):
        if len(k.tokens) and not any(
            r.start * p.block_size <= k.tokens.start and k.tokens.end <= r.end * p.block_size
            for r in p.selected
        ):
            yield (
                ("keep", i),
                (
                    f"pages: kept tokens {k.tokens.start}..{k.tokens.end} lie outside "
                    f"the selected blocks"
                ),
            )
    if not math.isfinite(p.retained) or abs(p.retained - round(visible / n, 6)) > 1e-12:
        yield ("pages", 0), f"pages: retained {p.retained} is not visible/tokens"


def _compact(m: Module) -> Iterator[Problem]:
    p, v, ver, fb, c = m.pages, m.view, m.verify, m.fallback, m.cost
    if p is None or v is None or ver is None or fb is None or c is None or m.access is None:
        return  # _header reports a stage's missing statements
    width = sum(len(r) for r in p.selected)
    if v.blocks != width or not width <= v.padded_blocks <= 2 * width:
        yield ("view", 0), "view: block count does not match the selected pages"
    if v.tail_block != p.blocks - 1 or v.tail_slot != (width - 1) * p.block_size:
        yield ("view", 0), "view: the tail block and slot are not the last prompt block's"
    try:
        parse_accept(ver.accept)
    except PolicyError:
        yield ("verify", 0), f"verify: accept={ver.accept} is not greedy or top2..top9"
    if not 1 <= ver.k <= MAX_K:
        yield ("verify", 0), f"verify: k={ver.k} outside 1..{MAX_K}"
    problem = access_problem(access_policy(m.access))
    if problem:
        yield ("access", 0), f"access: {problem}"
    if not (0.0 <= fb.max_retained <= 1.0 and 0.0 <= fb.min_acceptance <= 1.0):
        yield ("fallback", 0), "fallback: max_retained and min_acceptance must lie in [0, 1]"
    if not 1 <= fb.acceptance_window <= 1_000_000:
        yield (
            ("fallback", 0),
            f"fallback: acceptance_window {fb.acceptance_window} outside 1..1000000",
        )
    if (
        not all(math.isfinite(x) for x in (c.s, c.h, c.speedup))
        or c.speedup <= 0
        or not 0.0 <= c.h <= 1.0
    ):
        yield (
            ("cost", 0),
            f"cost: speedup {c.speedup} must be positive, s and h finite, h in [0, 1]",
        )
    if not 1 <= c.batch <= MAX_BATCH or c.k != ver.k or c.weight_bytes < 0 or c.kv_bytes < 0:
        yield ("cost", 0), "cost: batch outside 1..65536, k unlike verify's, or negative bytes"
