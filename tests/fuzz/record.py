"""Run inputs through a target, record findings (deduplicated by signature) and summarise.

A finding is written to `tests/fuzz/crashes/TARGET/<hash>.bin` (the input) and `<hash>.txt`
(signature, options, description, traceback), where <hash> is a hash of the signature (and of
the target options, if any are set). A later input with the same signature replaces the files
only if it is smaller, so the stored reproducer shrinks over time."""

from __future__ import annotations

import json
import resource
import time
from collections import Counter
from pathlib import Path

FUZZ_DIR = Path(__file__).resolve().parent
CRASH_DIR = FUZZ_DIR / "crashes"
CORPUS_DIR = FUZZ_DIR / "corpus"
SLOW_SECONDS = 10.0


def limit_memory(mb: int) -> None:
    """Cap the address space so that a runaway allocation is a MemoryError (a finding), not an
    OOM-killed run."""
    if mb > 0:
        soft = mb * 1024 * 1024
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


class Recorder:
    def __init__(
        self,
        target: str,
        options: dict | None = None,
        crash_dir: Path = CRASH_DIR,
        write: bool = True,
    ):
        from tests.fuzz import targets

        self.targets = targets
        self.target, self.options = target, {k: v for k, v in (options or {}).items() if v}
        self.dir = crash_dir / target
        self.write = write
        self.runs = 0
        self.findings = 0
        self.by_signature: Counter[str] = Counter()
        self.example: dict[str, str] = {}  # signature -> file stem
        self.t0 = time.perf_counter()

    def run(self, data: bytes) -> None:
        self.runs += 1
        t = time.perf_counter()
        try:
            self.targets.run(self.target, data, **self.options)
        except self.targets.Finding as finding:
            self.record(finding, data)
        took = time.perf_counter() - t
        if took > SLOW_SECONDS:
            self.record(
                self.targets.Finding(
                    self.target, "slow", f"over {SLOW_SECONDS:.0f}s", f"one input took {took:.1f}s"
                ),
                data,
            )

    def record(self, finding, data: bytes) -> None:
        self.findings += 1
        self.by_signature[finding.signature] += 1
        stem = self.targets.signature_hash(finding.signature, self.options)
        self.example[finding.signature] = stem
        if not self.write:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        bin_path, txt_path = self.dir / f"{stem}.bin", self.dir / f"{stem}.txt"
        if bin_path.exists() and bin_path.stat().st_size <= len(data):
            return
        bin_path.write_bytes(data)
        preview = "".join(
            c
            if c in "\n\t" or (c.isprintable() and not 0xD800 <= ord(c) < 0xE000)
            else ascii(c)[1:-1]
            for c in data[:600].decode("utf-8", "backslashreplace")
        )
        txt_path.write_text(
            f"signature: {finding.signature}\n"
            f"target: {self.target}\n"
            f"options: {json.dumps(self.options, sort_keys=True)}\n"
            f"input: {bin_path.name} ({len(data)} bytes)\n"
            f"description: {finding.description}\n"
            f"rerun: python -m tests.fuzz.replay {bin_path.relative_to(FUZZ_DIR.parent.parent)}\n"
            f"\n--- input (first 600 bytes, utf-8 with backslash escapes) ---\n{preview}\n"
            f"\n--- traceback ---\n{finding.trace or '(no exception: an accepted-but-wrong input)'}\n",
            encoding="utf-8",
        )

    def summary(self) -> str:
        took = time.perf_counter() - self.t0
        rate = self.runs / took if took > 0 else 0.0
        lines = [
            f"== {self.target} {self.options or ''}: {self.runs} inputs run in {took:.0f}s "
            f"({rate:.0f}/s), {self.findings} findings, {len(self.by_signature)} distinct"
        ]
        by_kind = Counter(sig.split("|")[1] for sig in self.by_signature)
        if by_kind:
            lines.append(
                "   distinct by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(by_kind.items()))
            )
        for sig, count in self.by_signature.most_common():
            lines.append(f"   {count:7d}  {sig}  [{self.dir.name}/{self.example[sig]}.bin]")
        return "\n".join(lines)
