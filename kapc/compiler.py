"""The compiler as one call: a prior (or a `.kap` module at any stage) in, `.kapb` bytes out.

What `kapc compile` does, for Python callers (benchmarks, tests, a serving frontend)."""

from __future__ import annotations

from pathlib import Path

from kapc.ingest import module_from_prior
from kapc.ir import Module
from kapc.lower.lower import lower_module
from kapc.passes import CompileContext
from kapc.pipeline import PipelineResult, parse_pipeline, remaining_default, run_pipeline
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
        from kapc.parse import parse_file

        module = parse_file(path)
        check_module(module, where=str(path))
        return module
    return module_from_prior(load_prior(path))


def compile_module(source: Prior | Module | str | Path, passes: str | None = None,
                   ctx: CompileContext | None = None, **run_options) -> PipelineResult:
    """Run `passes` (default: the default pipeline less what already ran) over `source`."""
    module = as_module(source)
    ctx = ctx or CompileContext()
    pipeline = parse_pipeline(passes) if passes else remaining_default(module)
    return run_pipeline(module, pipeline, ctx, **run_options)


def compile_to_kapb(source: Prior | Module | str | Path, passes: str | None = None,
                    ctx: CompileContext | None = None, **run_options) -> bytes:
    ctx = ctx or CompileContext()
    return lower_module(compile_module(source, passes, ctx, **run_options).module, ctx)
