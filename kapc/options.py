"""Command-line options that several `kapc` command groups share (typer annotations only)."""

from __future__ import annotations

from typing import Annotated

import typer

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="A model's name (smollm2-135m-instruct, the default; "
        "qwen2.5-coder-0.5b-instruct; `kapc models` lists them) or a local Hugging Face folder.",
    ),
]
BlockSizeOpt = Annotated[
    int | None,
    typer.Option(
        "--block-size", help="The target engine's KV block size (sets resolve-pages' block-size)."
    ),
]
