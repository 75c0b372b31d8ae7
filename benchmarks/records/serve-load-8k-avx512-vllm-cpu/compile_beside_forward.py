"""What a plan compile running beside an eager forward costs the forward, in one process or two.

vLLM-CPU's server runs its worker's forwards on one core (the other reserved for the engine core
and API server) and kapc compiles priors on a thread of the worker. This times an eager SmolLM2
forward (8 rows x 4 tokens, one torch thread, bound to core 0) alone, with a thread compiling
priors in a loop on the same core, with that thread on the other core, and with the compiles in
a process of their own on the other core:

    python benchmarks/records/serve-load-8k-avx512-vllm-cpu/compile_beside_forward.py
"""

import multiprocessing as mp
import os
import threading
import time

from kapc.models import ensure_model

MODEL = str(ensure_model("smollm2-135m-instruct", weights=True))
PRIOR = "examples/hotpotqa/q0000-4k.prior.json"


def other_cores() -> None:
    spare = set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)
    if spare:
        os.sched_setaffinity(0, spare)


def compile_loop(stop, move: bool) -> None:
    if move:
        other_cores()
    from kapc.compiler import compile_to_kapb
    from kapc.passes import CompileContext
    from kapc.prior import load_prior

    ctx, prior = CompileContext(model=MODEL, engine="vllm-cpu"), load_prior(PRIOR)
    while not stop.is_set():
        compile_to_kapb(prior, None, ctx, block_size=32)


def compile_process() -> None:
    compile_loop(threading.Event(), move=True)


def main() -> None:
    os.sched_setaffinity(0, {0})
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ids = torch.randint(100, 20000, (8, 4))

    def forward_ms(n: int = 30) -> float:
        ts = []
        with torch.inference_mode():
            for _ in range(n):
                t = time.perf_counter()
                model(ids)
                ts.append(time.perf_counter() - t)
        kept = sorted(ts)[3:-3]
        return 1000 * sum(kept) / len(kept)

    print(f"alone: {forward_ms():.0f} ms")
    for move, where in ((False, "same core"), (True, "other core")):
        stop = threading.Event()
        t = threading.Thread(target=compile_loop, args=(stop, move))
        t.start()
        time.sleep(3)
        print(f"compile thread, {where}: {forward_ms():.0f} ms")
        stop.set()
        t.join()
    p = mp.get_context("spawn").Process(target=compile_process, daemon=True)
    p.start()
    time.sleep(6)
    print(f"compile process, other core: {forward_ms():.0f} ms")
    p.terminate()
    print(f"alone: {forward_ms():.0f} ms")


if __name__ == "__main__":
    main()
