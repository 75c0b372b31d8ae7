"""One unattended GPU measurement: plain, draft and verify (greedy and top-3) step times of the
reference executor on a Llama-shaped model at long contexts and large batches, written as a
calibration profile.

    python -m benchmarks.gpu --out $OUT            # on the GPU machine, under 8 minutes

That machine lacks msgspec (kapc.profile needs it): carry a cp312 manylinux wheel of it and
install it with `pip install --no-deps --target` first (run 2026-12-04: 428 s of device time with
`--budget-s 380`; benchmarks/records/reference-executor/ has the figures).

The GPU machine lent to some sessions has PyTorch with CUDA and transformers but no vLLM, and
receives at most 64 MiB: the bundled SmolLM2 does not fit, so the model is built from a config
with RANDOM WEIGHTS (Llama-3.1-8B's shape by default, bf16). Its outputs mean nothing; its step
times are real. Every row of a batch decodes the same random prompt (the executor forks its
prefix, and still reads each row's KV per step), so one prefill per context serves every batch.

Writes to --out: `profile.json` (kapc.profile.Profile, engine "reference", device "cuda", no
acceptance model: random weights accept nothing meaningful), `steps.jsonl` (every point as it is
measured, so a run cut short by its time budget still leaves data) and `summary.txt`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)  # for a smoke test of this script on a CPU
SHAPES = {"llama-8b": LLAMA_8B, "llama-1b": LLAMA_1B, "tiny": TINY}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", required=True, help="folder for profile.json, steps.jsonl, summary.txt"
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    ap.add_argument("--contexts", default="8192,16384,32768,65536")
    ap.add_argument("--batches", default="1,4,8,16,32")
    ap.add_argument(
        "--max-kv-tokens",
        type=int,
        default=524288,
        help="skip (context, batch) points whose KV exceeds this many tokens",
    )
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="stop starting new points after this many seconds",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device here", file=sys.stderr)
        return 2
    from kapc.profile import Profile, StepSample, fit_steps, now, save_profile
    from kapc.runtime.calibrate import Grid, ReferenceBench, measure_point
    from kapc.runtime.model import random_model

    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    contexts = sorted(int(x) for x in args.contexts.split(","))
    batches = sorted(int(x) for x in args.batches.split(","))
    pairs = ((0.05, 2), (0.1, 4), (0.2, 8))
    m = random_model(
        SHAPES[args.shape], device=args.device, dtype=args.dtype, name=f"random-{args.shape}"
    )
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, m.vocab - 100, (max(contexts),), generator=gen).tolist()
    kv_gib = args.max_kv_tokens * 1.3 * m.kv_bytes_per_token() / 2**30
    bench = ReferenceBench(
        block_size=16,
        model=m,
        max_context=max(contexts),
        max_batch=max(batches),
        kv_cache_gib=kv_gib,
        prompts=lambda rows, tokens: [prompt[:tokens]] * rows,
    )
    log = open(out / "steps.jsonl", "w")
    samples: list[StepSample] = []
    # no page-choice or acceptance points (the reference executor's page choice is not what a GPU
    # engine would run; random weights accept nothing meaningful), and top-3 verification at two
    # of the greedy q's only (enough points for its fit): the run must fit its time budget. So
    # the cycles' drafts read static pages too, and time no resting steps beside them (the
    # executor's resting step is its plain step, timed once per point)
    grid = Grid(
        contexts=tuple(contexts),
        batches=tuple(batches),
        pairs=pairs,
        steps=args.steps,
        acceptance_questions=0,
        select_pair=None,
        tolerant_pairs=((0.1, 4), (0.2, 8)),
        draft_access="static",
        rest_beside_cycles=False,
    )
    print(
        f"benchmarks.gpu: {m.name} ({sum(p.numel() for p in m.hf.parameters()) / 1e9:.1f}B "
        f"params, {args.dtype}) on {torch.cuda.get_device_name() if args.device == 'cuda' else args.device}; "
        f"KV pool {kv_gib:.0f} GiB",
        flush=True,
    )
    skipped = 0
    for kind, L, B, s, q in grid.points():
        if L * B > args.max_kv_tokens or kind == "resting":  # the executor's resting is plain
            continue
        if time.perf_counter() - t_start > args.budget_s:
            skipped += 1
            continue
        t0 = time.perf_counter()
        new, _ = measure_point(bench, grid, (kind, L, B, s, q))
        samples += new
        for x in new:
            log.write(json.dumps([x.kind, x.batch, x.query, x.visible, x.seconds]) + "\n")
        log.flush()
        print(
            f"  {kind:8} L={L:<6} B={B:<3}"
            + (f" s={s} q={q}" if kind != "plain" else "")
            + "  "
            + ", ".join(f"{x.kind} {x.seconds * 1e3:.1f} ms" for x in new)
            + f"  ({time.perf_counter() - t0:.0f}s)",
            flush=True,
        )
    profile = Profile(
        engine="reference",
        engine_version="kapc",
        model=m.name,
        model_fingerprint=m.fingerprint,
        dtype=args.dtype,
        device=args.device,
        threads=torch.get_num_threads(),
        block_size=16,
        created=now(),
        samples=tuple(samples),
        fits=fit_steps(samples),
        note="RANDOM WEIGHTS (throughput only); every row decodes the same prompt; "
        "the reference executor gathers KV per step",
    )
    save_profile(profile, out / "profile.json")
    from kapc.runtime.calibrate import show

    summary = (
        show(profile) + f"\n{skipped} points skipped for the time budget; "
        f"{time.perf_counter() - t_start:.0f}s in all\n"
    )
    (out / "summary.txt").write_text(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
