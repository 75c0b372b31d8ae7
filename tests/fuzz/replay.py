"""Replay inputs through their target and print what happens (the traceback of a finding).

    python -m tests.fuzz.replay PATH...        # files under tests/fuzz/{corpus,crashes}/TARGET/
    python -m tests.fuzz.replay --target kap --deep FILE

The target is the name of the folder a file lies in unless --target is given; a crash file's
options (deep, surrogatepass) are read from the `.txt` next to it."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path


def options_for(path: Path) -> dict:
    txt = path.with_suffix(".txt")
    if path.suffix == ".bin" and txt.exists():
        for line in txt.read_text(encoding="utf-8").splitlines():
            if line.startswith("options: "):
                return json.loads(line[len("options: ") :])
    return {}


def main(argv: list[str]) -> int:
    from tests.fuzz import targets

    target, forced, files = None, {}, []
    it = iter(argv)
    for arg in it:
        if arg == "--target":
            target = next(it)
        elif arg in ("--deep", "--surrogatepass"):
            forced[arg[2:]] = True
        else:
            files.append(Path(arg))
    bad = 0
    for f in files:
        t = target or f.parent.name
        opts = {**options_for(f), **forced}
        try:
            targets.run(t, f.read_bytes(), **opts)
            print(f"{f}: ok ({t} {opts or ''})")
        except targets.Finding as finding:
            bad += 1
            print(f"{f}: FINDING {finding.signature}\n  {finding.description}")
            if finding.trace:
                print("  " + finding.trace.replace("\n", "\n  "))
        except Exception:  # noqa: BLE001
            bad += 1
            traceback.print_exc()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
