"""Fuzz targets: one function per input boundary, each taking `bytes` and raising `Finding` when
kapc breaks its contract on that input.

The contract: every rejection of bad input is a `kapc.errors.KapcError` whose message carries a
location (`file:line:col` for .kap text, a JSON path `$...` for prior.json, a named reason for
.kapb). Anything else that escapes is a crash. Input that is accepted but wrong (a module that does
not print/re-parse to itself, a plan whose arrays disagree with its header, a pipeline option
outside its pass's domain) is a finding too.

Torch-free. The optional `deep` mode of `kap`, `prior` and `pipeline` compiles and lowers with the
default model context (needs the converted tokenizer in the kapc cache; slower).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import traceback
from pathlib import Path

import msgspec
import numpy as np

import kapc
from kapc.checker import CheckError, check_module
from kapc.errors import KapcError
from kapc.ingest import module_from_prior
from kapc.ir import Module
from kapc.lower.kapb import decode_plan, prompt_hash
from kapc.parse import parse_module, print_module
from kapc.passes import CompileContext
from kapc.pipeline import parse_pipeline, pipeline_text, run_pipeline
from kapc.prior import decode_prior, load_prior
from tests.fuzz import kapb_tools

ROOT = Path(__file__).resolve().parents[2]
KAPC_DIR = os.path.dirname(os.path.abspath(kapc.__file__)) + os.sep

PRIOR_SRC = "<fuzz>"
KAP_SRC = "<fuzz>.kap"
KAPB_SRC = "<fuzz>"


# ------------------------------------------------------------------------------------- findings


class Finding(AssertionError):
    """kapc broke its contract on an input. `signature` identifies the bug for deduplication:
    target | kind | (exception type + innermost kapc frame, or the name of the violated check)."""

    def __init__(
        self, target: str, kind: str, key: str, description: str, exc: BaseException | None = None
    ):
        self.target, self.kind, self.key, self.description = target, kind, key, description
        self.signature = f"{target}|{kind}|{key}"
        self.trace = "".join(traceback.format_exception(exc)) if exc is not None else ""
        super().__init__(f"[{self.signature}] {description}")


def kapc_frame(exc: BaseException) -> str:
    """The innermost traceback frame inside the kapc package, as `kapc/file.py:LINE (function)`;
    the innermost frame of all if none is in kapc."""
    frames = traceback.extract_tb(exc.__traceback__)
    inner = [f for f in frames if os.path.abspath(f.filename).startswith(KAPC_DIR)]
    f = inner[-1] if inner else (frames[-1] if frames else None)
    if f is None:
        return "?"
    name = os.path.relpath(f.filename, ROOT) if f.filename.startswith(str(ROOT)) else f.filename
    return f"{name}:{f.lineno} ({f.name})"


def template(message: str) -> str:
    """A message with its variable parts (quoted text, ids, numbers) blanked, for signatures."""
    msg = re.sub(r"(unknown field ).*?(?= - at `|$)", r"\1S", message, count=1, flags=re.S)
    msg = re.sub(r"`[^`]*`", "S", msg)  # msgspec quotes names (which may hold newlines)
    msg = re.sub(r"`.*", "S", msg.split("\n")[0])
    msg = re.sub(r"^<[^>]*>(:\d+:\d+)?: (error: )?", "", msg)
    msg = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', "S", msg)
    msg = re.sub(r"%[\w.:-]+", "%ID", msg)
    msg = re.sub(r"-?\b\d+(\.\d+)?([eE][-+]?\d+)?\b|\binf\b|\bnan\b", "N", msg)
    return msg[:140]


def crash(target: str, stage: str, exc: BaseException) -> Finding:
    msg = str(exc).split("\n")[0][:300]
    return Finding(
        target,
        "crash",
        f"{type(exc).__name__} at {kapc_frame(exc)}",
        f"{stage}: {type(exc).__name__} escaped (not a KapcError): {msg}",
        exc,
    )


def _stage(target: str, stage: str, fn, *args, **kwargs):
    """(result, None) or (None, KapcError); any other exception becomes a crash Finding."""
    try:
        return fn(*args, **kwargs), None
    except KapcError as exc:
        return None, exc
    except Exception as exc:  # noqa: BLE001 - that is the point
        raise crash(target, stage, exc) from None


def _no_location(target: str, stage: str, exc: KapcError, what: str) -> Finding:
    return Finding(
        target,
        "no-location",
        f"{type(exc).__name__} at {kapc_frame(exc)}: {template(str(exc))}",
        f"{stage} rejected the input but the message has no {what}: {str(exc)[:300]}",
        exc,
    )


def _pass_broke_invariant(target: str, exc: KapcError) -> Finding | None:
    if isinstance(exc, CheckError) and "after pass" in str(exc):
        return Finding(
            target,
            "wrong",
            f"pass broke an IR invariant: {template(str(exc))}",
            f"a pass produced invalid IR from a valid module: {str(exc)[:300]}",
            exc,
        )
    return None


# ------------------------------------------------------------------------------- shared checks


def _diff_key(a: Module, b: Module) -> str:
    for name in msgspec.structs.fields(Module):
        x, y = getattr(a, name.name), getattr(b, name.name)
        if x == y:
            continue
        if isinstance(x, tuple) and isinstance(y, tuple):
            if len(x) != len(y):
                return f"{name.name}[count]"
            for u, v in zip(x, y):
                if u != v:
                    fields = [
                        f.name
                        for f in msgspec.structs.fields(u)
                        if getattr(u, f.name) != getattr(v, f.name, object())
                    ]
                    return f"{name.name}.{','.join(fields) or '?'}"
        if isinstance(x, msgspec.Struct) and isinstance(y, msgspec.Struct):
            fields = [
                f.name
                for f in msgspec.structs.fields(x)
                if getattr(x, f.name) != getattr(y, f.name, object())
            ]
            return f"{name.name}.{','.join(fields) or '?'}"
        return name.name
    return "?"


def roundtrip(target: str, module: Module) -> None:
    """print_module must succeed, and its text must parse back to an equal module."""
    try:
        text = print_module(module)
    except Exception as exc:  # noqa: BLE001 - printing an accepted module must not fail at all
        raise crash(target, "print_module", exc) from None
    again, err = _stage(target, "re-parse printed IR", parse_module, text, "<reprint>.kap")
    if err is not None:
        raise Finding(
            target,
            "wrong",
            f"printed IR does not parse: {template(str(err))}",
            f"an accepted module prints as text that does not parse back: {str(err)[:400]}",
            err,
        )
    if again != module:
        key = _diff_key(module, again)
        raise Finding(
            target,
            "wrong",
            f"print/parse round trip changes {key}",
            f"an accepted module does not survive print_module/parse_module: {key} differs",
        )


_ACCEPT = re.compile(r"greedy|top[2-9]")


def _finite_in(v, lo, hi) -> bool:
    return (
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
        and lo <= v <= hi
    )


def plan_problems(data: bytes, plan) -> list[tuple[str, str]]:
    """(check name, detail) for every way a decoded plan disagrees with itself or its layout."""
    out: list[tuple[str, str]] = []
    h = plan.header
    head_end = kapb_tools.PREFIX.size + kapb_tools.PREFIX.unpack_from(data)[2]
    names = [r.name for r in h.arrays]
    if len(set(names)) != len(names):
        out.append(("layout: duplicate array name", f"names {names}"))
    spans = []
    for r in h.arrays:
        if r.offset < 0:
            out.append(("layout: negative array offset", f"{r.name} at {r.offset}"))
        if r.count < 0:
            out.append(("layout: negative array count", f"{r.name} count {r.count}"))
        if 0 <= r.offset < head_end:
            out.append(
                (
                    "layout: array overlaps the prefix/header",
                    f"{r.name} at {r.offset}, header ends at {head_end}",
                )
            )
        spans.append((r.offset, r.offset + 4 * max(r.count, 0), r.name))
    spans.sort()
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        if b0 < a1 and b1 > b0 and a1 > a0:
            out.append(("layout: arrays overlap", f"{an} {a0}..{a1} and {bn} {b0}..{b1}"))
    for r in h.arrays:
        arr = getattr(plan, r.name, None)
        if isinstance(arr, np.ndarray) and r.count >= 0 and arr.size != r.count:
            out.append(("layout: array size differs from its ref count", f"{r.name}"))
    if out:
        return out

    ids, sel, pos = plan.prompt_token_ids, plan.selected_blocks, plan.positions
    n, bs = h.prompt_tokens, h.block_size
    if n < 1:
        out.append(("prompt_tokens < 1", f"prompt_tokens={n}"))
    if ids.size != n:
        out.append(("len(prompt_token_ids) != header.prompt_tokens", f"{ids.size} != {n}"))
    if ids.size and int(ids.min()) < 0:
        out.append(("negative token id", f"min {int(ids.min())}"))
    if prompt_hash(ids) != h.prompt_hash:
        out.append(("prompt_hash does not match prompt_token_ids", h.prompt_hash[:24]))
    if bs < 1:
        out.append(("block_size < 1", f"block_size={bs}"))
        return out
    s = [int(x) for x in sel[:100_000]]
    if not s:
        out.append(("selected_blocks empty", ""))
    elif any(b >= c for b, c in zip(s, s[1:])):
        out.append(("selected_blocks not strictly ascending", f"{s[:20]}"))
    elif s[0] < 0:
        out.append(("selected_blocks has a negative block", f"{s[:5]}"))
    elif n >= 1 and s[-1] != (n - 1) // bs:
        out.append(
            (
                "selected_blocks does not end at the tail block",
                f"last {s[-1]}, tail {(n - 1) // bs}",
            )
        )
    elif n >= 1:
        visible = sum(max(0, min(bs, n - b * bs)) for b in s)
        if visible != pos.size:
            out.append(
                (
                    "positions are not the visible tokens of the selected blocks",
                    f"{pos.size} positions, the blocks hold {visible}",
                )
            )
        elif visible <= 10_000_000:
            want = np.concatenate([np.arange(b * bs, min((b + 1) * bs, n)) for b in s])
            if not np.array_equal(want, pos):
                out.append(
                    (
                        "positions are not the visible tokens of the selected blocks",
                        "same count, other values",
                    )
                )
    if h.visible_prompt_tokens != pos.size:
        out.append(
            (
                "header.visible_prompt_tokens != len(positions)",
                f"{h.visible_prompt_tokens} != {pos.size}",
            )
        )
    if n >= 1 and not (
        math.isfinite(h.retained_ratio) and abs(h.retained_ratio - pos.size / n) <= 1e-6
    ):
        out.append(("retained_ratio != visible/prompt_tokens", f"{h.retained_ratio}"))
    if h.padded_blocks < sel.size:
        out.append(("padded_blocks < number of selected blocks", f"{h.padded_blocks} < {sel.size}"))
    if h.k < 1:
        out.append(("k < 1", f"k={h.k}"))
    if not _ACCEPT.fullmatch(h.accept):
        out.append(("accept is not greedy/top2..top9", repr(h.accept)))
    f, c = h.fallback, h.cost
    if not _finite_in(f.max_retained, 0, 1):
        out.append(("fallback.max_retained outside [0, 1]", f"{f.max_retained}"))
    if not _finite_in(f.min_acceptance, 0, 1):
        out.append(("fallback.min_acceptance outside [0, 1]", f"{f.min_acceptance}"))
    if f.acceptance_window < 1:
        out.append(("fallback.acceptance_window < 1", f"{f.acceptance_window}"))
    cost = f"cost {msgspec.to_builtins(c)}"
    if not (_finite_in(c.speedup, 0, math.inf) and c.speedup > 0):
        out.append(("cost.speedup non-finite or not positive", cost))
    if not _finite_in(c.s, 0, 1):
        out.append(("cost.s outside [0, 1]", cost))
    elif n >= 1 and abs(c.s - h.retained_ratio) > 1e-6:
        out.append(("cost.s != retained_ratio", f"{cost}, retained_ratio {h.retained_ratio}"))
    if not _finite_in(c.h, 0, 1):
        out.append(("cost.h outside [0, 1]", cost))
    if c.batch < 1:
        out.append(("cost.batch < 1", cost))
    if c.k != h.k:
        out.append(("cost.k != header.k", f"{cost}, k {h.k}"))
    if c.weight_bytes < 0 or c.kv_bytes < 0:
        out.append(("cost.weight_bytes/kv_bytes negative", cost))
    return out


def check_plan(target: str, data: bytes, *, from_compiler: bool = False) -> None:
    plan, err = _stage(target, "decode_plan", decode_plan, data, KAPB_SRC)
    if err is not None:
        if from_compiler:
            raise Finding(
                target,
                "wrong",
                f"lowered plan does not decode: {template(str(err))}",
                f"lower_module wrote a plan decode_plan refuses: {err}",
                err,
            )
        if not str(err).startswith(f"{KAPB_SRC}: "):
            raise _no_location(target, "decode_plan", err, "source/reason")
        return
    try:
        problems = plan_problems(data, plan)
    except Exception as exc:  # noqa: BLE001 - a header whose fields have impossible types
        raise crash(
            target, "plan consistency check (harness; header holds odd values)", exc
        ) from None
    if problems:
        name, detail = problems[0]
        more = (
            f" (and {len(problems) - 1} more: {', '.join(p[0] for p in problems[1:4])})"
            if len(problems) > 1
            else ""
        )
        who = "lower_module wrote" if from_compiler else "decode_plan accepted"
        raise Finding(
            target, "wrong", f"plan: {name}", f"{who} an inconsistent plan: {name}: {detail}{more}"
        )


@functools.lru_cache(maxsize=1)
def model_ctx() -> CompileContext:
    ctx = CompileContext()
    ctx.assets  # noqa: B018 - load (and convert once) up front
    return ctx


def deep_compile(target: str, module: Module, passes: str | None = None) -> None:
    """Compile the module (the default pipeline less what ran, or `passes`) with the default
    model, lower it, and check the plan. Pass errors are fine; crashes and bad plans are not."""
    from kapc.compiler import compile_module
    from kapc.lower.lower import lower_module

    ctx = model_ctx()
    res, err = _stage(
        target, "compile_module", compile_module, module, passes, ctx, roundtrip=False
    )
    if err is not None:
        broke = _pass_broke_invariant(target, err)
        if broke:
            raise broke
        return
    roundtrip(target, res.module)
    if "compact" not in res.module.kap.passes:
        return
    data, err = _stage(target, "lower_module", lower_module, res.module, ctx)
    if err is None:
        check_plan(target, data, from_compiler=True)


# ------------------------------------------------------------------------------------ targets


def _has_json_path(message: str) -> bool:
    rest = message[len(PRIOR_SRC) + 2 :] if message.startswith(PRIOR_SRC + ": ") else ""
    return (
        "$" in rest
        or rest.startswith("not valid JSON")
        or bool(re.search(r"\bline \d+, column \d+", rest))
    )


def prior(data: bytes, *, deep: bool = False) -> None:
    """decode_prior -> module_from_prior -> check_module -> ground -> print/parse round trip.
    Once decode_prior accepts a prior, any later rejection is a finding (`late-reject`): the
    prior's validation is the place that must name the JSON path."""
    p, err = _stage("prior", "decode_prior", decode_prior, data, PRIOR_SRC)
    if err is not None:
        if not _has_json_path(str(err)):
            raise _no_location("prior", "decode_prior", err, "JSON path ($...)")
        return

    def late(stage: str, exc: KapcError) -> Finding:
        return _pass_broke_invariant("prior", exc) or Finding(
            "prior",
            "late-reject",
            f"{type(exc).__name__} at {kapc_frame(exc)}: {template(str(exc))}",
            f"decode_prior accepted the prior but {stage} rejected it (no JSON path): "
            f"{str(exc)[:300]}",
            exc,
        )

    module, err = _stage("prior", "module_from_prior", module_from_prior, p)
    if err is not None:
        raise late("module_from_prior", err)
    _, err = _stage("prior", "check_module", check_module, module, "ingest")
    if err is not None:
        raise late("check_module", err)
    res, err = _stage(
        "prior",
        "ground",
        run_pipeline,
        module,
        parse_pipeline("ground"),
        CompileContext(),
        roundtrip=False,
    )
    if err is not None:
        raise late("the ground pass", err)
    roundtrip("prior", res.module)
    if deep:
        deep_compile("prior", res.module)


_KAP_LOC = re.compile(r"<fuzz>\.kap:(\d+):(\d+): error: ")


def kap(data: bytes, *, deep: bool = False, surrogatepass: bool = False) -> None:
    """UTF-8 text -> parse_module -> check_module -> print/parse round trip. Parse errors must
    carry `<fuzz>.kap:LINE:COL` inside the text (lines counted by "\\n", like the parser)."""
    try:
        text = data.decode("utf-8", "surrogatepass" if surrogatepass else "strict")
    except UnicodeDecodeError:
        return
    module, err = _stage("kap", "parse_module", parse_module, text, KAP_SRC)
    if err is not None:
        m = _KAP_LOC.match(str(err))
        if not m:
            raise _no_location("kap", "parse_module", err, "file:line:col")
        line, col = int(m.group(1)), int(m.group(2))
        lines = text.split("\n")
        if not (1 <= line <= len(lines) and 1 <= col <= len(lines[line - 1]) + 1):
            raise Finding(
                "kap",
                "wrong",
                f"error location outside the text: {template(str(err))}",
                f"parse error points at {line}:{col}, but the text has {len(lines)} "
                f"line(s) (by \\n): {str(err)[:200]}",
                err,
            )
        return
    _, err = _stage("kap", "check_module", check_module, module, KAP_SRC)
    if err is not None:
        if KAP_SRC not in str(err):
            raise _no_location("kap", "check_module", err, "file name")
        return
    roundtrip("kap", module)
    if deep:
        deep_compile("kap", module)


def kapb(data: bytes) -> None:
    """decode_plan, then the arrays must agree with the header and the layout must be sane."""
    check_plan("kapb", data)


# pipeline: the domain of every option, as its pass documents it (and as .kapb can store it)
_I64 = 2**63


def _int_in(lo, hi=_I64 - 1):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


DOMAINS = {
    "ground": {
        "graph_weight": lambda v: _finite_in(v, 0, 1),
        "norm": lambda v: v in ("minmax", "rank"),
    },
    "align-spans": {},
    "select": {
        "budget_tokens": _int_in(0),
        "budget_ratio": lambda v: _finite_in(v, 1e-300, 1),
        "sink": _int_in(0),
        "window": _int_in(0),
    },
    "resolve-pages": {"block_size": _int_in(1, 2**31 - 1)},
    "compact": {
        "k": _int_in(1, 2**31 - 1),
        "accept": lambda v: bool(_ACCEPT.fullmatch(v)),
        "expect_acceptance": lambda v: _finite_in(v, 0, 1),
        "batch": _int_in(1),
        "dtype_bytes": _int_in(1, 64),
        "max_retained": lambda v: _finite_in(v, 0, 1),
        "min_acceptance": lambda v: _finite_in(v, 0, 1),
        "acceptance_window": _int_in(1),
        "on_predicted_loss": lambda v: isinstance(v, bool),
    },
}

# what each pass runs on when the pipeline target runs it alone (align-spans needs the model)
_STAGE_BEFORE = {"ground": 0, "select": 2, "resolve-pages": 3, "compact": 4}
_PLAN_FILES = {
    2: "q0000-small.2-align-spans.kap",
    3: "q0000-small.3-select.kap",
    4: "q0000-small.4-resolve-pages.kap",
}


@functools.cache
def stage_module(stage: int) -> Module:
    if stage == 0:
        return module_from_prior(load_prior(ROOT / "tests/compiler/inputs/q0000-small.prior.json"))
    path = ROOT / "plans" / _PLAN_FILES[stage]
    return parse_module(path.read_text(encoding="utf-8"), str(path))


def _opts(p) -> str:
    return repr(p)  # nan-aware enough: repr(nan) == 'nan' on both sides


def pipeline(data: bytes, *, deep: bool = False) -> None:
    """parse_pipeline; each parsed pass run alone on the example at the stage before it; the
    result must check, print and re-parse; pipeline_text must re-parse to the same passes; and
    every option value parse_pipeline accepts must lie in the pass's domain."""
    text = data.decode("utf-8", "replace")
    passes, err = _stage("pipeline", "parse_pipeline", parse_pipeline, text)
    if err is not None:
        return
    for p in passes:
        stage = _STAGE_BEFORE.get(p.name)
        if stage is None:
            continue
        res, err = _stage(
            "pipeline",
            f"run {p.name}",
            run_pipeline,
            stage_module(stage),
            [p],
            CompileContext(),
            roundtrip=False,
        )
        if err is not None:
            broke = _pass_broke_invariant("pipeline", err)
            if broke:
                raise broke
            continue
        roundtrip("pipeline", res.module)
    again, err = _stage(
        "pipeline", "parse_pipeline(pipeline_text)", parse_pipeline, pipeline_text(passes)
    )
    if err is not None or [_opts(p) for p in again] != [_opts(p) for p in passes]:
        raise Finding(
            "pipeline",
            "wrong",
            "pipeline_text does not re-parse to the same passes",
            f"{text!r} -> {pipeline_text(passes)!r} -> "
            f"{err if err is not None else [_opts(p) for p in again]}",
        )
    run_rejects = {}
    for p in passes:
        domain = DOMAINS.get(p.name, {})
        for opt, ok in domain.items():
            value = getattr(p, opt)
            if ok(value):
                continue
            if p.name not in run_rejects:
                stage = _STAGE_BEFORE.get(p.name)
                if stage is None:
                    run_rejects[p.name] = "not run"
                else:
                    try:
                        run_pipeline(stage_module(stage), [p], CompileContext(), roundtrip=False)
                        run_rejects[p.name] = "run accepts it too"
                    except KapcError:
                        run_rejects[p.name] = "run() rejects it"
                    except Exception:  # noqa: BLE001
                        run_rejects[p.name] = "run() crashes"
            raise Finding(
                "pipeline",
                "wrong",
                f"parse_pipeline accepts {p.name}.{opt} out of domain ({run_rejects[p.name]})",
                f"{text!r}: {p.name}{{{opt.replace('_', '-')}={value!r}}} is outside the "
                f"option's domain, yet parse_pipeline accepts it; {run_rejects[p.name]}",
            )
    if deep:
        if passes[0].name == "ground":
            deep_compile("pipeline", stage_module(0), pipeline_text(passes))


TARGETS = {"prior": prior, "kap": kap, "kapb": kapb, "pipeline": pipeline}
OPTIONS = {"prior": ("deep",), "kap": ("deep", "surrogatepass"), "kapb": (), "pipeline": ("deep",)}


def run(target: str, data: bytes, **options) -> None:
    TARGETS[target](data, **{k: v for k, v in options.items() if k in OPTIONS[target] and v})


def signature_hash(signature: str, options: dict | None = None) -> str:
    opts = {k: v for k, v in (options or {}).items() if v}
    key = signature + (json.dumps(opts, sort_keys=True) if opts else "")
    return hashlib.sha256(key.encode()).hexdigest()[:16]
