"""`kapc run plan.kapb`: decode a plan's prompt with the reference executor and report metrics."""

from __future__ import annotations

from pathlib import Path

from kapc.lower.kapb import Plan, read_plan
from kapc.models import MODELS, ModelError

__all__ = ["run_plan_file", "run_plan", "run_result", "with_full_context", "format_report"]


def _model_for(plan: Plan, model, device, dtype):
    from kapc.runtime.model import load_model

    if model is not None and not isinstance(model, (str, Path)):
        return model  # an already loaded RuntimeModel
    spec = model
    if spec is None:
        name = plan.header.model
        spec = None if name == "" else name
        if spec is not None and spec not in MODELS and not Path(spec).is_dir():
            raise ModelError(
                f"plan {plan.header.name!r} was compiled for model {name!r}; pass the model folder "
                f"(model=...)"
            )
    return load_model(spec, device=device, dtype=dtype)


def run_plan_file(
    path: str | Path,
    accept: str | None = None,
    k: int | None = None,
    max_tokens: int = 128,
    compare_full: bool = False,
    model=None,
    device: str = "cpu",
    dtype=None,
    force: bool = False,
) -> dict:
    """Load `path`, decode its prompt under the plan, and return the metrics as a plain dict
    (JSON-ready). Raises kapc.lower.kapb.PlanMismatch when the plan does not fit the model.
    `force`: run the plan even where its cost model predicts a loss (to measure it)."""
    return run_plan(
        read_plan(path),
        accept=accept,
        k=k,
        max_tokens=max_tokens,
        compare_full=compare_full,
        model=model,
        device=device,
        dtype=dtype,
        source=str(path),
        force=force,
    )


def run_plan(
    plan: Plan,
    accept: str | None = None,
    k: int | None = None,
    max_tokens: int = 128,
    compare_full: bool = False,
    model=None,
    device: str = "cpu",
    dtype=None,
    source: str = "<plan>",
    force: bool = False,
) -> dict:
    from kapc.policy import parse_accept
    from kapc.runtime.executor import Executor, Request

    if accept is not None:
        parse_accept(accept)
    h = plan.header
    m = _model_for(plan, model, device, dtype)
    kk = int(k if k is not None else h.k)
    per_seq = h.prompt_tokens + max_tokens + kk + 2 * h.block_size
    blocks = 3 * (-(-per_seq // h.block_size)) + 4  # request, its full-context twin, prefix entry
    ex = Executor(
        m,
        block_size=h.block_size,
        kv_blocks=blocks,
        prefix_cache=compare_full,
        honor_predicted_loss=not force,
    )
    ids = plan.prompt_token_ids
    full_res = full_stats = None
    if compare_full:
        (full_res,), full_stats = ex.generate([Request(ids, max_tokens=max_tokens)])
    (res,), stats = ex.generate(
        [Request(ids, plan=plan, max_tokens=max_tokens, accept=accept, k=k)]
    )
    ex.clear_prefix_cache()
    tok = m.tokenizer
    out = run_result(
        plan,
        res.report,
        source=source,
        engine="reference",
        model=m.name,
        device=str(m.device),
        dtype=str(m.dtype).replace("torch.", ""),
        block_size=h.block_size,
        tokens=res.tokens,
        text=tok.decode(res.tokens, skip_special_tokens=True),
        finish_reason=res.finish_reason,
        cycles=res.cycles,
        timing=stats.as_dict(),
    )
    if compare_full:
        with_full_context(
            out,
            full_res.tokens,
            tok.decode(full_res.tokens, skip_special_tokens=True),
            full_stats.as_dict(),
        )
    return out


def run_result(
    plan: Plan,
    report,
    *,
    source: str,
    engine: str,
    model: str,
    device: str,
    dtype: str,
    block_size: int,
    tokens: list[int],
    text: str,
    finish_reason: str,
    cycles: int,
    timing: dict,
) -> dict:
    """`kapc run`'s JSON-ready result, from any runtime: the plan, the request's
    `kapc.runtime.session.RunReport` and what the runtime decoded and timed."""
    h, r = plan.header, report
    prompt_tokens = len(plan.prompt_token_ids)
    return {
        "plan": h.name,
        "source": source,
        "engine": engine,
        "model": model,
        "device": device,
        "dtype": dtype,
        "prompt_tokens": prompt_tokens,
        "text": text,
        "tokens": list(tokens),
        "generated_tokens": len(tokens),
        "finish_reason": finish_reason,
        "mode": "plan" if r.ran else "full",
        "status": r.status,
        "fallback_reason": r.reason,
        "note": r.note,
        "accept": r.accept or h.accept,
        "k": r.k,
        "block_size": block_size,
        "retained_ratio": r.retained_ratio if r.ran else None,
        "plan_retained_ratio": h.retained_ratio,
        "visible_prompt_tokens": r.visible_prompt_tokens if r.ran else prompt_tokens,
        "proposed": r.proposed,
        "accepted": r.accepted,
        "acceptance_rate": r.acceptance_rate,
        "tokens_per_cycle": (len(tokens) - 1) / cycles if cycles else None,
        "cycles": cycles,
        "speedup_predicted": h.cost.speedup,
        "cost": {
            "weight_bytes": h.cost.weight_bytes,
            "kv_bytes": h.cost.kv_bytes,
            "batch": h.cost.batch,
            "s": h.cost.s,
            "h": h.cost.h,
            "k": h.cost.k,
            "pays": h.cost.pays,
        },
        "timing": timing,
    }


def with_full_context(out: dict, tokens: list[int], text: str, timing: dict) -> None:
    """Add full-context decoding of the same prompt to a `run_result`: its output, whether the
    plan's is identical, and the measured speedup."""
    out["full_text"] = text
    out["full_tokens"] = list(tokens)
    out["identical_to_full"] = list(tokens) == out["tokens"]
    out["full_timing"] = timing
    fp, pp = timing.get("decode_tok_per_s"), out["timing"].get("decode_tok_per_s")
    out["speedup_measured"] = pp / fp if fp and pp else None


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def format_report(result: dict):
    """A rich renderable for the human view of `run_plan_file`'s result."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    r = result
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("plan", f"{r['plan']} ({r['source']})")
    t.add_row("model", f"{r['model']} on {r['device']} ({r['dtype']})")
    mode = r["mode"] + (
        f"  [yellow]fallback: {r['fallback_reason']}[/]" if r.get("fallback_reason") else ""
    )
    t.add_row("mode", mode)
    if r.get("note"):
        t.add_row("note", r["note"])
    t.add_row("prompt", f"{r['prompt_tokens']} tokens, block size {r['block_size']}")
    t.add_row(
        "retained s",
        f"{_fmt(r['retained_ratio'])} executed "
        f"(plan {_fmt(r['plan_retained_ratio'])}, "
        f"{r['visible_prompt_tokens']} visible prompt tokens)",
    )
    t.add_row(
        "acceptance h",
        f"{_fmt(r['acceptance_rate'])} ({r['accepted']}/{r['proposed']} "
        f"proposed, rule {r['accept']}, k={r['k']})",
    )
    t.add_row("tokens/cycle", _fmt(r["tokens_per_cycle"], ".2f"))
    tm = r["timing"]
    t.add_row(
        "decode",
        f"{r['generated_tokens']} tokens in {tm['decode_s']:.2f}s "
        f"({_fmt(tm['decode_tok_per_s'], '.1f')} tok/s; prefill "
        f"{tm['prefill_s']:.2f}s), finish: {r['finish_reason']}",
    )
    t.add_row(
        "time split",
        f"proposal {tm['proposal_s']:.2f}s, verification "
        f"{tm['verify_s']:.2f}s, other {tm['other_s']:.2f}s "
        f"(KV gathers {tm['gather_s']:.2f}s inside)",
    )
    _add_comparison(t, r)
    parts = [Panel(Text(r["text"]), title="output"), t]
    if "identical_to_full" in r and not r["identical_to_full"]:
        parts.insert(1, Panel(Text(r["full_text"]), title="full-context output"))
    return Group(*parts)


def _add_comparison(t, r: dict) -> None:
    """The report's predicted and measured speedup, and the comparison with full context."""
    c = r["cost"]
    t.add_row(
        "speedup",
        f"predicted {r['speedup_predicted']:.2f}x (s={c['s']:.3f}, "
        f"h={c['h']:.2f}, k={c['k']}, batch {c['batch']}, "
        f"pays={c['pays']})"
        + (
            f", measured {_fmt(r.get('speedup_measured'), '.2f')}x"
            if "speedup_measured" in r
            else ""
        ),
    )
    if "identical_to_full" in r:
        same = "[green]identical[/]" if r["identical_to_full"] else "[red]different[/]"
        t.add_row(
            "vs full",
            f"{same} to full-context decoding "
            f"({_fmt(r['full_timing']['decode_tok_per_s'], '.1f')} tok/s)",
        )
