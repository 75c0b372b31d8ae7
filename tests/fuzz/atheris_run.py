"""Coverage-guided fuzzing of one target with atheris (libFuzzer), kapc instrumented.

    python -m tests.fuzz.atheris_run TARGET [-runs=N] [-max_total_time=S] [libFuzzer flags...]
                                     [--deep] [--surrogatepass] [--mem-mb=8192] [CORPUS_DIR...]

TARGET is prior, kap, kapb or pipeline. Seeds come from tests/fuzz/corpus/TARGET/ (plus any
CORPUS_DIR given); inputs libFuzzer finds interesting go to .cache/fuzz/corpus-TARGET/ (git-ignored),
never into the seed folder. Findings do not stop the run: they are recorded, deduplicated by
signature, under tests/fuzz/crashes/TARGET/ and summarised at the end. For `kapb` a custom mutator
mutates the header/arrays of a plan and re-seals it (length and SHA-256) most of the time.
"""

from __future__ import annotations

import atexit
import os
import random
import sys
import time
from pathlib import Path

import atheris

ROOT = Path(__file__).resolve().parents[2]
FUZZ_DIR = ROOT / "tests" / "fuzz"


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in ("prior", "kap", "kapb", "pipeline"):
        sys.exit(__doc__)
    target = argv[1]
    options = {"deep": False, "surrogatepass": False}
    mem_mb, fuzzer_flags, dirs, runs, max_time = 8192, [], [], None, None
    instrument = ["kapc"]
    for arg in argv[2:]:
        if arg in ("--deep", "--surrogatepass"):
            options[arg[2:]] = True
        elif arg.startswith("--mem-mb="):
            mem_mb = int(arg.split("=", 1)[1])
        elif arg.startswith("--instrument="):
            instrument = [m for m in arg.split("=", 1)[1].split(",") if m]
        elif arg.startswith("-") and not arg.startswith("--"):
            fuzzer_flags.append(arg)
            if arg.startswith("-runs="):
                runs = int(arg.split("=", 1)[1])
            if arg.startswith("-max_total_time="):
                max_time = int(arg.split("=", 1)[1])
        else:
            dirs.append(arg)
    work = ROOT / ".cache" / "fuzz" / f"corpus-{target}"
    work.mkdir(parents=True, exist_ok=True)
    seeds = FUZZ_DIR / "corpus" / target
    dict_file = FUZZ_DIR / "dicts" / f"{target}.dict"
    if dict_file.exists() and not any(f.startswith("-dict=") for f in fuzzer_flags):
        fuzzer_flags.append(f"-dict={dict_file}")
    if not any(f.startswith("-timeout=") for f in fuzzer_flags):
        fuzzer_flags.append("-timeout=300")
    if not any(f.startswith("-rss_limit_mb=") for f in fuzzer_flags):
        fuzzer_flags.append(f"-rss_limit_mb={max(mem_mb, 2048) + 1024}")
    if not any(f.startswith("-max_len=") for f in fuzzer_flags):
        fuzzer_flags.append("-max_len=65536")

    from tests.fuzz.record import Recorder, limit_memory

    limit_memory(mem_mb)
    with atheris.instrument_imports(include=instrument):
        import kapc.checker  # noqa: F401 - instrumented before the targets import it
        import kapc.ingest  # noqa: F401
        import kapc.lower.kapb  # noqa: F401
        import kapc.parse  # noqa: F401
        import kapc.pipeline  # noqa: F401
        import kapc.prior  # noqa: F401

        if any(options.values()):
            import kapc.compiler  # noqa: F401
            import kapc.lower.lower  # noqa: F401
    from tests.fuzz import kapb_tools, targets

    if options["deep"]:
        targets.model_ctx()
    rec = Recorder(target, options)
    done = {"printed": False}

    def report() -> None:
        if not done["printed"]:
            done["printed"] = True
            print("\n" + rec.summary(), flush=True)

    atexit.register(report)

    # libFuzzer ends a run with C exit(), which skips Python's atexit: stop ourselves just before
    # it would (-runs / -max_total_time) so that the summary is printed.
    deadline = time.monotonic() + max_time - 2 if max_time else None

    def test_one(data: bytes) -> None:
        rec.run(data)
        if (runs is not None and rec.runs >= runs) or (deadline and time.monotonic() > deadline):
            report()
            os._exit(1 if rec.findings else 0)  # `make fuzz` fails on any finding

    kwargs = {}
    if target == "kapb":

        def mutator(data: bytes, max_size: int, seed: int) -> bytes:
            rng = random.Random(seed)
            roll = rng.random()
            if kapb_tools.is_kapb(data) and roll < 0.45:
                return kapb_tools.mutate(data, rng, steps=rng.choice([1, 1, 1, 2, 3]))[:max_size]
            if kapb_tools.is_kapb(data) and roll < 0.9:
                # byte-level mutation of the body, then re-seal (sometimes with another header length)
                version, head_len, body = kapb_tools.unseal(data)
                body = atheris.Mutate(body, max(len(body) + 64, 64))
                if rng.random() < 0.1:
                    head_len = max(0, head_len + rng.choice([-8, -1, 1, 8, 4096]))
                return kapb_tools.reseal(body, head_len, version)[:max_size]
            return atheris.Mutate(data, max_size)

        kwargs["custom_mutator"] = mutator

    libfuzzer_argv = [argv[0], *fuzzer_flags, str(work), str(seeds), *dirs]
    print(f"atheris {target}: {' '.join(libfuzzer_argv[1:])}", flush=True)
    atheris.Setup(libfuzzer_argv, test_one, **kwargs)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
