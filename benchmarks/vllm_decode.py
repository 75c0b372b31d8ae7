"""vLLM decoding with kapc's hook against vLLM full-context decoding and vLLM's ngram speculative
decoding: same engine settings, same real HotpotQA prompts (gold + distractor paragraphs plus
hard negatives, nested prefixes of one ordered list), greedy, fixed output length.

    python -m benchmarks.vllm_decode                    # 4K and 8K context, batch 1/4/8, 128 tokens
    python -m benchmarks.vllm_decode --quick            # 4K context, batch 1 and 4, 32 tokens
    python -m benchmarks.vllm_decode --contexts 4096 --batches 1,4 --max-tokens 64 --methods full,kapc

A context is the whole sequence an engine holds, at most the model's positions (SmolLM2: 8192;
Qwen2.5-Coder-0.5B, `--model qwen2.5-coder-0.5b-instruct`: 32768); its prompts are that less the
output and lookahead (`fit_context`). Each engine's KV cache is sized from the model, the longest
sequence and the batch (kapc.memory), and an engine that cannot fit is refused before it starts.

Per (context, batch) every prompt is prefilled once before timing (prefix caching on; each
engine warms its own cache), so the timed run measures decoding: output tokens / wall seconds
of one `LLM.generate` call with `ignore_eos`. Every engine is up at once, each in a process of
its own, and each (context, batch) runs on all of them in turn, so that a ratio compares runs a
minute apart (`--interleave`, the default: this VM's speed drifts by 20% within a quarter of an
hour; each engine holds its KV cache, about 6 GiB at 8K x 8, so `--no-interleave` runs them one
after another where memory is short). Rows:

- `full`: plain vLLM, no speculative decoding (the baseline; ratio 1);
- `kapc-none`: kapc's engine with requests that carry no plan: plain decoding on kapc's attention
  kernel (what the kernel alone buys; the `plan` column divides a plan's throughput by this);
- `kapc`: kapc's proposer with the default pipeline's plans (hybrid pages at the plan's s;
  honouring no fallback, so the plan runs);
- `kapc-top3`: the same plans with top-3 tolerant acceptance (not lossless: `same` is expected
  to be False; every emitted token is within the full context's top 3);
- `kapc-static`, `kapc-static-top3`: plans that read only their own pages;
- `kapc-dynamic`, `kapc-dynamic-top3`: plans whose drafts read only the pages their query
  chooses, per layer (docs/access.md);
- `ngram`: vLLM's ngram (prompt lookup) speculative decoding, same k.

Printed per row: output tokens/s (with `--repeat N`, every row runs N times on each engine, in
turn, the order reversed on odd repeats, or with `--no-interleave` every engine is started N
times, alternating; the row is the median, with the spread of the N), its ratio to `full` (the
median of the ratios paired by repeat), s (retained ratio), h (measured acceptance), tokens per verification, whether the tokens equal `full`'s, the
plan's predicted speedup (`pred(plan)`, at compile time) and, when the engine decides each step
from a calibration profile, that profile's forecast of the steps that ran (`pred(run)`: the
step policy's choices at the acceptance it estimated, with the prefill's seconds, which a run
without plans spends alike, at what they took; `kapc.policy.run_forecast`, docs/cost-model.md).
With `--shared-document`, the questions of a batch read one long document (each row its own
question, prior and plan; `kapc.frontend.longctx.build_hotpotqa_shared`), so an engine prefills
one long context per (context, batch) instead of one per row: 16K-32K at batch 8 on a small CPU.
With `--baseline shared`, `full` runs on the hook's engine with no plans (the requests get no
proposals) instead of a separate plain engine, which saves one prefill of every prompt on slow
machines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _log(*a):
    print(*a, file=sys.stderr, flush=True)


def pipeline_for(
    block_size: int = 32,
    budget_ratio: float = 0.2,
    k: int = 4,
    batch: int = 1,
    accept: str = "greedy",
    select: str = "",
    access: str | None = None,
    access_budget: float | str = "plan",
) -> str:
    """`select` adds select options, e.g. "keep-top=5,keep-growth=1" (evidence-driven: the
    budget ratio becomes a ceiling); `access` static, dynamic or hybrid (None: compact's
    default), where query-aware reads `access_budget` of the prompt (or "plan": the plan's own
    s)."""
    extra = f",{select}" if select else ""
    pages = (
        ""
        if access is None
        else f",access={access}" + ("" if access == "static" else f",access-budget={access_budget}")
    )
    return (
        f"ground,align-spans,select{{budget-ratio={budget_ratio}{extra}}},"
        f"resolve-pages{{block-size={block_size}}},"
        f"compact{{k={k},batch={batch},accept={accept}{pages}}}"
    )


def compile_prior(
    prior,
    block_size: int = 32,
    budget_ratio: float = 0.2,
    k: int | str = 4,
    batch: int = 1,
    ctx=None,
    accept: str = "greedy",
    select: str = "",
    access: str | None = None,
    access_budget: float | str = "plan",
) -> bytes:
    """A prior (or its JSON file) -> .kapb bytes, compiled for this block size."""
    from kapc.compiler import compile_to_kapb

    return compile_to_kapb(
        prior,
        pipeline_for(block_size, budget_ratio, k, batch, accept, select, access, access_budget),
        ctx,
        verify=False,
    )


def default_select() -> tuple[float, str]:
    """The default pipeline's select as (budget ratio, the other options), so benchmarks run the
    plans users get unless told otherwise."""
    from kapc.passes import DEFAULT_SELECT_OPTIONS

    opts = dict(DEFAULT_SELECT_OPTIONS)
    budget = float(opts.pop("budget-ratio"))
    return budget, ",".join(f"{k}={v}" for k, v in opts.items())


def access_budget(text: str):
    """--access-budget: a retained ratio, or "plan" (each request's own plan's s: matched
    budgets)."""
    if text == "plan":
        return text
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a ratio nor 'plan'") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} is not a ratio in (0, 1]")
    return v


def model_max_len(model=None) -> int:
    """The model's position limit (SmolLM2-135M: 8192; Qwen2.5-Coder-0.5B: 32768)."""
    from kapc.models import load_assets

    return load_assets(model).context_tokens()


def fit_context(target: int, new_tokens: int, k: int, block_size: int, model=None) -> int:
    """The prompt length to build for a context of `target` tokens: a context is the whole
    sequence the engine holds (vLLM refuses more than the model's positions), so its prompt is
    `target` less the output and the proposal's lookahead ('8K' on SmolLM2: a ~8000-token prompt).
    A context past the model's positions is refused, not cut."""
    positions = model_max_len(model)
    if target > positions:
        raise SystemExit(
            f"context {target:,}: the model holds {positions:,} positions; "
            f"give contexts up to {positions:,}"
        )
    return target - new_tokens - 2 * k - block_size


def build_cases(
    contexts,
    n,
    block_size,
    k,
    budget_ratio,
    batches,
    frontend,
    first: int = 0,
    variants=(("greedy", None),),
    new_tokens: int = 0,
    auto: bool = False,
    select: str = "",
    access_budget: float | str = "plan",
    model=None,
    shared: bool = False,
):
    """{context: [(ids, {(batch, rule, access mode): plan bytes}), ...n]} for HotpotQA dev
    questions first..first+n-1, one plan per batch size and (rule, mode) of `variants`; prompts
    are built to `fit_context` of each context. With `shared`, the questions read one long
    document (a batch prefills it once); otherwise each its own. With `auto`, plans are compiled
    with k=auto against this machine's vllm-cpu calibration profile."""
    from kapc.frontend.hybrid import hotpotqa_prior, hotpotqa_shared_priors
    from kapc.lower.kapb import decode_plan
    from kapc.passes import CompileContext

    ctx = CompileContext(model, engine="vllm-cpu" if auto else None)
    if auto:
        from kapc.profile import find_profile

        if find_profile("vllm-cpu", ctx.assets.fingerprint) is None:
            raise SystemExit(
                "--auto needs a vllm-cpu calibration profile: run kapc calibrate measure"
            )
    out = {}
    for c in contexts:
        rows = []
        target = fit_context(c, new_tokens, k, block_size, model)
        if shared:
            t0 = time.perf_counter()
            priors = hotpotqa_shared_priors(
                range(first, first + n), target, frontend=frontend, model=model
            )
            _log(
                f"  one document for q{first}..q{first + n - 1} at {c}: "
                f"{time.perf_counter() - t0:.1f}s"
            )
        else:
            priors = None
        for i in range(first, first + n):
            t0 = time.perf_counter()
            prior = (
                priors[i - first]
                if shared
                else hotpotqa_prior(i, context_tokens=target, frontend=frontend, model=model)
            )
            plans = {
                (b, rule, mode): compile_prior(
                    prior,
                    block_size=block_size,
                    budget_ratio=budget_ratio,
                    k="auto" if auto else k,
                    batch=b,
                    ctx=ctx,
                    accept=rule,
                    select=select,
                    access=mode,
                    access_budget=access_budget,
                )
                for b in batches
                for rule, mode in variants
            }
            ids = [int(t) for t in decode_plan(next(iter(plans.values()))).prompt_token_ids]
            rows.append((ids, plans))
            _log(f"  prior+plans q{i} at {c}: {len(ids)} tokens ({time.perf_counter() - t0:.1f}s)")
        out[c] = rows
    return out


def start_engine(method, cases, batches, args):
    from kapc.runtime.vllm import make_engine

    t0 = time.perf_counter()
    k = args.ngram_k if method == "ngram" and args.ngram_k else args.k
    max_len = min(model_max_len(args.model), max(cases) + args.max_tokens + 8 * args.k + 256)
    eng = make_engine(
        args.model,
        block_size=args.block_size,
        k=k,
        method=method,
        max_model_len=max_len,
        max_num_seqs=max(batches),
        kv_cache_gib=args.kv_cache_gib,
        in_process=args.in_process,
        ngram_max=args.ngram_max,
        dtype=args.dtype,
        ngram_min=args.ngram_min,
    )
    _log(f"[{method}] engine up in {time.perf_counter() - t0:.1f}s")
    return eng


ENGINE_OF = {
    "full": "none",
    "kapc-none": "kapc",
    "kapc": "kapc",
    "kapc-top3": "kapc",
    "kapc-static": "kapc",
    "kapc-static-top3": "kapc",
    "kapc-dynamic": "kapc",
    "kapc-dynamic-top3": "kapc",
    "ngram": "ngram",
}


def measure_engine(kind, labels, cases, batches, args) -> list[dict]:
    """Start one engine of `kind`, decode every row of each method in `labels` on it, close it.
    The methods take turns at each (context, batch), so that a plan and the same engine without
    plans (`kapc-none`) are timed a minute apart, not a quarter of an hour: on this 2-core VM the
    same step measured 35% faster at 08:40 than at 03:00, and drifted within one grid."""
    eng = start_engine(kind, cases, batches, args)
    try:
        return [
            r for c in cases for b in batches for r in engine_rows(eng, labels, cases, c, b, args)
        ]
    finally:
        eng.close()


def engine_rows(eng, labels, cases, context, batch, args) -> list[dict]:
    """The rows of each method in `labels` at one (context, batch), on `eng`, in turn."""
    return [
        r
        for m in labels
        for r in run_rows(eng, m, {context: cases[context]}, [batch], args, with_plans=has_plans(m))
    ]


# --interleave: every engine stays up in a process of its own and each (context, batch) runs on
# all of them in turn, so a plan and plain vLLM are timed a minute apart, not a quarter of an
# hour: on this 2-core VM plain vLLM's 4K x 1 ran 9.22 tok/s at 15:30 and kapc's engine without
# plans 7.48 at 15:45, where the same two had measured 1.10x apart the session before.
_engine = None
_cases = None


def _open_engine(kind, cases, batches, args) -> None:
    global _engine, _cases
    _engine, _cases = start_engine(kind, cases, batches, args), cases


def _engine_rows(labels, context, batch, args) -> list[dict]:
    return engine_rows(_engine, labels, _cases, context, batch, args)


def _close_engine() -> None:
    _engine.close()


class EngineProcess:
    """One engine in a process of its own (a fresh process per engine: vLLM-CPU rebinds its
    kernel overrides at every engine start, and the fourth start in one process failed), kept
    up across rows."""

    def __init__(self, kind, cases, batches, args):
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        self.pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
        self.pool.submit(_open_engine, kind, cases, batches, args).result()

    def rows(self, labels, context, batch, args) -> list[dict]:
        return self.pool.submit(_engine_rows, labels, context, batch, args).result()

    def close(self) -> None:
        try:
            self.pool.submit(_close_engine).result()
        finally:
            self.pool.shutdown()


def forecast_gist(totals: dict, forecast_tokens: float | None, tokens: int) -> str:
    """Observed over predicted seconds per step kind over a run, and predicted over emitted
    tokens: which term of the step policy's forecast was off."""
    parts = [
        f"{kind} {t['observed_s']:.1f}/{t['predicted_s']:.1f}s ({t['steps']})"
        for kind, t in totals.items()
    ]
    if forecast_tokens:
        parts.append(f"tokens {forecast_tokens:.0f}/{tokens}")
    return ", ".join(parts)


def has_plans(method: str) -> bool:
    return method.startswith("kapc") and method != "kapc-none"


def variant_of(method: str) -> tuple[str, str | None]:
    """The (acceptance rule, access mode) a kapc method's plans are compiled with (None: the
    compiler's default)."""
    rule = "top3" if method.endswith("-top3") else "greedy"
    for mode in ("static", "dynamic"):
        if method.startswith(f"kapc-{mode}"):
            return rule, mode
    return rule, None


def run_rows(eng, label, cases, batches, args, with_plans: bool):
    from kapc.lower.kapb import decode_plan
    from kapc.policy import predicted_speedup, run_forecast
    from kapc.runtime.vllm import generate

    rows = []
    for c, cs in cases.items():
        for b in batches:
            ids = [x[0] for x in cs[:b]]
            t0 = time.perf_counter()
            plans = [x[1][(b, *variant_of(label))] for x in cs[:b]] if with_plans else None
            # prefill into the prefix cache, and warm the decode (and draft) path up; the first
            # prompt alone first, so that prompts sharing a document find it cached instead of
            # prefilling it side by side
            generate(
                eng,
                ids[:1],
                plans[:1] if plans else None,
                max_tokens=2 * args.k,
                honor_predicted_loss=False,
            )
            generate(eng, ids, plans, max_tokens=2 * args.k, honor_predicted_loss=False)
            _log(f"[{label}] {c} x{b}: prefill {time.perf_counter() - t0:.1f}s")
            # --auto: the plans decide (predicted loss, acceptance below break-even), as in use
            res = generate(
                eng,
                ids,
                plans,
                max_tokens=args.max_tokens,
                ignore_eos=True,
                honor_predicted_loss=args.auto,
                min_acceptance=args.auto,
            )
            wall = res[0]["batch_s"]
            ntok = sum(r["generated_tokens"] for r in res)
            row = {
                "context": c,
                "batch": b,
                "method": label,
                "prompt_tokens": sum(len(x) for x in ids) / b,
                "wall_s": wall,
                "out_tok_s": ntok / wall,
                "tokens": [r["tokens"] for r in res],
            }
            if with_plans:
                pl = [decode_plan(p) for p in plans]
                prop = sum(r["proposed"] for r in res)
                acc = sum(r["accepted"] for r in res)
                h = acc / prop if prop else 0.0
                s = sum(r["retained_ratio"] or 0 for r in res) / b
                cyc = sum(r["cycles"] for r in res)
                gen = sum(r["generated_tokens"] - 1 for r in res)
                cost = pl[0].header.cost
                row.update(
                    k=sorted({p.header.k for p in pl}),
                    fallbacks=sum(r["status"] == "fallback" for r in res),
                    reasons=sorted({r["reason"] for r in res if r.get("reason")}),
                    pred_auto=sum(p.header.cost.speedup for p in pl) / b,
                )
                kv = sum(p.header.cost.kv_bytes for p in pl) / b
                tm = res[0].get("timing", {})
                # the step policy's forecast of what ran (a profile in use), else None
                row["pred_run"] = run_forecast(
                    tm.get("forecast_s") or 0.0,
                    tm.get("plain_forecast_s") or 0.0,
                    tm.get("unforecast_s") or 0.0,
                )
                # the step policy's profile factors at the end (observed over profiled times)
                row["profile_factors"] = res[0].get("profile_factors")
                # where the forecast went wrong: seconds observed against predicted per step kind,
                # and the tokens the step policy expected against those emitted
                row["step_totals"] = res[0].get("step_totals")
                row["forecast_tokens"] = tm.get("forecast_tokens")
                # what kapc's engine ran (its attention kernel, per shape) and what runs changed
                row["attention_kernel"] = res[0].get("attention_kernel")
                row["kernel_choices"] = res[0].get("kernel_choices")
                row["notes"] = sorted({r["note"] for r in res if r.get("note")})
                row.update(
                    propose_s=tm.get("propose_s"),
                    select_s=tm.get("select_s"),
                    draft_forwards=tm.get("draft_forwards"),
                    verify_steps=max((r["cycles"] for r in res), default=0) + 1,
                )
                row.update(
                    s=s,
                    h=h,
                    tokens_per_cycle=gen / cyc if cyc else None,
                    pred_plan_h=cost.speedup,
                    plan_h=cost.h,
                    pred_measured_h=predicted_speedup(cost.weight_bytes, kv, b, s, h, args.k),
                    statuses=sorted({r["status"] for r in res}),
                )
            rows.append(row)
            _log(
                f"[{label}] {c} x{b}: {ntok} tokens in {wall:.1f}s "
                f"({row['out_tok_s']:.2f} tok/s)"
                + (
                    f" s={row['s']:.3f} h={row['h']:.2f}; proposer {row['propose_s']:.1f}s in "
                    f"{row['draft_forwards']} draft forwards ({row['select_s'] or 0:.2f}s choosing "
                    f"pages), {row['verify_steps']} engine steps"
                    + (f"; profile x{row['profile_factors']}" if row["profile_factors"] else "")
                    + (
                        f"; forecast {forecast_gist(row['step_totals'], row['forecast_tokens'], ntok)}"
                        if row["step_totals"]
                        else ""
                    )
                    if with_plans
                    else ""
                )
            )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="4096,8192")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--methods",
        default="full,kapc,kapc-top3,ngram",
        help=f"comma list of {', '.join(ENGINE_OF)}",
    )
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=32)
    budget, select = default_select()
    ap.add_argument(
        "--budget-ratio",
        type=float,
        default=budget,
        help="select's budget (with the default --select, a ceiling)",
    )
    ap.add_argument(
        "--select", default=select, help="more select options (default: the default pipeline's)"
    )
    ap.add_argument(
        "--access-budget",
        type=access_budget,
        default="plan",
        help="query-aware plans: the retained ratio the view reads, or 'plan' for "
        "each plan's own s (matched budgets; the compiler's default)",
    )
    ap.add_argument("--frontend", default="graph")
    ap.add_argument(
        "--model",
        default=None,
        help="a model's name (smollm2-135m-instruct, the default; "
        "qwen2.5-coder-0.5b-instruct) or a Hugging Face folder",
    )
    ap.add_argument(
        "--shared-document",
        action="store_true",
        help="the questions read one long document (each its own question, prior "
        "and plan), so a batch prefills one context instead of one per row: what "
        "makes 16K-32K contexts at batch 8 affordable on a small CPU",
    )
    ap.add_argument(
        "--kv-cache-gib",
        type=int,
        default=None,
        help="KV cache size (default: what the largest batch needs, plus a quarter)",
    )
    ap.add_argument("--baseline", choices=("plain", "shared"), default="plain")
    ap.add_argument(
        "--in-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="engine core and worker in this process (default: vLLM's choice)",
    )
    ap.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep every engine up at once and run each (context, batch) on all of "
        "them in turn, so that ratios compare runs a minute apart (default); "
        "--no-interleave runs one engine after another, in a third of the memory "
        "(each engine holds its KV cache: about 6 GiB at 8K x 8)",
    )
    ap.add_argument(
        "--dtype",
        default=None,
        help="engine dtype for every method (default: float32 on CPU, auto on GPU); "
        "bfloat16 uses AMX on CPUs that have it",
    )
    ap.add_argument(
        "--ngram-k",
        type=int,
        default=None,
        help="ngram's proposal length (default: --k; with --auto, 4)",
    )
    ap.add_argument("--ngram-max", type=int, default=4)
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument(
        "--auto",
        action="store_true",
        help="plans compiled with k=auto and this machine's calibration profile "
        "(kapc calibrate), run as the plans decide: fallbacks honoured",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every row this many times on each engine in turn (with "
        "--no-interleave: start every engine this many times, alternating), and "
        "report the median throughput, its spread, and the median of the ratios "
        "paired by repeat",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="reduced run: 4K context, batch 1 and 4, 32 output tokens",
    )
    ap.add_argument("--json", help="write the rows (without token ids) to this file")
    args = ap.parse_args(argv)
    if args.auto:
        from kapc.policy import MAX_AUTO_K

        args.k = MAX_AUTO_K  # the engine's k caps every plan's; each plan runs its own
        args.ngram_k = args.ngram_k or 4
    if args.quick:
        args.contexts, args.batches, args.max_tokens = "4096", "1,4", 32
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = sorted(int(x) for x in args.batches.split(","))
    methods = [m.strip() for m in args.methods.split(",")]
    from kapc.runtime.vllm import check_vllm_version

    ver = check_vllm_version()
    _log(f"vLLM {ver}; building prompts and plans ...")
    # Built in a child process: the frontend's libraries (spaCy, sentence-transformers) leave
    # objects in sys.modules that vLLM's in-process kernel registration trips over.
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        cases = pool.submit(
            build_cases,
            contexts,
            max(batches),
            args.block_size,
            args.k,
            args.budget_ratio,
            batches,
            args.frontend,
            # without a plan method, one greedy plan a question still gives its prompt's tokens
            variants=list(dict.fromkeys(variant_of(m) for m in methods if has_plans(m)))
            or [("greedy", None)],
            new_tokens=args.max_tokens,
            auto=args.auto,
            select=args.select,
            access_budget=args.access_budget,
            model=args.model,
            shared=args.shared_document,
        ).result()
    # every method runs on one engine; methods sharing an engine share its start and prefills
    engines: dict[str, list[str]] = {}
    for m in methods:
        kind = ENGINE_OF[m]
        if m == "full" and args.baseline == "shared":
            kind = "kapc"
        engines.setdefault(kind, []).append(m)
    if args.interleave:
        rows = interleaved_rows(engines, cases, contexts, batches, args)
    else:
        rows = sequential_rows(engines, cases, batches, args)
    rows = median_rows(rows)
    full = {(r["context"], r["batch"]): r for r in rows if r["method"] == "full"}
    print(
        f"\nvLLM {ver}, block size {args.block_size}, k={args.k}, {args.max_tokens} output "
        f"tokens, greedy, baseline {args.baseline}"
    )
    hdr = (
        f"{'ctx':>6} {'batch':>5} {'method':>16} {'prompt':>7} {'tok/s':>7} {'spread':>6} "
        f"{'ratio':>6} {'plan':>5} "
        f"{'s':>6} {'h':>5} {'tok/cyc':>7} {'same':>5} {'pred(plan)':>10} "
        f"{'pred(run)':>9} {'k':>7} {'fallbk':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    without_plans = {(r["context"], r["batch"]): r for r in rows if r["method"] == "kapc-none"}
    for r in sorted(
        rows, key=lambda r: (r["context"], r["batch"], list(ENGINE_OF).index(r["method"]))
    ):
        f = full.get((r["context"], r["batch"]))
        ratio = r["ratio"]
        same = (r["tokens"] == f["tokens"]) if f else None
        r["identical_to_full"] = same
        if f:
            r["rows_identical_to_full"] = sum(a == b for a, b in zip(r["tokens"], f["tokens"]))
        # whether drafting changed what kapc's engine decodes without plans (in bfloat16 a
        # verification rounds otherwise than a decode step, so it may)
        plain_kapc = without_plans.get((r["context"], r["batch"]))
        if plain_kapc and r["method"].startswith("kapc") and r is not plain_kapc:
            r["identical_to_kapc_none"] = r["tokens"] == plain_kapc["tokens"]

        def fmt(x, spec):
            return "-" if x is None else format(x, spec)

        print(
            f"{r['context']:>6} {r['batch']:>5} {r['method']:>16} {r['prompt_tokens']:>7.0f} "
            f"{r['out_tok_s']:>7.2f} {fmt(r['spread'], '.0%'):>6} {fmt(ratio, '.2f'):>6} "
            f"{fmt(r.get('plan_ratio'), '.2f'):>5} "
            f"{fmt(r.get('s'), '.3f'):>6} "
            f"{fmt(r.get('h'), '.2f'):>5} {fmt(r.get('tokens_per_cycle'), '.2f'):>7} "
            f"{fmt(same, ''):>5} {fmt(r.get('pred_auto', r.get('pred_plan_h')), '.2f'):>10} "
            f"{fmt(r.get('pred_run'), '.2f'):>9} "
            f"{','.join(map(str, r.get('k', []))) or '-':>7} {fmt(r.get('fallbacks'), 'd'):>6}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([{k: v for k, v in r.items() if k != "tokens"} for r in rows], fh, indent=1)


def sequential_rows(engines: dict[str, list[str]], cases, batches, args) -> list[dict]:
    """One engine after another (--no-interleave). Engines alternate across repeats: an engine
    instance's speed varies by up to 10-15% on a small CPU, so a ratio rests on the median of
    several instances of each side."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    rows = []
    for rep in range(args.repeat):
        for kind, labels in engines.items():
            if args.in_process:
                # a fresh process per engine: vLLM-CPU rebinds its kernel overrides at every
                # engine start, and the fourth start in one process failed (AttributeError in
                # register_triton_kernel_overrides), which broke --repeat
                with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
                    new = pool.submit(measure_engine, kind, labels, cases, batches, args).result()
            else:
                new = measure_engine(kind, labels, cases, batches, args)
            rows += [dict(r, repeat=rep) for r in new]
    return rows


def interleaved_rows(engines: dict[str, list[str]], cases, contexts, batches, args) -> list[dict]:
    """Every engine up at once, each (context, batch) run on all of them in turn (the order
    reversed on odd repeats, so that neither side always runs first)."""
    procs: dict[str, EngineProcess] = {}
    rows = []
    try:
        for kind in engines:
            procs[kind] = EngineProcess(kind, cases, batches, args)
        for rep in range(args.repeat):
            order = list(engines) if rep % 2 == 0 else list(reversed(engines))
            for c in contexts:
                for b in batches:
                    for kind in order:
                        rows += [
                            dict(r, repeat=rep) for r in procs[kind].rows(engines[kind], c, b, args)
                        ]
    finally:
        for p in procs.values():
            p.close()
    return rows


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per (context, batch, method) over the repeats: the median throughput, each
    repeat's ratio to `full` in the same repeat (`ratios`) and their median (`ratio`): an engine
    instance can be 20% slower than the next on a small CPU, so ratios are paired by repeat.
    `spread` is (max - min) / median of the throughputs; `plan_ratio` is a plan method's median
    ratio to `kapc-none` (the same engine without plans) in the same repeat."""
    import statistics

    full = {
        (r["context"], r["batch"], r["repeat"]): r["out_tok_s"]
        for r in rows
        if r["method"] == "full"
    }
    bare = {
        (r["context"], r["batch"], r["repeat"]): r["out_tok_s"]
        for r in rows
        if r["method"] == "kapc-none"
    }
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["context"], r["batch"], r["method"]), []).append(r)
    out = []
    for group in groups.values():
        speeds = [r["out_tok_s"] for r in group]
        ratios = [
            r["out_tok_s"] / full[key]
            for r in group
            if (key := (r["context"], r["batch"], r["repeat"])) in full
        ]
        over_bare = [
            r["out_tok_s"] / bare[key]
            for r in group
            if has_plans(r["method"]) and (key := (r["context"], r["batch"], r["repeat"])) in bare
        ]
        row = dict(
            group[0],
            out_tok_s=statistics.median(speeds),
            tok_s_repeats=speeds,
            ratios=ratios,
            ratio=statistics.median(ratios) if ratios else None,
            plan_ratio=statistics.median(over_bare) if over_bare else None,
            spread=(max(speeds) - min(speeds)) / statistics.median(speeds)
            if len(speeds) > 1
            else None,
        )
        out.append(row)
    return out


if __name__ == "__main__":
    main()
