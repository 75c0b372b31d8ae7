"""`make demo`: the main job end to end, printing each command as a user would type it.

1. make a real prior: HotpotQA dev question, about 1K tokens with hard negatives, scored by the
   offline graph frontend (BM25, MiniLM, entity graph, Personalized PageRank);
2. show what the passes keep (`kapc explain`), compile it (`kapc compile`), inspect the plan;
3. decode with the plan on the real SmolLM2 model and compare with full-context decoding
   (`kapc run --compare-full`).

`python -m kapc.demo --model qwen2.5-coder-0.5b-instruct` (`make demo MODEL=...`) runs the same
on another registered model or a Hugging Face folder.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from kapc import settings

OUT = Path("out/demo")


def run_kapc(*args: str, show: bool = True) -> str:
    cmd = ["kapc", *args]
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    proc = subprocess.run([sys.executable, "-m", "kapc", *args], text=True, capture_output=not show)
    if proc.returncode != 0:
        if not show:
            sys.stderr.write(proc.stderr)
        raise SystemExit(f"demo: `{shlex.join(cmd)}` failed with exit code {proc.returncode}")
    return proc.stdout or ""


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m kapc.demo", description="kapc's main job, end to end"
    )
    ap.add_argument(
        "--model",
        default=None,
        help="a registered model's name or a Hugging Face folder (default: smollm2-135m-instruct)",
    )
    args = ap.parse_args(argv)
    model = ("--model", args.model) if args.model else ()
    index = str(settings.demo_index())
    OUT.mkdir(parents=True, exist_ok=True)
    prior, plan = OUT / "prior.json", OUT / "plan.kapb"
    run_kapc(
        "prior", "hotpotqa", "--index", index, "--context-tokens", "1024", "-o", str(prior), *model
    )
    # At 1K tokens and batch 1, SmolLM2's weights dominate the bytes each step reads, so the cost
    # model predicts no gain and a runtime would fall back; the demo says so, then runs the plan
    # anyway (on-predicted-loss=false) to show the mechanism and the lossless law.
    pipeline = (
        "ground,align-spans,select{budget-ratio=0.3},resolve-pages,"
        "compact{k=4,on-predicted-loss=false}"
    )
    run_kapc("explain", str(prior), "--passes", pipeline, "--print-after", "compact", *model)
    run_kapc(
        "compile",
        str(prior),
        "-o",
        str(plan),
        "--passes",
        pipeline,
        "--emit-kap",
        str(OUT / "plan.kap"),
        *model,
    )
    run_kapc("inspect", str(plan))
    run_kapc("run", str(plan), "--max-tokens", "48", "--compare-full", *model)


if __name__ == "__main__":
    main()
