"""Where each server process's time goes under the same load, plain vLLM against kapc's engine with
no priors: py-spy samples every process of each server (API server, engine core, worker; Python
frames, without stopping them) for 20-40 s in the middle of a load of 2K and 4K HotpotQA prompts,
prefilled first.

    CONC=64 python benchmarks/records/serve-load-rounds-avx512-vllm-cpu/profile_servers.py OUT

writes OUT/<server>-<pid>-<process>.txt (py-spy's raw collapsed stacks) and prints each server's
output throughput over the load. Needs py-spy beside the interpreter (`pip install py-spy`). The
sampler itself takes CPU time from the core vLLM reserves for its engine core and API server.
"""

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.serve_load import build_priors, request_stream, run_phase
from kapc.runtime.vllm.serve import free_port, running, server_command

CONC = int(os.environ.get("CONC", "8"))
SPY = str(Path(sys.executable).with_name("py-spy"))


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command name) of every process below `pid`."""
    table = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,comm="], capture_output=True, text=True)
    children: dict[int, list[tuple[int, str]]] = {}
    for line in table.stdout.splitlines():
        p, parent, comm = line.split(None, 2)
        children.setdefault(int(parent), []).append((int(p), comm.strip()))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child[0])
    return found


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pool = build_priors([2048, 4096], 6, 0, 48)
    jobs = request_stream(pool, 96, 0.0, 0)
    seconds = "20" if CONC > 8 else "40"
    for name, hook in [("vllm", False), ("kapc", True)]:
        cmd = server_command(
            None, port=free_port(), hook=hook, max_model_len=4608, extra=["--max-num-seqs", "64"]
        )
        with running(cmd.argv, cmd.url, out / f"{name}.log") as proc:
            run_phase(cmd.url, pool, ("concurrency", 8), 1, False, f"{name}-warm")
            with ThreadPoolExecutor(1) as loader:
                load = loader.submit(
                    run_phase, cmd.url, jobs, ("concurrency", CONC), 48, False, f"{name}-load"
                )
                time.sleep(8)  # into the load
                spies = [
                    subprocess.Popen(
                        [SPY, "record", "--nonblocking", "-r", "40", "-d", seconds, "-f", "raw"]
                        + ["-o", str(out / f"{name}-{pid}-{comm}.txt"), "-p", str(pid)],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                    for pid, comm in [(proc.pid, "api-server"), *descendants(proc.pid)]
                ]
                for spy in spies:
                    spy.wait()
                results, wall = load.result()
            print(name, f"{sum(r['tokens'] for r in results) / wall:.1f} tokens a second")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
