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


def words(text: str) -> tuple[str, ...]:
    """A comma-separated option's items, blanks dropped."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def positive_ints(text: str, option: str) -> tuple[int, ...]:
    """A comma-separated option's positive integers, or a KapcError that names `option`."""
    from kapc.errors import KapcError

    try:
        values = tuple(int(x) for x in words(text))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise KapcError(
            f"{option} takes positive integers: comma-separated integers such as 1024,4096, "
            f"not {text!r}"
        )
    return values
