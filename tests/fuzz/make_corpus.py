"""(Re)generate the seed corpora under tests/fuzz/corpus/ and the libFuzzer dictionaries under
tests/fuzz/dicts/. Small valid and near-valid inputs, at most 30 per target, each under 64 KB.

    python -m tests.fuzz.make_corpus

`.kapb` seeds are compiled with `python -m kapc compile` (the default model, converted once into
the kapc cache) and stored as `*.kapb.bin`, since `*.kapb` is git-ignored."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FUZZ = ROOT / "tests" / "fuzz"
CORPUS = FUZZ / "corpus"
EXAMPLES = ROOT / "examples" / "hotpotqa"

TINY_RAW = {
    "name": "tiny-raw",
    "request": {
        "raw": [
            {"text": "Answer briefly.\n", "kind": "instruction"},
            {
                "text": "Title: A\nAlpha is a letter.\n\n",
                "kind": "passage",
                "id": "p0",
                "title": "A",
            },
            {"text": "Title: B\nBeta follows alpha.\n\n", "kind": "passage", "id": "p1"},
            {"text": "Question: what follows alpha?\n", "kind": "question"},
        ]
    },
    "units": [
        {"id": "p0", "kind": "passage", "segment": "p0", "scores": {"bm25": 1.5, "dense": 0.2}},
        {"id": "p1", "kind": "passage", "segment": "p1", "scores": {"bm25": 3.0}},
    ],
}

TINY_CHAT = {
    "name": "tiny-chat",
    "request": {
        "messages": [
            {"role": "system", "segments": [{"text": "Answer briefly.", "kind": "instruction"}]},
            {
                "role": "user",
                "segments": [
                    {"text": "Title: A\nAlpha.\n\n", "kind": "passage", "id": "p0"},
                    {"text": "Title: B\nBeta.\n\n", "kind": "passage", "id": "p1"},
                    {"text": "Who is second?", "kind": "question"},
                ],
            },
        ]
    },
    "units": [
        {"id": "p0", "kind": "passage", "segment": "p0", "scores": {"dense": 0.9}},
        {"id": "p1", "kind": "passage", "segment": "p1", "scores": {"dense": 0.1}},
        {
            "id": "n0",
            "kind": "node",
            "text": "Beta",
            "anchors": [{"segment": "p1", "start": 9, "end": 13}],
            "scores": {"ppr": 0.02},
        },
        {
            "id": "t0",
            "kind": "triple",
            "text": "Beta follows Alpha",
            "anchors": [
                {"segment": "p0", "start": 9, "end": 14},
                {"segment": "p1", "start": 9, "end": 13},
            ],
            "scores": {"ppr": 0.01, "rerank": -2.5},
        },
    ],
    "frontend": {
        "name": "graph",
        "version": "1",
        "params": {"k": 5, "nested": {"a": [1, 2.5, None, True]}},
    },
    "meta": {"answer": "Beta", "supporting": ["p1"]},
}


def _near_valid_priors() -> dict[str, bytes]:
    def variant(base, edit):
        d = json.loads(json.dumps(base))
        edit(d)
        return json.dumps(d).encode()

    return {
        "near-dup-segment-id.json": variant(
            TINY_RAW, lambda d: d["request"]["raw"][1].update(id="p1")
        ),
        "near-anchor-out-of-range.json": variant(
            TINY_CHAT, lambda d: d["units"][2]["anchors"][0].update(end=999)
        ),
        "near-unknown-field.json": variant(TINY_RAW, lambda d: d.update(bogus=1)),
        "near-both-messages-and-raw.json": variant(
            TINY_CHAT, lambda d: d["request"].update(raw=[{"text": "x"}])
        ),
        "near-empty-message.json": variant(
            TINY_CHAT,
            lambda d: d["request"]["messages"].insert(0, {"role": "user", "segments": []}),
        ),
        "near-id-newline.json": variant(
            TINY_RAW,
            lambda d: (
                d["request"]["raw"][1].update(id="p0\n"),
                d["units"][0].update(segment="p0\n"),
            ),
        ),
        "near-version-2.json": variant(TINY_RAW, lambda d: d.update(version=2)),
        "near-passage-without-id.json": variant(
            TINY_RAW, lambda d: d["request"]["raw"][2].pop("id")
        ),
        "near-inf-score.json": json.dumps(TINY_RAW).replace("1.5", "1e999").encode(),
        "near-huge-scores.json": json.dumps(TINY_RAW)
        .replace("1.5", "1e308")
        .replace("3.0", "-1e308")
        .encode(),
        "near-lone-surrogate.json": json.dumps(TINY_RAW).replace("Alpha is", "\\ud800 is").encode(),
        "near-u2028.json": variant(
            TINY_RAW, lambda d: d["request"]["raw"][0].update(text="a\u2028b\x85c\x0cd")
        ),
        "near-not-json.json": b'{"name": "x", "request": {"raw": [',
        # a typed field (a score) holding 2000-deep nesting: once a RecursionError in _name_dict_keys
        "near-deep-score.json": b'{"name":"a","request":{"raw":[]},"units":[{"id":"u","kind":"node",'
        b'"scores":{"s":' + b"[" * 2000 + b"]" * 2000 + b"}}]}",
        "near-empty-raw.json": b'{"name":"e","request":{"raw":[]}}',
    }


def priors() -> dict[str, bytes]:
    out = {p.name: p.read_bytes() for p in sorted(EXAMPLES.glob("*-700.prior.json"))}
    out["tiny-raw.json"] = json.dumps(TINY_RAW, indent=1).encode()
    out["tiny-chat.json"] = json.dumps(TINY_CHAT, indent=1).encode()
    out.update(_near_valid_priors())
    return out


def kaps() -> dict[str, bytes]:
    from kapc.ingest import module_from_prior
    from kapc.parse import print_module
    from kapc.passes import CompileContext
    from kapc.pipeline import parse_pipeline, run_pipeline
    from kapc.prior import decode_prior

    out = {p.name: p.read_bytes() for p in sorted((ROOT / "plans").glob("*.kap"))}
    for name, doc in (("tiny-raw", TINY_RAW), ("tiny-chat", TINY_CHAT)):
        m = module_from_prior(decode_prior(json.dumps(doc)))
        out[f"{name}.0-input.kap"] = print_module(m).encode()
        g = run_pipeline(m, parse_pipeline("ground"), CompileContext()).module
        out[f"{name}.1-ground.kap"] = print_module(g).encode()
    out["minimal.kap"] = b'kap name="m" request=raw\n'
    out["minimal-segment.kap"] = (
        b'kap name="m" request=raw\nsegment %p0 kind=passage text="x"\n'
        b'unit %u kind=node anchors=[%p0@0..1] scores={a=1.0, "b c"=-2.5}\n'
    )
    out["near-syntax-error.kap"] = b'kap name="m" request=raw\nsegment %p0 text="x\n'
    out["near-unknown-statement.kap"] = b'kap name="m" request=raw\nsegmnt %p0 text="x"\n'
    out["near-reversed-range.kap"] = b'kap name="m" request=raw\nspan %p0 chars=5..3 tokens=0..1\n'
    out["near-claims-pages.kap"] = (
        b'kap name="m" request=raw passes=[resolve-pages]\n'
        b"pages block_size=16 blocks=1 selected=[0..1] retained=1.0 visible=1\n"
    )
    out["near-inf-prior.kap"] = b'kap name="m" request=raw\nevidence %p0 prior=1e999\n'
    out["near-huge-int.kap"] = b'kap name="a" request=raw version=' + b"9" * 5000 + b"\n"
    out["near-claims-align.kap"] = (
        b'kap name="m" request=chat passes=[ground, align-spans]\n'
        b'segment %_ kind=instruction text="x"\n'
    )
    out["near-dup-map-key.kap"] = (
        b'kap name="m" request=raw\nsegment %p0 kind=passage text="x"\n'
        b"unit %u kind=node anchors=[%p0@0..1] scores={a=1.0, a=2.0}\n"
    )
    return out


def pipelines() -> dict[str, bytes]:
    items = [
        "ground,align-spans,select,resolve-pages,compact",
        "ground,align-spans,select{budget-ratio=0.15},resolve-pages{block-size=32},compact{k=4,batch=8}",
        "ground,align-spans,select{budget-tokens=1024},resolve-pages,compact",
        "ground{graph-weight=0.3,norm=rank}",
        "select{sink=8,window=64},compact{accept=top3,expect-acceptance=0.5}",
        "compact{max-retained=0.4,min-acceptance=0.2,acceptance-window=16,on-predicted-loss=false}",
        "compact{dtype-bytes=2}",
        "resolve-pages{block-size=1}",
        "ground{norm=bogus}",
        "select{budget-ratio=nan}",
        "compact{accept=top99}",
        "groud",
        "ground,,",
        "select{budget-ratio=1e999}",
    ]
    return {f"p{i:02d}.txt": s.encode() for i, s in enumerate(items)}


def kapbs() -> dict[str, bytes]:
    variants = [
        ("q0000-700", None),
        ("q0001-700", None),
        (
            "q0002-700",
            "ground,align-spans,select{budget-ratio=0.3},resolve-pages{block-size=32},"
            "compact{k=4,accept=top3}",
        ),
        (
            "q0000-700",
            "ground,align-spans,select{budget-ratio=0.1},resolve-pages{block-size=1},compact",
        ),
    ]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (stem, passes) in enumerate(variants):
            dest = Path(tmp) / f"{i}.kapb"
            cmd = [
                sys.executable,
                "-m",
                "kapc",
                "compile",
                str(EXAMPLES / f"{stem}.prior.json"),
                "-o",
                str(dest),
            ] + (["--passes", passes] if passes else [])
            subprocess.run(cmd, check=True, cwd=ROOT)
            out[f"{stem}-{i}.kapb.bin"] = dest.read_bytes()
    good = out["q0000-700-0.kapb.bin"]
    out["near-truncated.kapb.bin"] = good[:-10]
    out["near-bad-checksum.kapb.bin"] = good[:-1] + bytes([good[-1] ^ 1])
    out["near-version-2.kapb.bin"] = good[:8] + (2).to_bytes(4, "little") + good[12:]
    out["near-short.kapb.bin"] = good[:40]
    return out


def dicts() -> dict[str, list[str]]:
    from kapc.ir import STATEMENTS
    from kapc.parse.printer import statement_fields
    from kapc.passes import PASSES

    kap = set(STATEMENTS) | {
        "none",
        "true",
        "false",
        "[",
        "]",
        "{",
        "}",
        ",",
        "%p0",
        "%_s0",
        "%p0@0..3",
        "0..1",
        "1e999",
        "-1",
        "#",
        '"\\ud800"',
        '"\\u2028"',
        "9" * 40,
        "chat",
        "raw",
        "passage",
        "node",
        "greedy",
        "top3",
    }
    for cls, _ in STATEMENTS.values():
        kap |= {f"{name}=" for name, *_ in statement_fields(cls)}
    kap |= set(PASSES)
    prior = {
        '"name"',
        '"request"',
        '"messages"',
        '"raw"',
        '"role"',
        '"segments"',
        '"text"',
        '"kind"',
        '"id"',
        '"title"',
        '"units"',
        '"segment"',
        '"anchors"',
        '"start"',
        '"end"',
        '"scores"',
        '"frontend"',
        '"params"',
        '"meta"',
        '"version"',
        '"format"',
        '"kapc.prior"',
        '"passage"',
        '"node"',
        '"triple"',
        '"proposition"',
        '"system"',
        '"user"',
        '"assistant"',
        '"instruction"',
        '"question"',
        "1e999",
        "-1e308",
        "null",
        "true",
        "[",
        "]",
        "{",
        "}",
        '"\\ud800"',
        '"p0\\n"',
        "18446744073709551616",
    }
    pipeline = set(PASSES) | {
        "{",
        "}",
        ",",
        "=",
        "nan",
        "inf",
        "-inf",
        "1e999",
        "-5",
        "0",
        "9" * 30,
        "true",
        "false",
        "top99",
        "bogus",
        "minmax",
        "rank",
    }
    import dataclasses

    for cls in PASSES.values():
        pipeline |= {f.name.replace("_", "-") + "=" for f in dataclasses.fields(cls)}
    return {"kap": sorted(kap), "prior": sorted(prior), "pipeline": sorted(pipeline)}


def _dict_line(token: str) -> str:
    esc = "".join(
        c
        if 0x20 <= ord(c) < 0x7F and c not in '"\\'
        else ("\\" + c if c in '"\\' else "".join(f"\\x{b:02x}" for b in c.encode("utf-8")))
        for c in token
    )
    return f'"{esc}"'


def main() -> None:
    for target, files in (
        ("prior", priors()),
        ("kap", kaps()),
        ("pipeline", pipelines()),
        ("kapb", kapbs()),
    ):
        folder = CORPUS / target
        folder.mkdir(parents=True, exist_ok=True)
        assert len(files) <= 30, target
        for name, data in files.items():
            assert len(data) < 64 * 1024, name
            (folder / name).write_bytes(data)
        print(f"{target}: {len(files)} seeds in {folder.relative_to(ROOT)}")
    (FUZZ / "dicts").mkdir(exist_ok=True)
    for target, tokens in dicts().items():
        (FUZZ / "dicts" / f"{target}.dict").write_text("\n".join(map(_dict_line, tokens)) + "\n")


if __name__ == "__main__":
    main()
