"""The engine of tests/vllm/test_preemption.py, run in a process of its own: two in-process vLLM
engines cannot share one (closing one tears down the parallel state the other still uses).

    python -m tests.vllm.preemption_probe CASES.json OUT.json

CASES.json holds [[prompt ids, plan as hex], ...]; OUT.json gets the plain and planned results
and what the bounds watch saw."""

from __future__ import annotations

import json
import sys

from tests.vllm.conftest import _engine

TOKENS = 128


def watch_bounds(seen: dict) -> None:
    """Check, at every page choice, that each row's key bounds were read from the blocks that
    hold its prompt now. A watch, not a stand-in: the hook's own code runs unchanged."""
    from kapc.runtime.vllm.keys import KeyPages

    original = KeyPages.table_router

    def watched(self, rows):
        router = original(self, rows)
        for r in rows:
            now = [int(b) for b in r.blocks[: r.session.tail_block]]
            seen["checked"] += 1
            seen["moved"] += r.session.block_moves > 0
            seen["stale"] += r.session.bounds.tolist() != now
        return router

    KeyPages.table_router = watched


def main(cases_path: str, out_path: str) -> None:
    from kapc.runtime.vllm import generate

    cases = json.loads(open(cases_path).read())
    ids = [c[0] for c in cases]
    plans = [bytes.fromhex(c[1]) for c in cases]
    # about 2,100 tokens: two of the prompts and about 80 more tokens each; the prefix cache is
    # off, so a recomputed prompt never finds its old blocks
    eng = _engine(True, kv_cache_gib=0.09, enable_prefix_caching=False)
    try:
        eng.use_profile("none")
        plain = generate(eng, ids, None, max_tokens=TOKENS, ignore_eos=True)
        seen = {"checked": 0, "stale": 0, "moved": 0}
        watch_bounds(seen)
        res = generate(
            eng,
            ids,
            plans,
            max_tokens=TOKENS,
            ignore_eos=True,
            honor_predicted_loss=False,
            min_acceptance=False,
        )
    finally:
        eng.close()
    keep = ("tokens", "status", "reason", "access", "block_moves", "proposed")
    out = {
        "plain": [r["tokens"] for r in plain],
        "planned": [{k: r[k] for k in keep} for r in res],
        "seen": seen,
    }
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
