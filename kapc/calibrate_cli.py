"""`kapc calibrate ...`: measure this machine's engine and keep the profiles the cost model prices
plans with. A typer sub-app (`calibrate_app`), mounted by kapc.cli:

    measure   time decode steps on a grid and fit the step and acceptance models
    show      print profiles: fits, their forecast error, where plans pay
    refit     fit profiles again from their own samples, as this kapc fits them
    plot      measured against fitted step times, as PNG
    proxy     measure which EarlySelectKV proxy picks each layer's pages best (es-mix)
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kapc.errors import KapcError
from kapc.options import BlockSizeOpt, ModelOpt, positive_ints, words

calibrate_app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Measure this machine's engine for the cost model, and read the profiles it keeps.",
)

ProfilesArg = Annotated[
    list[Path] | None,
    typer.Argument(
        help="Profile files (default: every profile in kapc's cache).", show_default=False
    ),
]


def _profile_files(given: list[Path] | None) -> list[Path]:
    from kapc.profile import profiles_dir

    if given:
        return given
    files = sorted(profiles_dir().glob("*.json"))
    if not files:
        raise KapcError(f"no profiles in {profiles_dir()}; run kapc calibrate measure")
    return files


@calibrate_app.command()
def measure(
    engine: Annotated[
        str, typer.Option(help="vllm (vllm-cpu here, vllm-gpu on a GPU) or reference.")
    ] = "vllm",
    grid: Annotated[
        str,
        typer.Option(
            help="quick (a few minutes, a rough profile), default (about 10 minutes on a 2-core "
            "CPU) or full (every point the fits can use; most of an hour)."
        ),
    ] = "default",
    contexts: Annotated[
        str | None,
        typer.Option(help="Context lengths to time, comma-separated (default: the grid's)."),
    ] = None,
    batches: Annotated[
        str | None, typer.Option(help="Batch sizes to time, comma-separated (default: the grid's).")
    ] = None,
    only: Annotated[
        str | None,
        typer.Option(
            help="Measure only these kinds of point again (comma-separated: plain, resting, cycle, "
            "select, tolerant, acceptance), keeping the rest of this engine's profile; with "
            "--contexts/--batches, those cells are added to it."
        ),
    ] = None,
    model: ModelOpt = None,
    block_size: BlockSizeOpt = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="float32, bfloat16, ... (default: float32 on CPU, bfloat16 on a GPU)."),
    ] = None,
    served: Annotated[
        bool,
        typer.Option(
            "--served/--in-process",
            help="Time vLLM as `kapc serve` runs it: its worker in a process of its own, on the "
            "cores vLLM binds it to (one of two on a 2-core CPU). --in-process: one process on "
            "every core, as `kapc run` and `kapc bench` run it. Each keeps its own profile; the "
            "hook takes the one timed with its worker's thread count.",
        ),
    ] = True,
    resume: Annotated[
        bool, typer.Option(help="Continue an interrupted measurement where it stopped.")
    ] = True,
    output: Annotated[
        Path | None,
        typer.Option("-o", "--output", help="Where to write the profile (default: kapc's cache)."),
    ] = None,
) -> None:
    """Time decode steps on this machine and fit the cost model plans are priced with.

    Run it on a quiet machine: anything else running is timed too."""
    import dataclasses

    from kapc.runtime.calibrate import GRIDS, MEASURES, calibrate, show

    if grid not in GRIDS:
        raise KapcError(f"--grid takes {', '.join(GRIDS)}, not {grid!r}")
    kinds = words(only) if only is not None else MEASURES
    if not kinds or any(k not in MEASURES for k in kinds):
        raise KapcError(f"--only takes {', '.join(MEASURES)} (comma-separated), not {only!r}")
    chosen = GRIDS[grid]
    if contexts is not None:  # every context x batch given, instead of the grid's cells
        chosen = dataclasses.replace(
            chosen, contexts=positive_ints(contexts, "--contexts"), cells=()
        )
    if batches is not None:
        chosen = dataclasses.replace(chosen, batches=positive_ints(batches, "--batches"), cells=())
    if not any(p[0] in kinds for p in chosen.points()):
        raise KapcError(
            f"the {grid} grid has no points of kind {', '.join(kinds)}; try --grid full"
        )
    bench = _bench(engine, chosen, model=model, block_size=block_size, dtype=dtype, served=served)
    base = None
    if only is not None:
        from kapc.profile import find_profile

        base = find_profile(bench.engine, bench.fingerprint, threads=bench.threads)
        if base is None or base.threads != bench.threads:
            raise KapcError(
                f"--only: no {bench.engine} profile for this model timed with "
                f"{bench.threads} thread(s) yet; run kapc calibrate measure without it first"
            )
    prof, path = calibrate(bench, chosen, resume=resume, out=output, base=base, only=kinds)
    typer.echo(show(prof))
    typer.echo(f"kapc: profile written to {path}", err=True)


def _bench(
    engine: str,
    grid,
    *,
    model: str | None,
    block_size: int | None,
    dtype: str | None,
    served: bool = True,
):
    if engine == "reference":
        from kapc.runtime.calibrate import ReferenceBench
        from kapc.runtime.model import load_model

        return ReferenceBench(
            block_size=block_size or 16,
            max_context=grid.longest,
            max_batch=grid.widest,
            model=load_model(model, dtype=dtype),
        )
    if engine in ("vllm", "vllm-cpu", "vllm-gpu"):
        from kapc.runtime.vllm.calibrate import VllmBench

        return VllmBench(
            block_size=block_size or 32,
            max_context=grid.longest,
            max_batch=grid.widest,
            dtype=dtype,
            model_dir=model,
            served=served,
        )
    raise KapcError(f"--engine must be vllm or reference, not {engine!r}")


@calibrate_app.command("show")
def show_cmd(
    profiles: ProfilesArg = None,
    against: Annotated[
        Path | None,
        typer.Option(
            help="Another profile of the same engine and model (for example measured with other "
            "--contexts/--batches): how well each profile forecasts the steps it measured."
        ),
    ] = None,
) -> None:
    """Print profiles: their fits, how far they miss, and where plans pay.

    For each profile: what was measured, every fitted step model with its error on its own
    samples and left out of the fit, the acceptance models, and from which context a plan pays."""
    from kapc.profile import load_profile
    from kapc.runtime.calibrate import forecast_check, show

    held_out = load_profile(against) if against else None
    for f in _profile_files(profiles):
        p = load_profile(f)
        typer.echo(f"{f}\n{show(p)}")
        if held_out is not None:
            typer.echo(forecast_check(p, held_out, against=str(against)))
        typer.echo("")


@calibrate_app.command()
def refit(profiles: ProfilesArg = None) -> None:
    """Fit profiles again from their own samples, as this kapc fits them; measures nothing."""
    from kapc.profile import load_profile, refitted, save_profile
    from kapc.runtime.calibrate import show

    for f in _profile_files(profiles):
        p = refitted(load_profile(f))
        save_profile(p, f)
        typer.echo(f"{f} (fitted again)\n{show(p)}\n")


@calibrate_app.command()
def plot(
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the PNG.")],
    profile: Annotated[
        Path | None,
        typer.Argument(help="A profile file (default: the only one in kapc's cache)."),
    ] = None,
) -> None:
    """Plot measured against fitted step times as PNG, one panel per kind of step."""
    from kapc.files import check_output
    from kapc.profile import load_profile
    from kapc.runtime.calibrate import plot as plot_profile

    check_output(output, "--output")
    files = _profile_files([profile] if profile else None)
    if len(files) > 1:
        raise KapcError(
            f"{len(files)} profiles in the cache; name the one to plot: "
            + ", ".join(f.name for f in files)
        )
    typer.echo(f"kapc: plot written to {plot_profile(load_profile(files[0]), output)}", err=True)


@calibrate_app.command()
def proxy(
    output: Annotated[
        Path, typer.Option("-o", "--output", help="Where to write the calibration (JSON).")
    ],
    questions: Annotated[
        int, typer.Option(help="HotpotQA calibration questions (dev 1000 on).")
    ] = 4,
    context: Annotated[int, typer.Option(help="Prompt length in tokens.")] = 4096,
    budget: Annotated[
        float, typer.Option(help="Retained ratio the dynamic choice may read.")
    ] = 0.15,
    tokens: Annotated[int, typer.Option(help="Tokens decoded per question.")] = 32,
    block_size: BlockSizeOpt = None,
    model: ModelOpt = None,
) -> None:
    """Measure which EarlySelectKV proxy picks each layer's pages best (for proxy=es-mix)."""
    from kapc.files import check_output
    from kapc.proxy_mix import save_mix
    from kapc.runtime.model import load_model
    from kapc.runtime.proxy_calibration import calibrate_proxy

    check_output(output, "--output")
    if not 0.0 < budget <= 1.0 or questions < 1 or tokens < 2:
        raise KapcError("--budget lies in (0, 1]; --questions is at least 1, --tokens at least 2")
    mix = calibrate_proxy(
        load_model(model),
        questions=questions,
        context=context,
        budget=budget,
        tokens=tokens,
        block_size=block_size or 16,
        progress=lambda msg: typer.echo(f"kapc: {msg}", err=True),
    )
    typer.echo("layer  es-in  es-mid  choice")
    for i, (a, b, c) in enumerate(zip(mix.overlap_in, mix.overlap_mid, mix.mix)):
        typer.echo(f"{i:>5}  {a:.3f}  {b:.3f}   {c}")
    typer.echo(f"kapc: proxy calibration written to {save_mix(mix, output)}", err=True)
