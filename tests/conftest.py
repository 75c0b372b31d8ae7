"""Shared fixtures: the real model's tokenizer (through the compiler's own context) and the real
HotpotQA example priors under examples/."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="session")
def ctx():
    from kapc.passes import CompileContext

    return CompileContext()  # the default SmolLM2-135M-Instruct, converted once and cached


def example_priors() -> list[Path]:
    found = sorted((EXAMPLES / "hotpotqa").glob("*.prior.json"))
    assert found, f"no example priors under {EXAMPLES / 'hotpotqa'}"
    return found
