"""The engine of tests/vllm/test_bfloat16.py, run in a process of its own (two in-process vLLM
engines cannot share one): SmolLM2 in bfloat16, as a CPU with AMX runs it.

    python -m tests.vllm.bfloat16_probe CASES.json OUT.json

CASES.json holds [[prompt ids, plan as hex], ...]; OUT.json gets the runs without and with plans
and what the engine's kernels did."""

from __future__ import annotations

import json
import sys

from tests.vllm.conftest import NEW_TOKENS, _engine


def main(cases_path: str, out_path: str) -> None:
    from kapc.runtime.vllm import generate

    cases = json.loads(open(cases_path).read())
    ids = [c[0] for c in cases]
    plans = [bytes.fromhex(c[1]) for c in cases]
    eng = _engine(True, dtype="bfloat16")
    try:
        eng.use_profile("none")
        plain = generate(eng, ids, None, max_tokens=NEW_TOKENS)
        planned = generate(eng, ids, plans, max_tokens=NEW_TOKENS, honor_predicted_loss=False)
    finally:
        eng.close()
    keep = ("status", "reason", "access", "note", "proposed", "accepted", "cycles")
    first = planned[0]
    out = {
        "plain": {k: plain[0][k] for k in ("attention_kernel", "timing")},
        "planned": [{k: r.get(k) for k in keep} for r in planned],
        "engine": {k: first[k] for k in ("attention_kernel", "kernel_choices", "timing")},
    }
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
