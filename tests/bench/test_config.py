"""A sweep's settings: bad ones are refused with the reason, a resumed sweep must agree with the
one it resumes, and a torn results file loses only its torn line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kapc.bench import BenchConfig, BenchError
from kapc.bench import run as R


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"methods": ("full", "magic")}, "unknown method"),
        ({"datasets": ("nq",)}, "unknown dataset"),
        ({"workloads": ("medium",)}, "unknown workload"),
        ({"engine": "tgi"}, "--engine"),
        ({"baseline": "other"}, "--baseline"),
        ({"lengths": (100,)}, "at least 256"),
        ({"k": "9"}, "--k"),
        ({"questions": 0}, "at least 1"),
    ],
)
def test_bad_settings_are_refused(tmp_path, kw, msg):
    with pytest.raises(BenchError, match=msg):
        BenchConfig(out=tmp_path, **kw).check()


def test_a_resumed_sweep_must_keep_its_settings(tmp_path):
    R.start_config(BenchConfig(out=tmp_path, batch=8))
    R.start_config(BenchConfig(out=tmp_path, batch=8, questions=100))  # more questions: fine
    with pytest.raises(BenchError, match=r"batch 8 -> 4"):
        R.start_config(BenchConfig(out=tmp_path, batch=4))


def test_results_file_survives_a_torn_line(tmp_path):
    path = tmp_path / R.RESULTS
    row = {
        "dataset": "hotpotqa",
        "workload": "short",
        "length": 1024,
        "method": "full",
        "index": 0,
        "text": "a",
    }
    R.append_rows(path, [row, dict(row, index=1)])
    R.append_rows(path, [dict(row, text="b")])  # a rerun of the same row replaces it
    with path.open("a") as fh:
        fh.write(json.dumps(dict(row, index=2))[:20])  # interrupted mid-write
    rows = R.read_rows(path)
    assert sorted(k[-1] for k in rows) == [0, 1]
    assert rows[("hotpotqa", "short", 1024, "full", 0)]["text"] == "b"


def test_a_length_is_the_whole_sequence_the_engine_holds():
    cfg = BenchConfig(out=".")
    for length in (1024, 8192):
        n = R.context_tokens(cfg, length)
        assert n + cfg.long_tokens + 2 * R.MAX_K + cfg.block_size + 32 == length
    # the room follows the output cap, so a longer answer leaves a shorter prompt
    assert (
        R.context_tokens(BenchConfig(out=".", long_tokens=260), 8192)
        == R.context_tokens(cfg, 8192) - 100
    )


def test_work_items_reuse_the_prefix_cache(tmp_path):
    items = R.work_items(BenchConfig(out=tmp_path, questions=3, batch=2, lengths=(2048, 1024)))
    assert items[:4] == [
        ("hotpotqa", (0, 1), 1024, "short"),
        ("hotpotqa", (0, 1), 1024, "long"),
        ("hotpotqa", (0, 1), 2048, "short"),
        ("hotpotqa", (0, 1), 2048, "long"),
    ]
    assert items[4][1] == (2,) and len(items) == 8


def test_rounds_grow_by_whole_batches(tmp_path):
    def rounds(**kw):
        return R.rounds(BenchConfig(out=tmp_path, **kw))

    assert rounds(questions=100, batch=8, round_questions=32) == [32, 64, 96, 100]
    assert rounds(questions=100, batch=8, round_questions=20) == [24, 48, 72, 96, 100]
    assert rounds(questions=8, batch=8, round_questions=32) == [8]
    assert rounds(questions=64, batch=8, round_questions=32) == [32, 64]
    # a later round's batches are the earlier round's plus new ones, never a regrouping
    small = R.work_items(BenchConfig(out=tmp_path, questions=24, batch=8))
    large = R.work_items(BenchConfig(out=tmp_path, questions=48, batch=8))
    assert large[: len(small)] == small


def _kapc(*args):
    return subprocess.run([sys.executable, "-m", "kapc", *args], capture_output=True, text=True)


def test_cli_errors_are_one_line(tmp_path):
    proc = _kapc("bench", "--out", str(tmp_path / "b"), "--methods", "full,magic")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "kapc: error: unknown method(s) magic; choose from full, kapc, kapc-top3, physical, "
        "random, window"
    ]
    proc = _kapc("bench", "--out", str(tmp_path / "none"), "--report-only")
    assert proc.returncode == 1 and "holds no results.jsonl" in proc.stderr
    proc = _kapc("bench", "--out", str(tmp_path / "b"), "--lengths", "1k")
    assert proc.returncode == 1 and "comma-separated integers" in proc.stderr
