"""Small real cases for the golden snapshots: a HotpotQA example prior cut to a screen.

The prompt keeps the gold passages and the distractor of highest PPR, PASSAGES in all, each with
its title and first sentences (at most BODY_CHARS characters of body); the prior keeps its NODES
entity units of highest PPR whose anchors still fall in the kept text.
The inputs are committed under `tests/compiler/inputs/` so a reviewer reads what the goldens were
made from; a test keeps them equal to what this module makes. Remake them with

    python -m tests.compiler.small_cases
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.conftest import EXAMPLES

INPUTS = Path(__file__).parent / "inputs"
SOURCES = ("q0000-700", "q0001-700")
PASSAGES = 3
BODY_CHARS = 160
NODES = 3
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def _cut_body(text: str) -> str:
    """`Title: ...\\nbody\\n\\n` with the body cut after its last sentence within BODY_CHARS."""
    title, body = text.rstrip("\n").split("\n", 1)
    if len(body) > BODY_CHARS:
        ends = [m.start() for m in _SENTENCE_END.finditer(body) if m.start() <= BODY_CHARS]
        body = body[: ends[-1]] if ends else body[:BODY_CHARS].rsplit(" ", 1)[0]
    return f"{title}\n{body}\n\n"


def small_prior(doc: dict) -> dict:
    doc = json.loads(json.dumps(doc))
    ppr = {
        u["segment"]: u["scores"].get("ppr", 0.0) for u in doc["units"] if u["kind"] == "passage"
    }
    gold = set(doc["meta"]["gold_passages"])
    rest = sorted((p for p in ppr if p not in gold), key=lambda p: -ppr[p])
    keep = gold | set(rest[: max(0, PASSAGES - len(gold))])
    lengths = {}
    for message in doc["request"]["messages"]:
        message["segments"] = [
            s for s in message["segments"] if s.get("kind") != "passage" or s["id"] in keep
        ]
        for seg in message["segments"]:
            if seg.get("kind") == "passage":
                seg["text"] = _cut_body(seg["text"])
                lengths[seg["id"]] = len(seg["text"])
    doc["units"] = [u for u in doc["units"] if u["kind"] != "passage" or u["segment"] in keep]
    nodes = []
    for unit in doc["units"]:
        if unit["kind"] != "node":
            continue
        anchors = [a for a in unit["anchors"] if a["end"] <= lengths.get(a["segment"], -1)]
        if anchors:
            nodes.append(dict(unit, anchors=anchors))
    nodes.sort(key=lambda u: -u["scores"].get("ppr", 0.0))
    doc["units"] = [u for u in doc["units"] if u["kind"] != "node"] + nodes[:NODES]
    doc["name"] = doc["name"].replace("-700", "-small")
    return doc


def made(source: str) -> str:
    doc = json.loads((EXAMPLES / "hotpotqa" / f"{source}.prior.json").read_text())
    return json.dumps(small_prior(doc), indent=1, ensure_ascii=False) + "\n"


def input_path(source: str) -> Path:
    return INPUTS / f"{source.replace('-700', '-small')}.prior.json"


if __name__ == "__main__":
    for source in SOURCES:
        input_path(source).write_text(made(source))
        print(f"wrote {input_path(source)}")
