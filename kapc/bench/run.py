"""The sweep: frontend, then every engine's methods over every case, one row per (dataset,
workload, length, method, question) appended to `OUT/results.jsonl` as it finishes.

A sweep resumes: rows already in the results file are not decoded again (a batch is decoded again
only if one of its rows is missing), priors already built are reused, and the settings that decide
what a row means are kept in `OUT/config.json` and must match on a resumed run.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kapc.bench import cases
from kapc.errors import KapcError
from kapc.frontend.progress import steps
from kapc.models import DEFAULT_MODEL

METHODS = ("full", "kapc", "kapc-top3", "physical", "random", "window")
PLAN_RULE = {"kapc": "greedy", "kapc-top3": "top3"}
ENGINE_OF = {
    "full": "plain",
    "physical": "plain",
    "random": "plain",
    "window": "plain",
    "kapc": "kapc",
    "kapc-top3": "kapc",
}
RESULTS, TTFT, CONFIG = "results.jsonl", "ttft.jsonl", "config.json"
MAX_K = 8  # the engine's k: every plan's k (compact's default 6, or auto's choice) fits under it


class BenchError(KapcError):
    """A sweep that cannot start or resume as asked."""


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    out: Path
    questions: int = 8
    first: int = 0
    lengths: tuple[int, ...] = cases.LENGTHS
    datasets: tuple[str, ...] = ("hotpotqa",)
    workloads: tuple[str, ...] = ("short", "long")
    methods: tuple[str, ...] = METHODS
    engine: str = "vllm"
    baseline: str = "plain"  # "plain": a plain engine for full and the baselines; "shared"
    batch: int = 8
    k: str = "6"  # compact's proposal length, or "auto" (a calibration profile decides)
    short_tokens: int = 32
    long_tokens: int = 160
    ttft_samples: int = 2
    frontend: str = "graph"
    as_planned: bool = False  # honour the plans' fallback rules (default: every plan runs)
    block_size: int = 32
    kv_cache_gib: float | None = None  # None: sized from the model, length and batch
    round_questions: int = 32  # questions every method decodes before the next round starts
    model: str = "smollm2-135m-instruct"  # a registered model's name or a Hugging Face folder

    def check(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise BenchError(
                f"unknown method(s) {', '.join(bad)}; choose from {', '.join(METHODS)}"
            )
        for d in self.datasets:
            if d not in cases.DATASETS:
                raise BenchError(f"unknown dataset {d!r}; choose from {', '.join(cases.DATASETS)}")
        for w in self.workloads:
            if w not in cases.WORKLOADS:
                raise BenchError(
                    f"unknown workload {w!r}; choose from {', '.join(cases.WORKLOADS)}"
                )
        if self.engine not in ("vllm", "reference"):
            raise BenchError(f"--engine is vllm or reference, not {self.engine!r}")
        if self.baseline not in ("plain", "shared"):
            raise BenchError(f"--baseline is plain or shared, not {self.baseline!r}")
        if self.questions < 1 or self.batch < 1 or self.round_questions < 1:
            raise BenchError("--questions, --batch and --round must be at least 1")
        if any(n < 256 for n in self.lengths):
            raise BenchError("every length must be at least 256 tokens")
        positions = model_positions(self.model)
        too_long = [n for n in self.lengths if n > positions]
        if too_long:
            raise BenchError(
                f"--lengths {', '.join(map(str, too_long))}: {model_label(self.model)} holds "
                f"{positions:,} positions; a length is the whole sequence an engine holds "
                f"(prompt, ask, output and lookahead), so it cannot exceed them"
            )
        if self.k != "auto" and not (self.k.isdigit() and 1 <= int(self.k) <= MAX_K):
            raise BenchError(f"--k is auto or 1..{MAX_K}, not {self.k!r}")

    def max_tokens(self, workload: str) -> int:
        return self.short_tokens if workload == "short" else self.long_tokens

    def identity(self) -> dict:
        """What a row's meaning depends on: a resumed sweep must agree on all of it."""
        return {
            "engine": self.engine,
            "baseline": self.baseline,
            "batch": self.batch,
            "k": self.k,
            "short_tokens": self.short_tokens,
            "long_tokens": self.long_tokens,
            "frontend": self.frontend,
            "as_planned": self.as_planned,
            "block_size": self.block_size,
            "first": self.first,
            # a length is the whole sequence (`context_tokens`); sweeps made when it was the
            # prompt, cut at the model's positions, cannot be resumed as if it were
            "length": "sequence",
            **({} if self.model == DEFAULT_MODEL else {"model": model_label(self.model)}),
        }


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_positions(model: str | None = None) -> int:
    """The model's position limit (SmolLM2-135M: 8192; Qwen2.5-Coder-0.5B: 32768)."""
    from kapc.models import load_assets

    return load_assets(model).context_tokens()


def model_label(model: str | None) -> str:
    """A registered model's name, or a folder's name: what rows and reports call the model."""
    from kapc.models import load_assets

    return load_assets(model).name


def context_tokens(cfg: BenchConfig, length: int) -> int:
    """The context a length's prompts are built to. A length is the whole sequence the engine
    holds (at most the model's positions, which vLLM enforces; `BenchConfig.check` refuses a
    longer one), so the prompt is that less the ask, the longest output, the proposal's
    lookahead and a block: '8K' on SmolLM2 is a 7.9K-token prompt. Each row's prior records it
    (`meta.bench.context_tokens`)."""
    room = max(cfg.short_tokens, cfg.long_tokens) + 2 * MAX_K + cfg.block_size + cases.ASK_ROOM
    return length - room


# ---------------------------------------------------------------------------------------------
# files


def read_rows(path: Path) -> dict[tuple, dict]:
    """Rows by key; a later row replaces an earlier one; a torn last line (an interrupted write)
    is ignored."""
    rows: dict[tuple, dict] = {}
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        rows[row_key(r)] = r
    return rows


def row_key(r: dict) -> tuple:
    return (r["dataset"], r["workload"], r["length"], r["method"], r["index"])


def append_rows(path: Path, rows: list[dict]) -> None:
    with path.open("a") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
        fh.flush()


def start_config(cfg: BenchConfig) -> None:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / CONFIG
    ident = cfg.identity()
    if path.exists():
        old = json.loads(path.read_text()).get("identity", {})
        diff = {k: (old.get(k), v) for k, v in ident.items() if old.get(k) != v}
        if diff:
            what = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in diff.items())
            raise BenchError(
                f"{out} holds a sweep with other settings ({what}); resume it with "
                f"the same settings or choose another --out"
            )
    cases.write_json(
        path,
        {
            "identity": ident,
            "last": {
                k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
                for k, v in dataclasses.asdict(cfg).items()
            },
        },
    )


# ---------------------------------------------------------------------------------------------
# compiling a case


def pipeline(cfg: BenchConfig, rule: str) -> str:
    from kapc.passes import DEFAULT_SELECT

    return (
        f"ground,align-spans,{DEFAULT_SELECT},resolve-pages{{block-size={cfg.block_size}}},"
        f"compact{{k={cfg.k},batch={cfg.batch},accept={rule}}}"
    )


@dataclasses.dataclass
class Compiled:
    plan: bytes
    seconds: float
    kept: list[str]  # select's evidence passages
    speedup: float
    pays: bool
    s: float
    k: int
    basis: str  # what predicted the speedup: a calibration profile's key, or "memory-bound"


def compile_case(prior, cfg: BenchConfig, rule: str, ctx) -> Compiled:
    from kapc.compiler import compile_module
    from kapc.lower.lower import lower_module

    t0 = time.perf_counter()
    module = compile_module(prior, pipeline(cfg, rule), ctx, verify=False).module
    data = lower_module(module, ctx)
    secs = time.perf_counter() - t0
    return Compiled(
        plan=data,
        seconds=secs,
        kept=[k.id for k in module.keep if k.why == "evidence" and k.id],
        speedup=module.cost.speedup,
        pays=module.cost.pays,
        s=module.pages.retained,
        k=module.verify.k,
        basis=module.cost.basis,
    )


def compile_context(cfg: BenchConfig):
    from kapc.passes import CompileContext

    engine = None
    if cfg.engine == "vllm":  # the compiler then finds this machine's calibration profile
        from kapc.runtime.vllm import engine_kind

        engine = engine_kind()
    return CompileContext(cfg.model, engine=engine)


# ---------------------------------------------------------------------------------------------
# the sweep


def work_items(cfg: BenchConfig) -> list[tuple]:
    """(dataset, chunk of question indices, length, workload) in the order that reuses the prefix
    cache best: a chunk's lengths ascending (prompts are nested prefixes), both workloads of a
    length together (they share all but the ask)."""
    items = []
    for d in cfg.datasets:
        idx = cases.question_indices(d, cfg.questions, cfg.first)
        for c in range(0, len(idx), cfg.batch):
            for n in sorted(cfg.lengths):
                for w in cfg.workloads:
                    items.append((d, tuple(idx[c : c + cfg.batch]), n, w))
    return items


def build_all_priors(cfg: BenchConfig, rows: dict) -> None:
    """The priors of the cases still to decode or to time. A case whose rows are all there needs
    none (quality and the report read rows only), so a sweep resumed from its results files
    alone does not run the frontend again for what it has."""
    need = {
        (d, i, n)
        for d, chunk, n, w in work_items(cfg)  # a batch decodes as a whole
        if any((d, w, n, m, j) not in rows for m in cfg.methods for j in chunk)
        for i in chunk
    }
    need |= {(d, i, n) for d, n, _, i in ttft_todo(cfg, list(cfg.methods))}
    keys = [cases.CaseKey(d, i, n) for d, i, n in sorted(need)]
    ctx = {n: context_tokens(cfg, n) for n in cfg.lengths}
    missing = [k for k in keys if not cases.prior_path(cfg.out, k).exists()]
    if not missing:
        return
    _log(
        f"kapc bench: building {len(missing)} priors with the {cfg.frontend} frontend "
        f"(a process of its own)"
    )
    # The frontend's libraries (spaCy, sentence-transformers) must not share a process with an
    # in-process vLLM engine (docs/vllm.md), so they run in a child.
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        chunks = {(d, i): chunk for d, chunk, _, _ in work_items(cfg) for i in chunk}
        pool.submit(
            cases.build_priors, Path(cfg.out), missing, ctx, cfg.frontend, cfg.model, chunks
        ).result()


def _row(key: cases.CaseKey, workload, method, prior, prompt, out, run, batch_id, extra):
    meta = prior.meta
    return {
        "dataset": key.dataset,
        "index": key.index,
        "length": key.length,
        "workload": workload,
        "method": method,
        "question_id": meta.get("question_id"),
        "question": meta.get("question"),
        "answers": meta.get("answers", []),
        "prompt_tokens": len(prompt),
        "tokens": out.tokens,
        "text": out.text,
        "generated": len(out.tokens),
        "finish": out.finish,
        "status": out.status,
        "reason": out.reason,
        "s": out.s,
        "proposed": out.proposed,
        "accepted": out.accepted,
        "cycles": out.cycles,
        "batch_id": batch_id,
        "batch_size": len(run.outputs),
        "batch_decode_s": run.decode_s,
        "batch_prefill_s": run.prefill_s,
        "batch_tokens": run.tokens,
        "frontend_s": meta.get("bench", {}).get("frontend_s"),
        **extra,
    }


def run_phase(cfg: BenchConfig, kind: str, methods: list[str], rows: dict) -> None:
    """Every missing row and time to first token for the methods of one engine kind ("plain" or
    "kapc"), on one engine."""
    items = [
        it
        for it in work_items(cfg)
        if any((it[0], it[3], it[2], m, i) not in rows for m in methods for i in it[1])
    ]
    ttft = ttft_todo(cfg, methods)
    if not items and not ttft:
        return
    from kapc.bench.engines import ENGINES

    _log(
        f"kapc bench: starting the {kind} {cfg.engine} engine for {', '.join(methods)} "
        f"({len(items)} batches to decode, {len(ttft)} cold prefills to time)"
    )
    eng = ENGINES[cfg.engine](
        kind, cfg.block_size, max(cfg.lengths), cfg.batch, MAX_K, cfg.kv_cache_gib, model=cfg.model
    )
    ctx = compile_context(cfg)
    try:
        decode_items(cfg, eng, ctx, items, methods, rows)
        measure_ttft(cfg, eng, ctx, ttft)
    finally:
        eng.close()


def decode_items(
    cfg: BenchConfig, eng, ctx, items: list[tuple], methods: list[str], rows: dict
) -> None:
    path = Path(cfg.out) / RESULTS
    for d, chunk, n, w in steps(
        items,
        f"kapc bench: {eng.kind} engine: decoding",
        lambda it: f"{it[0]} q{it[1][0]}.. at {it[2]}, {it[3]}",
    ):
        keys = [cases.CaseKey(d, i, n) for i in chunk]
        priors = [cases.for_workload(cases.load_prior(cfg.out, k), w) for k in keys]
        full_ids = [cases.prompt_ids(p.request, cfg.model) for p in priors]
        compiled = {
            rule: [compile_case(p, cfg, rule, ctx) for p in priors]
            for rule in {PLAN_RULE.get(m, "greedy") for m in methods}
        }
        for m in methods:
            if all((d, w, n, m, i) in rows for i in chunk):
                continue
            prompts, plans, extras = _method_inputs(m, priors, full_ids, compiled, cfg.model)
            run = eng.decode(prompts, plans, cfg.max_tokens(w), honor=cfg.as_planned)
            batch_id = f"{d}/{w}/{n}/{m}/{chunk[0]}@{int(time.time())}"
            new = [
                _row(k, w, m, p, ids, o, run, batch_id, x)
                for k, p, ids, o, x in zip(keys, priors, prompts, run.outputs, extras)
            ]
            append_rows(path, new)
            rows.update({row_key(r): r for r in new})


def _method_inputs(method, priors, full_ids, compiled, model):
    """(prompts, plans or None, per-row extra fields) for one method over a chunk."""
    greedy = compiled["greedy"]
    if method in PLAN_RULE:
        from kapc.lower.kapb import decode_plan

        comp = compiled[PLAN_RULE[method]]
        for c, ids in zip(comp, full_ids):
            if [int(t) for t in decode_plan(c.plan).prompt_token_ids] != ids:
                raise BenchError(
                    "the compiler's prompt differs from the rendered request's: "
                    "the plan and full context would not decode the same prompt"
                )
        extras = [
            {
                "compile_s": c.seconds,
                "plan_s": c.s,
                "k": c.k,
                "pred_speedup": c.speedup,
                "pays": c.pays,
                "basis": c.basis,
            }
            for c in comp
        ]
        return full_ids, [c.plan for c in comp], extras
    if method == "full":
        return full_ids, None, [{} for _ in priors]
    physical = [
        cases.prompt_ids(cases.physical_concat(p, c.kept), model) for p, c in zip(priors, greedy)
    ]
    if method == "physical":
        return physical, None, [{"compile_s": c.seconds, "kept": c.kept} for c in greedy]
    budgets = [len(x) for x in physical]  # matched to the plan's materialised evidence
    if method == "random":
        reqs = [
            cases.random_concat(p, b, seed=p.name, model=model) for p, b in zip(priors, budgets)
        ]
    else:
        reqs = [cases.local_window(p, b, model) for p, b in zip(priors, budgets)]
    return [cases.prompt_ids(r, model) for r in reqs], None, [{"budget": b} for b in budgets]


def ttft_todo(cfg: BenchConfig, methods: list[str]) -> list[tuple]:
    """(dataset, length, method, question) still to time: the first `ttft_samples` questions at
    every length. Prefill time grows with the prompt, not with the question, so a few samples
    per length say it."""
    done = {
        (r["dataset"], r["length"], r["method"], r["index"])
        for r in read_rows_plain(Path(cfg.out) / TTFT)
    }
    todo = []
    for d in cfg.datasets:
        for i in cases.question_indices(d, min(cfg.ttft_samples, cfg.questions), cfg.first):
            for n in sorted(cfg.lengths):
                todo += [(d, n, m, i) for m in methods if (d, n, m, i) not in done]
    return todo


def measure_ttft(cfg: BenchConfig, eng, ctx, todo: list[tuple]) -> None:
    """A cold time to first token (empty prefix cache, batch 1, the short workload's prompt),
    with the plan for the plan methods so the hook's admission counts; the compile time is
    recorded beside it, not inside."""
    if not todo:
        return
    path = Path(cfg.out) / TTFT
    warm = True
    for d, n, m, i in steps(
        todo,
        f"kapc bench: {eng.kind} engine: time to first token",
        lambda it: f"{it[0]} q{it[3]} at {it[1]}, {it[2]}",
    ):
        prior = cases.for_workload(cases.load_prior(cfg.out, cases.CaseKey(d, i, n)), "short")
        rule = PLAN_RULE.get(m, "greedy")
        comp = compile_case(prior, cfg, rule, ctx)
        prompts, plans, _ = _method_inputs(
            m,
            [prior],
            [cases.prompt_ids(prior.request, cfg.model)],
            {"greedy": [comp], rule: [comp]},
            cfg.model,
        )
        if warm:  # the engine's first request pays one-off costs
            eng.ttft(prompts[0], plans[0] if plans else None)
            warm = False
        secs = eng.ttft(prompts[0], plans[0] if plans else None)
        append_rows(
            path,
            [
                {
                    "dataset": d,
                    "length": n,
                    "method": m,
                    "index": i,
                    "prompt_tokens": len(prompts[0]),
                    "engine_s": secs,
                    "compile_s": comp.seconds if m in PLAN_RULE or m == "physical" else 0.0,
                    "frontend_s": prior.meta.get("bench", {}).get("frontend_s"),
                }
            ],
        )


def read_rows_plain(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def rounds(cfg: BenchConfig) -> list[int]:
    """The question counts a sweep grows through. Every method decodes a round's questions before
    the next round starts, so a long sweep stopped at any point has whole questions to report
    (each engine kind decodes all its methods in one go, and a sweep run as one round would
    have nothing but plain-engine rows for hours). A round is whole batches, so batches keep
    their questions from one round to the next."""
    step = -(-cfg.round_questions // cfg.batch) * cfg.batch
    return [*range(step, cfg.questions, step), cfg.questions]


def run_sweep(cfg: BenchConfig) -> Path:
    """Frontend, engines, quality, report, a round of questions at a time (`rounds`); the report
    is written after every round. Returns the report's path."""
    from kapc.bench import quality, report

    cfg.check()
    start_config(cfg)
    rows = read_rows(Path(cfg.out) / RESULTS)
    phases: dict[str, list[str]] = {}
    for m in cfg.methods:
        kind = "kapc" if cfg.baseline == "shared" else ENGINE_OF[m]
        phases.setdefault(kind, []).append(m)
    todo = rounds(cfg)
    for j, upto in enumerate(todo):
        part = dataclasses.replace(cfg, questions=upto)
        if len(todo) > 1:
            _log(f"kapc bench: round {j + 1}/{len(todo)}: questions up to {upto}")
        build_all_priors(part, rows)
        for kind, methods in phases.items():
            run_phase(part, kind, methods, rows)
        quality.score(cfg.out)
        path = report.write_report(cfg.out)
    return path
