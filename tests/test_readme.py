"""The README is the front door: its results table is the one its record generates, and every
path it names exists in the repository (it points nowhere outside it)."""

import re
from pathlib import Path

from benchmarks.lengths import read_runs, table

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_results_tables_are_generated_from_the_records_rows():
    tables = list(
        re.finditer(r"<!-- results table: (.+?) -->\n(.*?)<!-- end results table -->", README, re.S)
    )
    assert tables, "README has no generated results table"
    for m in tables:
        paths = [ROOT / p for p in m.group(1).split()]
        assert m.group(2).strip().splitlines() == table(read_runs(paths)), m.group(1)


def test_every_path_the_readme_names_exists_inside_the_repository():
    assert "../" not in README
    named = set(
        re.findall(
            r"`((?:docs|benchmarks/records|examples|requirements|tests|kapc)/[^`\s]*)`", README
        )
    )
    named |= set(re.findall(r"(benchmarks/records/[\w./-]+|docs/[\w-]+\.md)", README))
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/.,")).exists())
    assert named and missing == []
