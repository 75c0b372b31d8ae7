"""The compiler as one call: a prior (or a `.kap` module at any stage) in, `.kapb` bytes out.

What `kapc compile` does, for Python callers (benchmarks, tests, a serving frontend)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kapc.errors import excerpt
from kapc.ingest import module_from_prior
from kapc.ir import Module
from kapc.limits import MAX_BLOCK_SIZE
from kapc.lower.lower import lower_module
from kapc.passes import CompileContext, Pass
from kapc.passes.resolve_pages import ResolvePages
from kapc.pipeline import (
    PipelineError,
    PipelineResult,
    parse_pipeline,
    remaining_default,
    run_pipeline,
)
from kapc.policy import ENGINE_BLOCK_SIZE
from kapc.prior import Prior, load_prior


def as_module(source: Prior | Module | str | Path) -> Module:
    """A prior, a prior.json path, a `.kap` path, or a module, as a module."""
    if isinstance(source, Module):
        return source
    if isinstance(source, Prior):
        return module_from_prior(source)
    path = Path(source)
    if path.suffix == ".kap":
        from kapc.checker import check_module
        from kapc.parse import parse_file_located

        module, where = parse_file_located(path)
        check_module(module, source=where)
        return module
    return module_from_prior(load_prior(path))


def compile_module(
    source: Prior | Module | str | Path,
    passes: str | None = None,
    ctx: CompileContext | None = None,
    block_size: int | None = None,
    **run_options,
) -> PipelineResult:
    """Run `passes` (default: the default pipeline less what already ran) over `source`.
    `block_size` sets `resolve-pages`' block size (the target engine's KV block size)."""
    pipeline = build_pipeline(passes, block_size)
    module = as_module(source)
    ctx = ctx or CompileContext()
    pipeline = pipeline if pipeline is not None else remaining_default(module)
    if block_size is not None:
        pipeline = _with_block_size(pipeline, module, block_size)
    return run_pipeline(module, pipeline, ctx, **run_options)


def build_pipeline(passes: str | None, block_size: int | None = None) -> list[Pass] | None:
    """Parse and check `passes` (and the block size) before any input is read; None: default."""
    if block_size is not None and not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise PipelineError(f"--block-size must be within 1..{MAX_BLOCK_SIZE}, not {block_size}")
    pipeline = parse_pipeline(passes) if passes else None
    if pipeline is not None and block_size is not None:
        for p in pipeline:
            if (
                isinstance(p, ResolvePages)
                and "block-size=" in p.options_text()
                and p.block_size != block_size
            ):
                raise PipelineError(
                    f"--block-size {block_size} contradicts "
                    f"resolve-pages{{block-size={p.block_size}}} in --passes"
                )
    return pipeline


def _with_block_size(pipeline: list[Pass], module: Module, block_size: int) -> list[Pass]:
    if module.pages is not None and module.pages.block_size != block_size:
        raise PipelineError(
            f"module {module.kap.name!r} already has pages of block size "
            f"{module.pages.block_size}; compile from a stage before "
            f"resolve-pages to get block size {block_size}"
        )
    return [
        dataclasses.replace(p, block_size=block_size) if isinstance(p, ResolvePages) else p
        for p in pipeline
    ]


def block_size_for(engine: str | None, block_size: int | None) -> int | None:
    """`--engine` names a block size (kapc.policy.ENGINE_BLOCK_SIZE); `--block-size` wins."""
    if engine is None:
        return block_size
    if engine not in ENGINE_BLOCK_SIZE:
        raise PipelineError(
            f"--engine must be one of {', '.join(ENGINE_BLOCK_SIZE)}, not {excerpt(engine)}"
        )
    return block_size if block_size is not None else ENGINE_BLOCK_SIZE[engine]


def compile_to_kapb(
    source: Prior | Module | str | Path,
    passes: str | None = None,
    ctx: CompileContext | None = None,
    block_size: int | None = None,
    **run_options,
) -> bytes:
    ctx = ctx or CompileContext()
    return lower_module(compile_module(source, passes, ctx, block_size, **run_options).module, ctx)
