"""Replay the fuzz seed corpora, the regression inputs (bugs found and fixed) and every recorded
finding through its target: none may produce a finding. A crash file under tests/fuzz/crashes/ fails here until the bug it records is fixed; then
delete the file (and its .txt), or move the input into tests/fuzz/corpus/TARGET/ as a seed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fuzz.replay import options_for

FUZZ = Path(__file__).resolve().parent
TARGETS = ("prior", "kap", "kapb", "pipeline")


def _cases():
    for kind in ("corpus", "regressions", "crashes"):
        for target in TARGETS:
            folder = FUZZ / kind / target
            if not folder.is_dir():
                continue
            for f in sorted(folder.iterdir()):
                if f.is_file() and not (kind != "corpus" and f.suffix != ".bin"):
                    yield pytest.param(target, f, id=f"{kind}/{target}/{f.name}")


@pytest.mark.parametrize(("target", "path"), list(_cases()))
def test_replay(target: str, path: Path) -> None:
    from tests.fuzz import targets

    options = options_for(path)
    if options.get("deep"):
        pytest.importorskip("tokenizers")
    try:
        targets.run(target, path.read_bytes(), **options)
    except targets.Finding as finding:
        detail = f"\n{finding.trace}" if finding.trace else ""
        pytest.fail(f"{finding.signature}\n{finding.description}{detail}", pytrace=False)
