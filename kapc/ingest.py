"""Turn a `prior.json` into the first `.kap` module: the request's segments and the frontend's
evidence units, nothing derived yet."""

from __future__ import annotations

from kapc import ir
from kapc.prior import Prior


def module_from_prior(prior: Prior) -> ir.Module:
    req = prior.request
    segments: list[ir.Segment] = []
    named = {s.id for m in (req.messages or []) for s in m.segments} | {s.id for s in req.raw or []}
    auto = 0

    def seg_id(seg) -> str:
        nonlocal auto
        if seg.id is not None:
            return seg.id
        while f"_s{auto}" in named:  # never collide with a frontend's own id
            auto += 1
        auto += 1
        return f"_s{auto - 1}"

    if req.messages is not None:
        for m, msg in enumerate(req.messages):
            for seg in msg.segments:
                segments.append(
                    ir.Segment(
                        id=seg_id(seg),
                        message=m,
                        role=msg.role,
                        kind=seg.kind,
                        title=seg.title,
                        text=seg.text,
                    )
                )
    else:
        for seg in req.raw or []:
            segments.append(
                ir.Segment(id=seg_id(seg), kind=seg.kind, title=seg.title, text=seg.text)
            )

    units = tuple(
        ir.Unit(
            id=u.id,
            kind=u.kind,
            segment=u.segment,
            text=u.text,
            anchors=tuple(ir.Anchor(a.segment, a.start, a.end) for a in u.anchors),
            scores=dict(u.scores),
        )
        for u in prior.units
    )
    header = ir.Header(name=prior.name, request="chat" if req.messages is not None else "raw")
    return ir.Module(kap=header, segment=tuple(segments), unit=units)
