"""Pipelines as text (`ground,align-spans,select{budget-tokens=1024},resolve-pages,compact`):
parsing, ordering checks, and running passes with the IR checker between them."""

from __future__ import annotations

import dataclasses
import difflib
import re
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kapc import settings
from kapc.checker import check_module
from kapc.errors import KapcError, excerpt
from kapc.ir import Module
from kapc.parse import parse_module, print_module
from kapc.passes import DEFAULT_PIPELINE, PASSES, CompileContext, Pass


class PipelineError(KapcError):
    pass


_ITEM = re.compile(r"\s*([A-Za-z0-9_-]+)\s*(?:\{([^{}]*)\})?\s*(?:,|$)")


def parse_pipeline(text: str) -> list[Pass]:
    text = text.strip()
    passes, pos = [], 0
    while pos < len(text):
        m = _ITEM.match(text, pos)
        if not m or m.end() == pos:
            raise PipelineError(
                f"pipeline {excerpt(text)}: cannot read from column {pos + 1}: "
                f"{excerpt(text[pos:])}"
            )
        name, opts = m.group(1), m.group(2)
        if name not in PASSES:
            hint = difflib.get_close_matches(name, PASSES, n=1)
            raise PipelineError(
                f"unknown pass {excerpt(name)}"
                + (f"; did you mean {hint[0]!r}?" if hint else "")
                + f" (passes: {', '.join(PASSES)})"
            )
        passes.append(_build_pass(PASSES[name], opts or ""))
        pos = m.end()
    if not passes:
        raise PipelineError("empty pipeline")
    return passes


def _build_pass(cls: type[Pass], opts: str) -> Pass:
    hints = typing.get_type_hints(cls)
    names = {f.name.replace("_", "-"): f.name for f in dataclasses.fields(cls)}
    values = {}
    for item in filter(None, (o.strip() for o in opts.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in names:
            known = ", ".join(names) or "none"
            raise PipelineError(f"{cls.name}: unknown option {excerpt(item)} (options: {known})")
        typ = hints[names[key]]
        raw = raw.strip()
        try:
            if typing.get_origin(typ) in (typing.Union, types.UnionType):  # k=auto, ...=plan
                value = _number_or_word(raw, typing.get_args(typ))
            elif typ is bool:
                if raw not in ("true", "false"):
                    raise ValueError
                value = raw == "true"
            else:
                value = typ(raw)
        except ValueError:
            raise PipelineError(
                f"{cls.name}: option {key}={excerpt(raw)} is not a valid "
                f"{getattr(typ, '__name__', str(typ))}"
            ) from None
        values[names[key]] = value
    return cls(**values)


def _number_or_word(raw: str, types_: tuple) -> object:
    """An option typed `int | str` or `float | str`: the number where it reads as one."""
    for typ in (int, float):
        if typ in types_:
            try:
                return typ(raw)
            except ValueError:
                pass
    return raw


def pipeline_text(passes: list[Pass]) -> str:
    return ",".join(p.name + p.options_text() for p in passes)


def check_order(passes: list[Pass], already: tuple[str, ...] = ()) -> None:
    """Refuse a pipeline that runs a pass before what it requires, before running anything."""
    done = list(already)
    for p in passes:
        if p.name in done:
            raise PipelineError(f"pass {p.name!r} has already run on this module")
        missing = [r for r in p.requires if r not in done]
        if missing:
            raise PipelineError(
                f"pass {p.name!r} requires {', '.join(map(repr, missing))} to run before it"
            )
        done.append(p.name)


def remaining_default(module: Module) -> list[Pass]:
    """The default pipeline less what already ran: a `.kap` from any stage continues from there."""
    return [p for p in parse_pipeline(DEFAULT_PIPELINE) if p.name not in module.kap.passes]


@dataclass
class PassRecord:
    name: str
    seconds: float
    module: Module
    changed: bool


@dataclass
class PipelineResult:
    module: Module
    records: list[PassRecord] = field(default_factory=list)


def run_pipeline(
    module: Module,
    passes: list[Pass],
    ctx: CompileContext,
    *,
    verify: bool = True,
    roundtrip: bool | None = None,
    after_pass: Callable[[PassRecord], None] | None = None,
) -> PipelineResult:
    """Run `passes` in order. With `verify`, the IR checker runs after every pass and names the
    pass that broke an invariant; with `roundtrip` (or KAPC_CHECK_ROUNDTRIP=1) the IR is printed
    and re-parsed after every pass and must come back equal."""
    check_order(passes, module.kap.passes)
    roundtrip = settings.check_roundtrip() if roundtrip is None else roundtrip
    dump = settings.dump_dir()
    result = PipelineResult(module)
    if verify:
        check_module(module, where="the input")
    for i, p in enumerate(passes):
        t0 = time.perf_counter()
        out = p.run(module, ctx)
        out = msgspec.structs.replace(
            out, kap=msgspec.structs.replace(out.kap, passes=(*out.kap.passes, p.name))
        )
        seconds = time.perf_counter() - t0
        if verify:
            check_module(out, where=f"after pass {p.name!r}")
        if roundtrip:
            text = print_module(out)
            if parse_module(text, f"<after {p.name}>") != out:
                raise PipelineError(
                    f"round trip broken after pass {p.name!r}: the printed IR does "
                    f"not parse back to the same module"
                )
        if dump:
            Path(dump).mkdir(parents=True, exist_ok=True)
            (Path(dump) / f"{i:02d}-{p.name}.kap").write_text(print_module(out))
        record = PassRecord(p.name, seconds, out, changed=_changed(module, out))
        result.records.append(record)
        if after_pass:
            after_pass(record)
        module = out
    result.module = module
    return result


def _changed(before: Module, after: Module) -> bool:
    strip = lambda m: msgspec.structs.replace(m, kap=msgspec.structs.replace(m.kap, passes=()))  # noqa: E731
    return strip(before) != strip(after)
