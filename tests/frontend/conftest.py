"""Shared fixtures for the frontend tests: real data, real models, loaded once per session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("KAPC_QUIET", "1")

from tests.frontend.common import QUESTIONS, TARGETS


@pytest.fixture(scope="session")
def tokenizer():
    from kapc.frontend.prompt import prompt_tokenizer

    return prompt_tokenizer()


@pytest.fixture(scope="session")
def contexts():
    """{(question index, target): LongContext} for QUESTIONS x TARGETS."""
    from kapc.frontend.longctx import build_hotpotqa

    return {(i, n): build_hotpotqa(i, n) for i in QUESTIONS for n in TARGETS}
