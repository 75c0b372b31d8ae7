"""The `kapc` command line (typer + rich). Heavy imports stay inside the commands that need them,
so `kapc compile/explain/inspect/fmt` start fast and never import torch."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from kapc import settings
from kapc.errors import KapcError
from kapc.models import DEFAULT_MODEL
from kapc.options import BlockSizeOpt, ModelOpt, positive_ints, words
from kapc.policy import MAX_AUTO_K

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Compile retrieval priors into runtime KV access plans, and run them.",
)
schema_app = typer.Typer(no_args_is_help=True, help="Print JSON Schemas of kapc's input formats.")
app.add_typer(schema_app, name="schema")


def _mount_groups() -> None:
    # typer only at import; models and engines load inside the commands
    from kapc.calibrate_cli import calibrate_app
    from kapc.frontend.cli import prior_app

    app.add_typer(prior_app, name="prior")
    app.add_typer(calibrate_app, name="calibrate")


_mount_groups()

PassesOpt = Annotated[
    str | None,
    typer.Option(
        "--passes",
        help="Pipeline, e.g. 'ground,align-spans,select{budget-tokens=1024},"
        "resolve-pages,compact' (default: the default pipeline, less what an input .kap already ran).",
    ),
]
EngineOpt = Annotated[
    str | None,
    typer.Option(
        "--engine",
        help="Compile for this engine's block size: reference (16), vllm-cpu (32) or "
        "vllm-gpu (16); --block-size wins.",
    ),
]


def _err(message: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False).print(
        f"[bold red]kapc: error:[/] {message}", markup=True, soft_wrap=True
    )


@app.command("compile")
def compile_cmd(
    input: Annotated[Path, typer.Argument(help="prior.json, or a .kap file from any stage.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the .kapb plan.")],
    passes: PassesOpt = None,
    model: ModelOpt = None,
    emit_kap: Annotated[
        Path | None, typer.Option(help="Also write the final IR as .kap text.")
    ] = None,
    check_roundtrip: Annotated[
        bool, typer.Option(help="Print and re-parse the IR after every pass.")
    ] = False,
    block_size: BlockSizeOpt = None,
    engine: EngineOpt = None,
) -> None:
    """Compile a prior (or a .kap) into a .kapb plan."""
    from kapc.compiler import block_size_for, compile_module
    from kapc.explain import unmeasured_gain
    from kapc.files import check_output, write_output
    from kapc.lower.kapb import write_plan
    from kapc.lower.lower import lower_module
    from kapc.parse import print_module
    from kapc.passes import CompileContext

    # Every output is checked before the work: a typo in -o should not cost a compile.
    check_output(output, "-o")
    if emit_kap:
        check_output(emit_kap, "--emit-kap")
    ctx = CompileContext(model, engine=engine)
    out = compile_module(
        input, passes, ctx, block_size_for(engine, block_size), roundtrip=check_roundtrip or None
    ).module
    data = lower_module(out, ctx)
    if emit_kap:
        write_output(emit_kap, print_module(out), "--emit-kap")
    write_plan(output, data)
    p, c = out.pages, out.cost
    width = sum(len(r) for r in p.selected)
    verdict = "pays off" if c.pays else "predicted loss: the runtime will fall back to full context"
    typer.echo(
        f"kapc: {output}: {out.kap.name}: {out.prompt.tokens} prompt tokens, {width}/{p.blocks} "
        f"blocks of {p.block_size} (s = {p.retained:.3f}), k = {out.verify.k} "
        f"{out.verify.accept}, predicted speedup {c.speedup:.2f}x ({verdict})",
        err=True,
    )
    if (warning := unmeasured_gain(c)) is not None:
        typer.echo(f"kapc: warning: {warning}", err=True)


@app.command()
def explain(
    input: Annotated[Path, typer.Argument(help="prior.json, or a .kap file from any stage.")],
    passes: PassesOpt = None,
    model: ModelOpt = None,
    print_after: Annotated[
        list[str] | None,
        typer.Option("--print-after", help="Print the IR only after these passes (repeatable)."),
    ] = None,
    full_text: Annotated[
        bool,
        typer.Option(
            help="Print strings whole (each section then parses as .kap); default elides long text."
        ),
    ] = False,
    block_size: BlockSizeOpt = None,
    engine: EngineOpt = None,
) -> None:
    """Show the IR after every pass, with a view of which parts of the prompt each pass keeps."""
    from kapc.compiler import as_module, block_size_for, build_pipeline, compile_module
    from kapc.errors import excerpt
    from kapc.explain import section
    from kapc.passes import PASSES, CompileContext
    from kapc.pipeline import PipelineError

    wanted = set(print_after or [])
    unknown = wanted - set(PASSES)
    if unknown:
        raise PipelineError(
            f"--print-after: unknown pass {excerpt(sorted(unknown)[0])} "
            f"(passes: {', '.join(PASSES)})"
        )
    bs = block_size_for(engine, block_size)
    build_pipeline(passes, bs)  # option errors before the input is read
    module = as_module(input)
    if not wanted:
        typer.echo(section("input", module, full_text))
    compile_module(
        module,
        passes,
        CompileContext(model, engine=engine),
        bs,
        after_pass=lambda rec: (
            typer.echo(section(rec.name, rec.module, full_text))
            if not wanted or rec.name in wanted
            else None
        ),
    )


@app.command()
def inspect(
    plan: Annotated[Path, typer.Argument(help="A .kapb plan.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Show what a .kapb plan holds (after checking its integrity)."""
    from kapc.lower.kapb import read_plan

    p = read_plan(plan)
    h = p.header
    info = {
        "file": str(plan),
        "format_version": p.format_version,
        "name": h.name,
        "kapc_version": h.kapc_version,
        "model": h.model,
        "model_fingerprint": h.model_fingerprint,
        "tokenizer_fingerprint": h.tokenizer_fingerprint,
        "prompt_tokens": h.prompt_tokens,
        "prompt_hash": h.prompt_hash,
        "block_size": h.block_size,
        "selected_blocks": p.selected_blocks.tolist(),
        "visible_prompt_tokens": h.visible_prompt_tokens,
        "retained_ratio": h.retained_ratio,
        "padded_blocks": h.padded_blocks,
        "k": h.k,
        "accept": h.accept,
        "access": _struct_dict(h.access),
        "fallback": _struct_dict(h.fallback),
        "cost": _struct_dict(h.cost),
    }
    if as_json:
        typer.echo(json.dumps(info))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{plan}", show_header=False, box=None)
    for key, value in info.items():
        if key == "selected_blocks":
            value = _ranges_text(value)
        table.add_row(key, str(value))
    Console().print(table)


def _struct_dict(s) -> dict:
    import msgspec

    return msgspec.to_builtins(s)


def _ranges_text(blocks: list[int]) -> str:
    runs, start = [], None
    for i, b in enumerate(blocks):
        if start is None:
            start = b
        if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
            runs.append(f"{start}..{b + 1}")
            start = None
    return f"{len(blocks)} blocks: " + " ".join(runs)


@app.command()
def fmt(
    paths: Annotated[list[Path], typer.Argument(help=".kap files or folders holding them.")],
    check: Annotated[
        bool, typer.Option(help="Only report files that are not canonical (exit 1).")
    ] = False,
) -> None:
    """Rewrite .kap files in canonical form (checking that they parse and are valid IR)."""
    from kapc.checker import check_module
    from kapc.files import write_output
    from kapc.parse import parse_located, print_module
    from kapc.parse.parser import read_kap_text

    files = [f for p in paths for f in (sorted(p.rglob("*.kap")) if p.is_dir() else [p])]
    if not files:
        raise KapcError(f"no .kap files in {', '.join(map(str, paths))}")
    bad = 0
    for f in files:
        source = read_kap_text(f)
        module, where = parse_located(source, str(f))
        check_module(module, source=where)
        text = print_module(module)
        if source != text:
            if check:
                typer.echo(f"would reformat {f}", err=True)
                bad += 1
            else:
                write_output(f, text, "fmt")
                typer.echo(f"reformatted {f}", err=True)
    if check and bad:
        raise typer.Exit(1)
    typer.echo(f"{len(files)} file(s) checked" + (", all canonical" if check else ""), err=True)


@app.command()
def run(
    plan: Annotated[Path, typer.Argument(help="A .kapb plan.")],
    accept: Annotated[
        str | None, typer.Option(help="greedy (lossless) or top3 (tolerant); default: the plan's.")
    ] = None,
    k: Annotated[
        int | None, typer.Option("--k", help="Proposal length; default: the plan's.")
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate at most.")] = 128,
    compare_full: Annotated[
        bool, typer.Option(help="Also decode with full context; report both.")
    ] = False,
    engine: Annotated[
        str, typer.Option(help="reference (PyTorch executor) or vllm.")
    ] = "reference",
    force: Annotated[
        bool, typer.Option(help="Run the plan even where the cost model predicts a loss.")
    ] = False,
    model: ModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Decode a plan's prompt with the plan (selected-KV proposals, full-context verification)."""
    common = dict(accept=accept, k=k, max_tokens=max_tokens, compare_full=compare_full, model=model)
    from kapc.models import prepare

    prepare(model, weights=True)  # converted while the runtime imports torch
    if engine == "reference":
        from kapc.runtime.run import format_report, run_plan_file

        result = run_plan_file(plan, force=force, **common)
    elif engine == "vllm":
        from kapc.runtime.run import format_report
        from kapc.runtime.vllm import run_plan_file_vllm

        result = run_plan_file_vllm(plan, honor_predicted_loss=not force, **common)
    else:
        raise KapcError(f"--engine must be reference or vllm, not {engine!r}")
    if as_json:
        typer.echo(json.dumps(result))
        return
    from rich.console import Console

    Console().print(format_report(result))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(
    ctx: typer.Context,
    model: ModelOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    k: Annotated[
        int,
        typer.Option(
            "--k", help="Most tokens a plan proposes per cycle (plans choose theirs up to it)."
        ),
    ] = MAX_AUTO_K,
    block_size: Annotated[
        int | None, typer.Option(help="KV block size (default: 32 on CPU, 16 on a GPU).")
    ] = None,
    max_model_len: Annotated[
        int | None, typer.Option(help="Longest prompt plus output (default: the model's).")
    ] = None,
    kv_cache_gib: Annotated[
        float | None, typer.Option(help="KV cache size on a CPU (default: 4).")
    ] = None,
    hook: Annotated[
        bool, typer.Option(help="--no-hook: plain vLLM, the baseline to compare with.")
    ] = True,
) -> None:
    """Serve the OpenAI-compatible API with kapc's plans (vLLM's server, kapc's hook). Options
    after the ones above pass through to vLLM's server (e.g. --max-num-seqs 32)."""
    from kapc.runtime.vllm.serve import serve as run_server
    from kapc.runtime.vllm.serve import server_command

    cmd = server_command(
        model,
        host=host,
        port=port,
        k=k,
        block_size=block_size,
        max_model_len=max_model_len,
        kv_cache_gib=kv_cache_gib,
        hook=hook,
        extra=tuple(ctx.args),
    )
    typer.echo(
        f"kapc serve: starting vLLM's server on {cmd.url} (model load and warm-up take "
        f"a minute or two on a small CPU)",
        err=True,
    )
    code = run_server(cmd, echo=lambda line: typer.echo(line, err=True))
    if code:
        raise typer.Exit(code)


@app.command()
def bench(
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            help="Folder for priors, results.jsonl, report.md and the plots; a sweep there resumes.",
        ),
    ],
    questions: Annotated[int, typer.Option(help="Questions per dataset and length.")] = 8,
    lengths: Annotated[
        str, typer.Option(help="Context lengths in tokens, comma-separated.")
    ] = "1024,2048,4096,8192",
    engine: Annotated[str, typer.Option(help="vllm or reference.")] = "vllm",
    datasets: Annotated[
        str, typer.Option(help="hotpotqa, squad, or both comma-separated.")
    ] = "hotpotqa",
    workloads: Annotated[
        str, typer.Option(help="short, long, or both comma-separated.")
    ] = "short,long",
    methods: Annotated[
        str,
        typer.Option(help="Comma-separated, from full, kapc, kapc-top3, physical, random, window."),
    ] = "full,kapc,kapc-top3,physical,random,window",
    batch: Annotated[int, typer.Option(help="Requests decoded together.")] = 8,
    k: Annotated[
        str,
        typer.Option(help="The plans' proposal length, or auto (a calibration profile chooses)."),
    ] = "6",
    first: Annotated[int, typer.Option(help="First dev question.")] = 0,
    short_tokens: Annotated[int, typer.Option(help="Output cap of the short workload.")] = 32,
    long_tokens: Annotated[
        int, typer.Option(help="Output cap of the long workload (it decodes to EOS).")
    ] = 160,
    ttft_samples: Annotated[
        int, typer.Option(help="Questions per length timed cold for time to first token; 0: none.")
    ] = 2,
    baseline: Annotated[
        str,
        typer.Option(
            help="plain: full context and the prompt baselines on a plain engine; shared: on the hook's engine (one prefill less)."
        ),
    ] = "plain",
    as_planned: Annotated[
        bool,
        typer.Option(
            help="Honour the plans' fallback rules (default: every plan runs, so it is measured)."
        ),
    ] = False,
    round_questions: Annotated[
        int,
        typer.Option(
            "--round",
            help="Questions every method decodes before the next round starts (the report is written after each).",
        ),
    ] = 32,
    model: ModelOpt = None,
    report_only: Annotated[
        bool, typer.Option(help="Only write the tables and plots from the rows already in --out.")
    ] = False,
) -> None:
    """Measure answer quality and decode speed of kapc's plans against full context and the prompt baselines."""
    from kapc.bench import BenchConfig, run_sweep
    from kapc.bench.report import write_report

    if report_only:
        if not (out / "results.jsonl").exists():
            raise KapcError(f"{out} holds no results.jsonl to report on")
        typer.echo(f"kapc: report written to {write_report(out)}", err=True)
        return
    lens = positive_ints(lengths, "--lengths")
    cfg = BenchConfig(
        out=out,
        questions=questions,
        first=first,
        lengths=lens,
        datasets=words(datasets),
        workloads=words(workloads),
        methods=words(methods),
        engine=engine,
        baseline=baseline,
        batch=batch,
        k=k,
        short_tokens=short_tokens,
        long_tokens=long_tokens,
        ttft_samples=ttft_samples,
        as_planned=as_planned,
        round_questions=round_questions,
        model=model or DEFAULT_MODEL,
    )
    path = run_sweep(cfg)
    typer.echo(path.read_text())
    typer.echo(f"kapc: report written to {path}", err=True)


@app.command()
def models(
    prepare: Annotated[
        str | None,
        typer.Option(
            help="Convert this model now (tokenizer, config and weights) instead of at first use."
        ),
    ] = None,
) -> None:
    """List the models kapc knows by name, and where each is cached."""
    from kapc import models as registry

    if prepare is not None:
        path = registry.ensure_model(registry.source(prepare).name, weights=True)
        typer.echo(f"kapc: {prepare} is ready in {path}", err=True)
    for name, src in registry.MODELS.items():
        folder = registry.model_dir(name)
        state = (
            "converted"
            if (folder / "weights.ok").exists()
            else "tokenizer only"
            if (folder / "tokenizer.ok").exists()
            else "not converted yet"
        )
        default = " (default)" if name == DEFAULT_MODEL else ""
        typer.echo(
            f"{name}{default}\n  {src.title}; weights stored in {src.weights_dtype}\n"
            f"  packages: {', '.join(r for r, _ in src.parts)}\n  {folder}: {state}"
        )


@schema_app.command("prior")
def schema_prior() -> None:
    """The JSON Schema of prior.json."""
    from kapc.prior import prior_schema

    typer.echo(json.dumps(prior_schema(), indent=1))


def _usage_errors() -> tuple[type[Exception], ...]:
    """The exception classes a usage error (missing argument, unknown option, bare command) comes
    as. typer 0.29 and later vendor their own click, whose exceptions are not `click`'s, so both
    are named: taking only `click`'s turned every usage error into an "internal error"."""
    import click

    vendored = [c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"]
    return (click.ClickException, *vendored)


def main() -> None:
    # A command's stdout is its result (a report, a plan, generated text), so the engine's log
    # lines, which vLLM writes to stdout by default, go to stderr with kapc's own progress.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        # Outside standalone mode click returns (not raises) the code of a `typer.Exit`.
        code = app(standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except KapcError as exc:
        if settings.debug():
            raise
        _err(str(exc))
        sys.exit(1)
    except (typer.Exit, SystemExit) as exc:
        sys.exit(getattr(exc, "exit_code", getattr(exc, "code", 0)))
    except typer.Abort:
        _err("aborted")
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - last resort: one paragraph, the traceback on request
        if isinstance(exc, _usage_errors()):
            exc.show()
            sys.exit(exc.exit_code)
        if settings.debug():
            raise
        _err(
            f"internal error: {type(exc).__name__}: {exc} (set KAPC_DEBUG=1 for the traceback, "
            f"and please report it)"
        )
        sys.exit(70)


if __name__ == "__main__":
    main()
