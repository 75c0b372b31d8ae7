"""Structured fuzzing with hypothesis: generators that build valid-ish inputs with adversarial
values, run through the same targets as atheris, findings recorded the same way.

    python -m tests.fuzz.hypothesis_run TARGET --count N [--deep] [--surrogatepass] [--seed S]

prior     priors built from the prior.json Structs with adversarial values (deep nesting in
          frontend.params / meta, huge and non-finite numbers, lone surrogates, ids ending in
          "\\n", U+2028 / U+0085 / form feed, empty messages and segments, duplicate ids, anchors
          out of range), and the example priors with values replaced at random JSON paths;
kap       .kap text printed from valid modules at every stage (plans/*.kap, and every example
          prior through every pass with the default model), then mutated token by token;
kapb      plans compiled from the examples (the kapb seed corpus), mutated and re-sealed;
pipeline  pipeline strings with adversarial option values.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import re
import sys
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
FUZZ = ROOT / "tests" / "fuzz"

# ------------------------------------------------------------------------------------- JSON


class Raw(str):
    """Pre-rendered JSON text (deep nesting is rendered without recursion)."""


class Pairs(list):
    """A JSON object as (key, value) pairs, so that keys may repeat."""


INF = float("inf")


def to_json(v, ascii_only: bool = True) -> str:
    if isinstance(v, Raw):
        return str(v)
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "1e999"  # JSON has no nan; this decodes to inf
        if math.isinf(v):
            return "1e999" if v > 0 else "-1e999"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=ascii_only)  # lone surrogates become "\ud800"
    if isinstance(v, Pairs):
        return "{" + ",".join(f"{json.dumps(k)}:{to_json(x, ascii_only)}" for k, x in v) + "}"
    if isinstance(v, dict):
        return (
            "{" + ",".join(f"{json.dumps(k)}:{to_json(x, ascii_only)}" for k, x in v.items()) + "}"
        )
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(to_json(x, ascii_only) for x in v) + "]"
    raise TypeError(type(v))


def encode(doc, ascii_only: bool) -> bytes:
    text = to_json(doc, ascii_only)
    return text.encode("utf-8", "surrogatepass")


# --------------------------------------------------------------------------------- priors

WEIRD = [
    "\n",
    "\r",
    "\t",
    "\x00",
    "\x01",
    "\x0b",
    "\x0c",
    "\x1c",
    "\x1e",
    "\x7f",
    "\x85",
    "\u2028",
    "\u2029",
    "\ufeff",
    "\ud800",
    "\udfff",
    '"',
    "\\",
    "%",
    "@",
    "#",
    "{",
    "}",
    "[",
    "]",
    "=",
    ",",
    ".",
    " ",
    "é",
    "中",
    "\U0001f600",
    "<|im_end|>",
    "<|im_start|>",
]


def mostly(good, bad, odds: int = 7):
    """`good` about odds/(odds+1) of the time, else `bad` (one_of picks branches evenly)."""
    return st.one_of(*([good] * odds), bad)


texts_any = st.lists(st.sampled_from(WEIRD) | st.text(max_size=6), max_size=8).map("".join)
safe_texts = texts_any.filter(lambda t: not any(0xD800 <= ord(c) < 0xE000 for c in t))
texts = mostly(safe_texts, texts_any, 5)
ID_POOL = ["p0", "p1", "p2", "_s0", "_s1", "n0", "t0", "x", "p0\n", "p1\n", "a.b:c-d", "A" * 200]
BAD_IDS = ["A" * 201, "0bad", "", "p 0", "p0\u2028", "p0\n\n"]
ids = mostly(
    st.sampled_from(ID_POOL),
    st.sampled_from(BAD_IDS) | st.from_regex(r"[A-Za-z_][A-Za-z0-9_.:-]{0,6}", fullmatch=True),
    5,
)
EVIL_NUMS = [
    INF,
    -INF,
    1e308,
    -1e308,
    1.7976931348623157e308,
    5e-324,
    -0.0,
    0.0,
    1e-300,
    2.0**53,
    2**53 + 1,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    -1,
    0,
    1,
]
numbers = st.sampled_from(EVIL_NUMS) | st.floats(allow_nan=False) | st.integers(-(10**20), 10**20)
small_ints = mostly(
    st.integers(0, 60), st.sampled_from([-1, 2**31, 2**63, 2**64, 10**30, -(2**63) - 1])
)
KINDS = ["instruction", "question", "passage", "text"]
UKINDS = ["passage", "node", "triple", "proposition"]


def deep_raw(depth: int, kind: int) -> Raw:
    if kind == 0:
        return Raw("[" * depth + "]" * depth)
    if kind == 1:
        return Raw('{"a":' * depth + "0" + "}" * depth)
    return Raw('[{"a":' * depth + "null" + "}]" * depth)


json_leaf = st.none() | st.booleans() | numbers | texts
json_any = st.recursive(
    json_leaf,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(texts, c, max_size=3),
    max_leaves=8,
)
params = json_any | st.builds(
    deep_raw, st.sampled_from([10, 100, 200, 500, 1000, 3000, 20000]), st.integers(0, 2)
)

segment = st.fixed_dictionaries(
    {"text": st.one_of(safe_texts, safe_texts, safe_texts, texts)},
    optional={
        "kind": st.sampled_from(KINDS * 4 + ["passage"] * 6 + ["bogus"]),
        "id": ids,
        "title": st.none() | texts,
    },
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"] * 5 + ["tool"]),
        "segments": mostly(st.lists(segment, min_size=1, max_size=4), st.just([]), 4),
    }
)
request = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3)}),
    st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3)}),
    st.fixed_dictionaries({"raw": st.lists(segment, max_size=5)}),
    st.fixed_dictionaries({"raw": st.lists(segment, max_size=5)}),
    st.fixed_dictionaries({"messages": st.lists(message, max_size=3)}),
    st.fixed_dictionaries(
        {"messages": st.lists(message, max_size=2), "raw": st.lists(segment, max_size=2)}
    ),
    st.just({}),
)
anchor = st.fixed_dictionaries({"segment": ids, "start": small_ints, "end": small_ints})
score_names = st.sampled_from(
    ["bm25", "dense", "ppr", "rerank", "", "a b", "true", "\ud800", "x\n"]
)
unit = st.fixed_dictionaries(
    {"id": ids, "kind": st.sampled_from(UKINDS + ["passage"] * 3)},
    optional={
        "segment": ids,
        "text": texts,
        "anchors": st.lists(anchor, max_size=3),
        "scores": st.dictionaries(score_names, numbers, max_size=4),
    },
)


@st.composite
def built_priors(draw):
    doc = {"name": draw(texts), "request": draw(request)}
    if draw(st.booleans()):
        doc["units"] = draw(st.lists(unit, max_size=5))
    if draw(st.booleans()):
        doc["frontend"] = draw(
            st.fixed_dictionaries(
                {"name": texts},
                optional={"version": texts, "params": st.dictionaries(texts, params, max_size=2)},
            )
        )
    if draw(st.booleans()):
        doc["meta"] = draw(st.dictionaries(texts, params, max_size=2))
    if draw(st.integers(0, 9)) == 0:
        doc["version"] = draw(small_ints)
    if draw(st.integers(0, 9)) == 0:
        doc["format"] = draw(st.sampled_from(["kapc.prior", "kapc.prior ", "x"]))
    if draw(st.integers(0, 14)) == 0:
        doc[draw(st.sampled_from(["bogus", "Name", "units "]))] = 1
    if draw(st.integers(0, 9)) == 0:  # a repeated key
        doc = Pairs(list(doc.items()) + [("name", draw(texts))])
    return encode(doc, ascii_only=draw(st.integers(0, 5)) > 0)


@functools.lru_cache(maxsize=1)
def example_docs() -> list:
    return [
        json.loads(p.read_bytes())
        for p in sorted((ROOT / "examples" / "hotpotqa").glob("*-700.prior.json"))
    ]


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _mutate_doc(draw, doc, steps: int) -> None:
    """Replace, delete, duplicate or perturb values at random JSON paths of `doc`, in place."""
    for _ in range(steps):
        paths = list(_paths(doc))[1:]
        if not paths:
            return
        path = paths[draw(st.integers(0, len(paths) - 1))]
        parent = doc
        for step in path[:-1]:
            parent = parent[step]
        key = path[-1]
        op = draw(st.integers(0, 3))
        if op == 0:
            parent[key] = draw(json_leaf | st.sampled_from([Raw("1e999"), deep_raw(2000, 0)]))
        elif op == 1:
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent.pop(key)
        elif op == 2 and isinstance(parent, list):
            parent.insert(key, parent[key])  # duplicate an element (duplicate ids)
        else:
            old = parent[key]
            if isinstance(old, str):
                parent[key] = old + draw(st.sampled_from(WEIRD))
            elif isinstance(old, (int, float)) and not isinstance(old, bool):
                parent[key] = draw(st.sampled_from(EVIL_NUMS + [old + 1, old - 1, -old]))


@st.composite
def mutated_examples(draw):
    doc = json.loads(json.dumps(draw(st.sampled_from(example_docs()))))
    _mutate_doc(draw, doc, draw(st.integers(1, 4)))
    return encode(doc, ascii_only=True)


VALID_TEXT_CHARS = [c for c in WEIRD if not any(0xD800 <= ord(x) < 0xE000 for x in c)]
valid_texts = st.lists(
    st.sampled_from(VALID_TEXT_CHARS)
    | st.text(st.characters(exclude_categories=("Cs",)), max_size=6),
    max_size=10,
).map("".join)
GOOD_IDS = ["p0", "p1", "p2", "p3", "_s0", "_s1", "_s2", "x", "a.b:c-d", "A" * 200]
SCORE_VALUES = [
    1e308,
    -1e308,
    1.7976931348623157e308,
    5e-324,
    -0.0,
    0.0,
    1e-300,
    2**53 + 1,
    10**30,
    -1,
    0,
    1,
    0.5,
]


@st.composite
def valid_priors(draw):
    """A prior decode_prior accepts (or nearly: ids may still collide), with adversarial but legal
    values: control and line-separator characters, empty texts, extreme finite scores, deep params,
    then 0-2 random edits at JSON paths."""
    ids_left = list(GOOD_IDS)
    draw(st.randoms()).shuffle(ids_left)
    segs = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(
            st.sampled_from(["passage", "passage", "passage", "instruction", "question", "text"])
        )
        seg = {"text": draw(valid_texts), "kind": kind}
        if kind == "passage" or draw(st.booleans()):
            if not ids_left:
                continue
            seg["id"] = ids_left.pop()
        if draw(st.booleans()):
            seg["title"] = draw(st.none() | valid_texts)
        segs.append(seg)
    if draw(st.booleans()):
        request = {"raw": segs}
    else:
        cut = sorted(draw(st.lists(st.integers(0, len(segs)), max_size=3)))
        bounds = [0, *cut, len(segs)]
        messages = [
            {"role": draw(st.sampled_from(["system", "user", "assistant"])), "segments": segs[a:b]}
            for a, b in zip(bounds, bounds[1:])
            if b > a
        ]
        request = {"messages": messages or [{"role": "user", "segments": [{"text": ""}]}]}
    passages = [sg for sg in segs if sg["kind"] == "passage"]
    units = []
    for i in range(draw(st.integers(0, 6)) if passages else 0):
        kind = draw(st.sampled_from(["passage", "node", "triple", "proposition"]))
        unit = {
            "id": f"u{i}" if draw(st.integers(0, 5)) else "p0",
            "kind": kind,
            "scores": draw(
                st.dictionaries(
                    st.sampled_from(["bm25", "dense", "ppr", "", "a b", "true", "x\n", "\u2028"]),
                    st.sampled_from(SCORE_VALUES)
                    | st.floats(allow_nan=False, allow_infinity=False),
                    max_size=3,
                )
            ),
        }
        target = draw(st.sampled_from(passages))
        if kind == "passage":
            unit["segment"] = target["id"]
        anchors = []
        for _ in range(draw(st.integers(0 if kind == "passage" else 1, 3))):
            sg = draw(st.sampled_from(passages))
            n = len(sg["text"])
            a = draw(st.integers(0, n))
            anchors.append({"segment": sg["id"], "start": a, "end": draw(st.integers(a, n))})
        if anchors:
            unit["anchors"] = anchors
        if draw(st.booleans()):
            unit["text"] = draw(valid_texts)
        units.append(unit)
    doc = {"name": draw(valid_texts), "request": request, "units": units}
    if draw(st.booleans()):
        doc["frontend"] = {"name": draw(valid_texts), "params": {"p": draw(params)}}
    if draw(st.booleans()):
        doc["meta"] = {"m": draw(params)}
    _mutate_doc(draw, doc, draw(st.sampled_from([0, 0, 0, 1, 2])))
    return encode(doc, ascii_only=draw(st.booleans()))


def prior_strategy():
    return st.one_of(valid_priors(), valid_priors(), built_priors(), mutated_examples())


# ------------------------------------------------------------------------------------ .kap

TOKEN = re.compile(
    r'"(?:[^"\\\n]|\\.)*"|%[A-Za-z_][A-Za-z0-9_.:-]*(?:@[0-9]+\.\.[0-9]+)?|'
    r"[0-9]+\.\.[0-9]+|-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|"
    r"[A-Za-z_][A-Za-z0-9_-]*=?|\s+|.",
    re.S,
)
EVIL_NUM_TEXT = [
    "0",
    "-1",
    "1",
    "-0",
    "-0.0",
    "1e999",
    "-1e999",
    "1e308",
    "5e-324",
    ".5",
    "1.",
    "2147483648",
    "9223372036854775808",
    "18446744073709551616",
    "9" * 40,
    "9" * 4400,
    "1" + "0" * 400,
    "0.000001",
    "16",
    "17",
    "1.5",
]
EVIL_RANGE_TEXT = [
    "0..0",
    "0..1",
    "5..3",
    "0..99999999999",
    "1..1",
    "0..612",
    "612..613",
    "0.." + "9" * 4400,
    "99999999999999999999..99999999999999999999",
]
EVIL_STRING_TEXT = [
    '""',
    '"\\ud800"',
    '"\\udfff\\ud800"',
    '"a\\u2028b"',
    '"\\u0000"',
    '"\u2028"',
    '"\x85"',
    '"' + "x" * 5000 + '"',
    '"none"',
    '"true"',
    '"%p0"',
    '"\\n"',
]
EVIL_INSERT = [
    "none",
    "true",
    "false",
    "[",
    "]",
    "{",
    "}",
    ",",
    "=",
    "%p0",
    "%_s0",
    "%p0@0..3",
    "#",
    '"',
    "\n",
    "passes=[ground, align-spans, select, resolve-pages, compact]",
    "kap",
    "segment",
    "unit",
    "evidence",
    "target",
    "prompt",
    "span",
    "select",
    "keep",
    "pages",
    "view",
    "verify",
    "fallback",
    "cost",
    "text=",
    "id=",
    "prior=",
    "tokens=",
    "selected=[0..1]",
    "scores={a=1.0, a=2.0}",
    "\u2028",
    "\x0c",
    "\\",
    "@",
]
PASS_LISTS = [
    "passes=[]",
    "passes=[ground]",
    "passes=[ground, align-spans]",
    "passes=[ground, align-spans, select]",
    "passes=[ground, align-spans, select, resolve-pages]",
    "passes=[ground, align-spans, select, resolve-pages, compact]",
    "passes=[compact]",
    "passes=[resolve-pages]",
    "passes=[select]",
    "passes=[align-spans]",
    "passes=[align-spans, resolve-pages]",
    "passes=[ground, ground]",
    "passes=[bogus]",
    "passes=[align-spans, select, resolve-pages, compact]",
]


@functools.lru_cache(maxsize=1)
def kap_bases() -> list[str]:
    """Printed modules at every stage: plans/*.kap, the kap seeds, and each example prior through
    every pass of the default pipeline (needs the default model)."""
    from kapc.compiler import compile_module
    from kapc.ingest import module_from_prior
    from kapc.parse import print_module
    from kapc.prior import load_prior
    from tests.fuzz.targets import model_ctx

    out = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "plans").glob("*.kap"))]
    out += [p.read_text(encoding="utf-8") for p in sorted((FUZZ / "corpus" / "kap").glob("*.kap"))]
    try:
        ctx = model_ctx()
        for p in sorted((ROOT / "examples" / "hotpotqa").glob("*.prior.json")):
            m = module_from_prior(load_prior(p))
            out.append(print_module(m))
            compile_module(
                m, None, ctx, after_pass=lambda rec: out.append(print_module(rec.module))
            )
    except Exception as exc:  # noqa: BLE001 - without the model, the plans and seeds still serve
        print(
            f"kap bases: examples through passes skipped: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
    return sorted(set(out), key=len)


def _mutate_kap(text: str, ops: list[tuple[int, int, int]]) -> str:
    toks = TOKEN.findall(text)
    for op, a, b in ops:
        if not toks:
            break
        i = a % len(toks)
        t = toks[i]
        kind = op % 12
        if kind == 0:  # a number
            nums = [
                j for j, x in enumerate(toks) if re.fullmatch(r"-?[0-9.]+([eE][-+]?[0-9]+)?", x)
            ]
            if nums:
                toks[nums[a % len(nums)]] = EVIL_NUM_TEXT[b % len(EVIL_NUM_TEXT)]
        elif kind == 1:  # a range
            rs = [j for j, x in enumerate(toks) if re.fullmatch(r"[0-9]+\.\.[0-9]+", x)]
            if rs:
                toks[rs[a % len(rs)]] = EVIL_RANGE_TEXT[b % len(EVIL_RANGE_TEXT)]
        elif kind == 2:  # a string
            ss = [j for j, x in enumerate(toks) if x.startswith('"')]
            if ss:
                toks[ss[a % len(ss)]] = EVIL_STRING_TEXT[b % len(EVIL_STRING_TEXT)]
        elif kind == 3:  # a reference
            rr = [j for j, x in enumerate(toks) if x.startswith("%")]
            if rr:
                others = [x for x in toks if x.startswith("%")]
                toks[rr[a % len(rr)]] = others[b % len(others)] if b % 3 else "%zz"
        elif kind == 4:
            del toks[i]
        elif kind == 5:
            toks.insert(i, t)
        elif kind == 6:
            toks.insert(i, " " + EVIL_INSERT[b % len(EVIL_INSERT)] + " ")
        elif kind in (7, 8):  # line operations
            lines = "".join(toks).split("\n")
            j, k = a % len(lines), b % len(lines)
            if kind == 7:
                del lines[j]
            else:
                lines.insert(k, lines[j])
            toks = TOKEN.findall("\n".join(lines))
        elif kind == 9:  # the passes list
            s = "".join(toks)
            s = (
                re.sub(r"passes=\[[^\]]*\]", PASS_LISTS[b % len(PASS_LISTS)], s, count=1)
                if "passes=" in s
                else s.replace("request=", PASS_LISTS[b % len(PASS_LISTS)] + " request=", 1)
            )
            toks = TOKEN.findall(s)
        elif kind == 10:  # swap two tokens
            j = b % len(toks)
            toks[i], toks[j] = toks[j], toks[i]
        else:  # a number nudged by one (keeps the module near-valid)
            nums = [j for j, x in enumerate(toks) if re.fullmatch(r"[0-9]{1,18}", x)]
            if nums:
                j = nums[a % len(nums)]
                toks[j] = str(max(0, int(toks[j]) + (1 if b % 2 else -1)))
    return "".join(toks)


@st.composite
def kap_inputs(draw):
    bases = kap_bases()
    # prefer small bases: index drawn from a skewed distribution
    i = min(draw(st.integers(0, len(bases) - 1)), draw(st.integers(0, len(bases) - 1)))
    ops = draw(
        st.lists(
            st.tuples(st.integers(0, 11), st.integers(0, 2**31), st.integers(0, 2**31)),
            min_size=1,
            max_size=5,
        )
    )
    return _mutate_kap(bases[i], ops).encode("utf-8", "surrogatepass")


# ------------------------------------------------------------------------------------ .kapb


@functools.lru_cache(maxsize=1)
def kapb_bases() -> list[bytes]:
    from tests.fuzz import kapb_tools

    return [
        p.read_bytes()
        for p in sorted((FUZZ / "corpus" / "kapb").glob("*"))
        if kapb_tools.is_kapb(p.read_bytes()) and not p.name.startswith("near-")
    ]


@st.composite
def kapb_inputs(draw):
    from tests.fuzz import kapb_tools

    data = draw(st.sampled_from(kapb_bases()))
    rng = random.Random(draw(st.integers(0, 2**32)))
    data = kapb_tools.mutate(data, rng, steps=draw(st.integers(1, 3)))
    if draw(st.integers(0, 9)) == 0:  # a flipped body byte, re-sealed
        version, head_len, body = kapb_tools.unseal(data)
        if body:
            j = draw(st.integers(0, len(body) - 1))
            body = body[:j] + bytes([body[j] ^ (1 << draw(st.integers(0, 7)))]) + body[j + 1 :]
        data = kapb_tools.reseal(body, head_len, version)
    return data


# ---------------------------------------------------------------------------------- pipeline

PASS_NAMES = ["ground", "align-spans", "select", "resolve-pages", "compact", "groud", "", "Ground"]
OPTIONS = {
    "ground": ["graph-weight", "norm"],
    "align-spans": [],
    "select": ["budget-tokens", "budget-ratio", "sink", "window"],
    "resolve-pages": ["block-size"],
    "compact": [
        "k",
        "accept",
        "expect-acceptance",
        "batch",
        "dtype-bytes",
        "max-retained",
        "min-acceptance",
        "acceptance-window",
        "on-predicted-loss",
    ],
}
EVIL_OPT = [
    "nan",
    "-nan",
    "inf",
    "-inf",
    "infinity",
    "1e999",
    "-1e999",
    "1e308",
    "5e-324",
    "-5",
    "-1",
    "0",
    "1",
    "2",
    "0.5",
    "-0",
    "-0.0",
    "9" * 30,
    "9" * 5000,
    "2147483648",
    "9223372036854775808",
    "18446744073709551616",
    "true",
    "false",
    "",
    "top1",
    "top3",
    "top99",
    "top09",
    "greedy",
    "bogus",
    "minmax",
    "rank",
    "1_000",
    "\u0663",
    " 3 ",
    "0x10",
    "+1",
    "1.5",
    "Greedy",
    "top\u0663",
]


@st.composite
def pipeline_inputs(draw):
    items = []
    for _ in range(draw(st.integers(1, 5))):
        name = draw(
            st.sampled_from(PASS_NAMES[:5])
            if draw(st.integers(0, 9))
            else st.sampled_from(PASS_NAMES)
        )
        opts = []
        known = OPTIONS.get(name, [])
        for _ in range(draw(st.integers(0, 3))):
            key = draw(st.sampled_from(known)) if known and draw(st.integers(0, 9)) else "bogus"
            opts.append(f"{key}={draw(st.sampled_from(EVIL_OPT) | st.text(max_size=5))}")
        items.append(name + ("{" + ",".join(opts) + "}" if opts else ""))
    text = ",".join(items)
    if draw(st.integers(0, 9)) == 0:
        text = text.replace(",", draw(st.sampled_from([" , ", ",,", ";", "\n,"])))
    return text.encode("utf-8", "surrogatepass")


STRATEGIES = {
    "prior": prior_strategy,
    "kap": kap_inputs,
    "kapb": kapb_inputs,
    "pipeline": pipeline_inputs,
}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m tests.fuzz.hypothesis_run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("target", choices=sorted(STRATEGIES))
    ap.add_argument("--count", type=int, default=1000, help="examples to generate")
    ap.add_argument("--deep", action="store_true", help="also compile/lower (needs the model)")
    ap.add_argument("--surrogatepass", action="store_true", help="kap: decode with surrogatepass")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--mem-mb", type=int, default=8192)
    ap.add_argument("--no-write", action="store_true", help="do not write tests/fuzz/crashes/")
    args = ap.parse_args(argv)

    from tests.fuzz.record import Recorder, limit_memory

    limit_memory(args.mem_mb)
    strategy = STRATEGIES[args.target]()
    if args.target == "kap":
        kap_bases()
    options = {"deep": args.deep, "surrogatepass": args.surrogatepass}
    if args.deep:
        from tests.fuzz.targets import model_ctx

        model_ctx()
    rec = Recorder(args.target, options, write=not args.no_write)

    @settings(
        max_examples=args.count,
        database=None,
        deadline=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
    )
    @given(strategy)
    def fuzz(data: bytes) -> None:
        rec.run(data)

    if args.seed is not None:
        from hypothesis import seed

        fuzz = seed(args.seed)(fuzz)
    try:
        fuzz()
    finally:
        print(rec.summary(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
