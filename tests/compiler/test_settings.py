"""Every KAPC_* environment switch is read through kapc.settings, and documented there."""

import inspect
import re
from pathlib import Path

import pytest

from kapc import settings

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bKAPC_[A-Z][A-Z_]*[A-Z]\b")
# a read: os.environ.get("KAPC_X"), os.getenv("KAPC_X") or os.environ["KAPC_X"] not assigned to
READ = re.compile(
    r"(?:environ\.get|getenv)\(\s*[\"'](KAPC_\w+)|environ\[\s*[\"'](KAPC_\w+)[\"']\](?!\s*=[^=])"
)


def _sources():
    for folder in ("kapc", "benchmarks"):
        yield from (ROOT / folder).rglob("*.py")


def test_only_settings_reads_kapc_switches():
    readers = [
        f"{path.relative_to(ROOT)}: {m.group(1) or m.group(2)}"
        for path in _sources()
        if path.name != "settings.py" or path.parent.name != "kapc"
        for m in READ.finditer(path.read_text())
    ]
    assert readers == []


def test_every_switch_mentioned_anywhere_is_defined():
    texts = [p.read_text() for p in _sources()]
    texts += [p.read_text() for p in (ROOT / "docs").glob("*.md")]
    texts += [(ROOT / name).read_text() for name in ("README.md", "Makefile")]
    mentioned = {n for t in texts for n in NAME.findall(t)}
    assert mentioned - set(settings.SWITCHES) == set()


@pytest.mark.parametrize("name", settings.SWITCHES)
def test_every_switch_has_a_documented_reader(name):
    readers = [
        f
        for _, f in inspect.getmembers(settings, inspect.isfunction)
        if f.__module__ == settings.__name__ and name in (f.__doc__ or "")
    ]
    assert readers, f"no function in kapc.settings documents {name}"
    assert f"`{name}" in (ROOT / "docs" / "runtime.md").read_text(), f"docs/runtime.md: {name}"


def test_bad_values_are_refused_by_name(monkeypatch):
    monkeypatch.setenv("KAPC_DEMO_INDEX", "three")
    with pytest.raises(settings.SettingError, match="KAPC_DEMO_INDEX"):
        settings.demo_index()
    monkeypatch.setenv("KAPC_DENSE_PRECISION", "int8")
    with pytest.raises(settings.SettingError, match="float32 or bfloat16"):
        settings.dense_precision()
    monkeypatch.setenv("KAPC_QUIET", "0")
    assert not settings.quiet()
