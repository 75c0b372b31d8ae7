"""The load benchmark as a user runs it (a small stream): the same requests through plain vLLM's
server and `kapc serve`, each a real server process, every greedy output compared."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_the_load_benchmark_compares_the_two_servers(tmp_path):
    rows_file = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.serve_load", "--requests", "4", "--concurrency", "2"]
        + ["--contexts", "1024", "--questions", "2", "--max-tokens", "16"]
        + ["--json", str(rows_file)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["server"]: r for r in json.loads(rows_file.read_text())}
    assert set(rows) == {"vllm", "kapc"}
    assert all(r["requests"] == 4 and r["lost"] == 0 and r["out_tok_s"] > 0 for r in rows.values())
    kapc = rows["kapc"]
    assert kapc["changed"] == 0  # every greedy output equals plain vLLM's
    assert kapc["share_plan"] + kapc["share_fallback"] == pytest.approx(1.0)
    assert kapc["compiles"] >= 1 and kapc["share_refused"] == 0.0
