"""The reference executor's decoding benchmark as a user runs it (a small cell): it decodes the
same batch with full context and under the frontend's plans, and says so truthfully."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.model


def test_the_decode_benchmark_compares_plans_with_full_context(tmp_path):
    rows_file = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.decode", "--contexts", "1024", "--batches", "2"]
        + ["--new-tokens", "12", "--json", str(rows_file)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(rows_file.read_text())
    assert (row["context"], row["batch"], row["accept"]) == (1024, 2, "greedy")
    assert row["identical"] is True and row["fallbacks"] == []  # reasons, one per fallback
    assert row["full_tok_s"] > 0 and row["plan_tok_s"] > 0
    assert 0 < row["s"] < 1 and 0 <= row["h"] <= 1
    assert row["speedup_measured"] == pytest.approx(row["plan_tok_s"] / row["full_tok_s"])
