"""`kapc calibrate`: measure, on this machine, what each kind of decode step costs an engine, fit a
small model of it (`kapc.profile`), and save a profile the compiler predicts plans with.

The grid: context lengths L x batch sizes B, at each a plain step of the engine users would
otherwise run, a step of kapc's engine with no drafts (`resting`), and for each (s, q) pair
resting steps again and one run of synthetic plans that keep s of the prompt and verify q = k+1
tokens, which yields the draft forward, the proposer's overhead and the verification step, a few
such runs verified by top-3 acceptance (`tolerant`), which time top-N verification
(`verify_tolerant`: a top-N over the vocabulary per draft position before vLLM's rejection
sampler), and one run of plans whose pages the query chooses each cycle (hybrid access, the
compiler's default), which yields the page choice's cost (`select`). Row r of every batch decodes
its own long HotpotQA prompt (question 5 + 7r, padded with hard negatives), cut to L tokens: rows
never share KV (a first measurement with one prompt shared by every row made an 8K step look
2.4x cheaper than real batches are), and since every L is a prefix of the longest, one prefill of
each prompt per engine serves every point. Then, on a calibration split of HotpotQA (dev
questions 1000 and on, never the ones benchmarks report), real compiled plans at several budgets
and context lengths measure the per-draft acceptance p against s and L (`AcceptanceFit`).

Each point is appended to `<profiles>/<key>.partial.jsonl` (or beside `-o FILE`) as it is
measured, so an interrupted run resumes where it stopped. Engines are in `Bench` classes:
`kapc.runtime.vllm.calibrate.VllmBench` and `ReferenceBench` here.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from kapc.profile import (
    FEATURES,
    Profile,
    ProfileError,
    StepSample,
    acceptance_key,
    fit_acceptance,
    fit_steps,
    machine_cpu,
    now,
    profile_key,
    profiles_dir,
    save_profile,
)

CALIBRATION_QUESTIONS = 1000  # first HotpotQA dev index of the calibration split


@dataclass
class Grid:
    contexts: tuple[int, ...] = (2048, 4096, 7936)
    batches: tuple[int, ...] = (1, 4, 8, 16)
    # (context, batch) cells to time instead of every context x batch: the step models are linear
    # in their features, so a few cells far apart pin them down, and prefilling a row's prompt
    # (about a minute and a half at 8K on a 2-core CPU) is most of what a measurement costs, so
    # the long contexts get few rows
    cells: tuple[tuple[int, int], ...] = ()
    # time plain steps on the engine users would otherwise run (a second engine, and a second
    # prefill of every row): `show` compares kapc's resting steps with them; plans are priced
    # against resting steps, so a profile without them loses nothing the policy reads
    plain: bool = True
    # q up to MAX_AUTO_K + 1, so that k=auto never chooses past what was timed
    pairs: tuple[tuple[float, int], ...] = ((0.05, 2), (0.1, 3), (0.2, 5), (0.4, 9))
    # the pages the timed cycles' drafts read: the compiler's default access policy, so that a
    # cycle costs what the plans users run cost. Timed on static pages, a draft at 8K x 8 was
    # fitted at 61 ms where hybrid plans' drafts took 75, and the step policy's forecast ran
    # 16% optimistic (benchmarks/records/cost-model-vllm-cpu/)
    draft_access: str = "hybrid"
    # time a resting step beside each cycle (see measure_point), so `--only cycle` refreshes the
    # resting fit too and both are measured in the same hour
    rest_beside_cycles: bool = True
    # (s, q) of the query-aware run per (L, B) that times page choice; None: not measured
    select_pair: tuple[float, int] | None = (0.1, 5)
    # (s, q) of the runs per (L, B) that time top-N verification (rule `tolerant_rule`); a
    # verification's cost is the same whatever its drafts read, so s is the greedy pairs'
    tolerant_pairs: tuple[tuple[float, int], ...] = ((0.1, 3), (0.2, 5), (0.4, 9))
    tolerant_rule: str = "top3"
    steps: int = 16  # decode steps (or cycles) timed per point
    acceptance_questions: int = 8
    acceptance_contexts: tuple[int, ...] = (4096, 7936)
    budgets: tuple[float, ...] = (0.05, 0.1, 0.2, 0.35)
    acceptance_tokens: int = 128  # as the decode benchmarks run (EOS ignored)
    rules: tuple[str, ...] = ("greedy", "top3")
    access_modes: tuple[str, ...] = ("static", "dynamic")  # dynamic: at each plan's own s

    def points(self) -> list[tuple]:
        """Every measurement, grouped so that each engine starts once: plain steps on the
        baseline engine, then kapc's engine (resting steps and cycles), longest context first
        (its prefill puts every shorter prefix in the cache)."""
        pts = []
        if self.plain:
            pts += [("plain", L, B, 0.0, 1) for L, B in self.timed_cells()]
        for L, B in self.timed_cells():
            pts.append(("resting", L, B, 0.0, 1))
            for s, q in self.pairs:
                pts.append(("cycle", L, B, s, q))
            if self.select_pair:
                pts.append(("select", L, B) + tuple(self.select_pair))
            for s, q in self.tolerant_pairs:
                pts.append(("tolerant", L, B, s, q))
        if self.acceptance_questions:
            for L in self.acceptance_contexts:
                pts.append(("acceptance", L, len(self.budgets), 0.0, 0))
        return pts

    def timed_cells(self) -> list[tuple[int, int]]:
        """The (context, batch) cells timed, longest context first (its prefill puts every
        shorter prefix of the same rows in the cache)."""
        cells = self.cells or tuple((L, B) for L in self.contexts for B in self.batches)
        return sorted(cells, key=lambda c: (-c[0], c[1]))

    @property
    def longest(self) -> int:
        timed = tuple(L for L, _ in self.timed_cells())
        return max(timed + (self.acceptance_contexts if self.acceptance_questions else ()))

    @property
    def widest(self) -> int:
        """The most rows a step is timed with (an acceptance run has one per budget)."""
        timed = tuple(B for _, B in self.timed_cells())
        return max(timed + ((len(self.budgets),) if self.acceptance_questions else ()))


# `kapc calibrate measure --grid`. `default` times five cells that pin every step model down
# (batch 1 at 1K and 6K for the per-token terms, batches 2, 4 and 8 for the per-row ones, the
# shortest and longest drafts for the per-query-token ones) and leaves the rest to the fits,
# whose leave-one-out error `show` reports: prefill, not the steps, is what a measurement costs
# (5 s for a 1K prompt, 104 s for an 8K one on a 2-core CPU), so the long contexts get one row.
# `full` is every context x batch, on both engines.
GRIDS = {
    "quick": Grid(
        contexts=(2048, 4096),
        batches=(1, 4),
        steps=8,
        acceptance_questions=2,
        pairs=((0.1, 3), (0.3, 5)),
        tolerant_pairs=((0.1, 3), (0.3, 5)),
        budgets=(0.1, 0.3),
        acceptance_tokens=48,
    ),
    "default": Grid(
        contexts=(1024, 2048, 4096, 6144),
        batches=(1, 2, 4, 8),
        cells=((6144, 1), (4096, 2), (2048, 4), (1024, 1), (1024, 8)),
        plain=False,
        pairs=((0.05, 2), (0.4, 9)),
        select_pair=None,  # the cycles draft on hybrid pages, so each times page choice
        tolerant_pairs=((0.1, 3), (0.2, 5)),
        steps=8,
        acceptance_questions=2,
        acceptance_contexts=(2048, 4096),
        acceptance_tokens=48,
    ),
    "full": Grid(),
}


@dataclass
class CycleTimes:
    draft: float  # one draft forward, page choice not included
    propose: float  # the proposer's own work per step, besides forwards
    verify: float  # one verification step
    select: float = 0.0  # one cycle's query-aware page choice (inside its draft forwards)


@dataclass
class Partial:
    """Points measured so far, on disk as JSON lines."""

    path: Path
    done: dict = field(default_factory=dict)

    @classmethod
    def open(cls, path: Path, resume: bool) -> Partial:
        part = cls(path)
        if resume and path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut short by an interruption
                part.done[tuple(rec["point"])] = rec
        elif path.exists():
            path.unlink()
        return part

    def add(self, point: tuple, samples: list[StepSample], extra: dict | None = None) -> None:
        rec = {
            "point": list(point),
            "samples": [[s.kind, s.batch, s.query, s.visible, s.seconds] for s in samples],
            **(extra or {}),
        }
        self.done[tuple(point)] = rec
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def samples(self, kinds: tuple[str, ...] | None = None) -> list[StepSample]:
        """The step samples of the points measured so far (of `kinds` of point only, if given)."""
        return [
            StepSample(*s)
            for rec in self.done.values()
            if kinds is None or rec["point"][0] in kinds
            for s in rec["samples"]
        ]

    def engine_setup(self, name: str) -> str:
        """What kapc's engine ran with for the points measured on it (`name` of ENGINE_SETUP; ''
        if unknown): a resumed run may never start that engine, and a profile that does not say
        which attention kernel or draft weights its times were measured with is taken for
        vLLM's kernel and the model's own weights."""
        return next((rec[name] for rec in self.done.values() if rec.get(name)), "")

    def acceptance_points(self) -> dict[str, list[tuple[float, int, float, int]]]:
        out: dict[str, list] = {}
        for rec in self.done.values():
            for rule, pts in rec.get("acceptance", {}).items():
                out.setdefault(rule, []).extend(tuple(p) for p in pts)
        return out


MEASURES = (
    "plain",
    "resting",
    "cycle",
    "select",
    "tolerant",
    "acceptance",
)  # the grid's kinds of point
# how kapc's engine ran while measured, as the bench reports it and the profile records it
ENGINE_SETUP = ("attention_kernel", "draft_weights")


def measure_point(bench, grid: Grid, point: tuple) -> tuple[list[StepSample], dict | None]:
    """Measure one of `grid`'s points on `bench`: the step samples it yields, and for an
    acceptance point the acceptance model's measurements (else None)."""
    kind, L, B, s, q = point
    if kind == "plain":
        return [StepSample("plain", B, 1, L, bench.plain(L, B, grid.steps))], None
    if kind == "resting":
        return [StepSample("resting", B, 1, L, bench.resting(L, B, grid.steps))], None
    if kind == "cycle":
        # resting steps timed beside every cycle: a plan is priced against them, and a resting
        # step timed once per (L, B), an hour or a day from the cycles, put this machine's drift
        # into every forecast (8K x 8: fitted at 264 ms, run at 236 an hour after the cycles)
        rest = bench.resting(L, B, grid.steps) if grid.rest_beside_cycles else None
        c = bench.cycle(L, B, s, q, grid.steps, access=grid.draft_access)
        chose = [StepSample("select", B, q, L, c.select)] if c.select > 0 else []
        rested = [StepSample("resting", B, 1, L, rest)] if rest is not None else []
        return [
            StepSample("draft", B, 1, max(1, round(s * L)), c.draft),
            StepSample("propose", B, q, L, c.propose),
            StepSample("verify", B, q, L, c.verify),
        ] + chose + rested, None
    if kind == "select":
        c = bench.cycle(L, B, s, q, grid.steps, access="hybrid")
        return [StepSample("select", B, q, L, c.select)], None
    if kind == "tolerant":
        c = bench.cycle(L, B, s, q, grid.steps, accept=grid.tolerant_rule)
        return [StepSample("verify_tolerant", B, q, L, c.verify)], None
    return [], {"acceptance": bench.acceptance(grid, L)}


def calibrate(
    bench,
    grid: Grid,
    *,
    resume: bool = True,
    progress: bool = True,
    out: str | Path | None = None,
    base: Profile | None = None,
    only: tuple[str, ...] = MEASURES,
) -> tuple[Profile, Path]:
    """Measure `grid` on `bench`, fit, save; returns the profile and where it was written.
    With `base`, only the points of the kinds in `only` (of MEASURES) are measured, and the
    base's samples and acceptance models of the other kinds are kept."""
    from rich.console import Console

    cpu = machine_cpu()
    key = profile_key(
        bench.engine, bench.fingerprint, bench.dtype, bench.device, bench.threads, cpu
    )
    # beside the profile it will become, so that measurements written elsewhere never share one
    partial = Path(out).with_suffix("") if out else profiles_dir() / key
    part = Partial.open(partial.parent / f"{partial.name}.partial.jsonl", resume)
    todo = [
        p for p in grid.points() if tuple(p) not in part.done and (base is None or p[0] in only)
    ]
    console = Console(stderr=True, soft_wrap=True, highlight=False)  # a log gets whole lines
    if len(todo) < len(grid.points()) and base is None:
        console.print(
            f"kapc calibrate: resuming {key}: {len(grid.points()) - len(todo)} of "
            f"{len(grid.points())} points already measured"
        )
    if any(p[0] == "acceptance" for p in todo) and hasattr(bench, "prepare"):
        console.print("kapc calibrate: compiling the acceptance plans (HotpotQA calibration split)")
        bench.prepare(grid)
    _measure_points(bench, grid, todo, part, console, progress)
    bench.close()
    profile = _profile_of(bench, part, base, only, cpu)
    path = save_profile(profile, out)
    part.path.unlink(missing_ok=True)
    return profile, path


def _measure_points(bench, grid: Grid, todo, part: Partial, console, progress: bool) -> None:
    """Measure each point of `todo` into the partial file, a line per point."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, disable=not progress) as bar:
        task = bar.add_task("calibrating", total=len(todo))
        for j, point in enumerate(todo, start=1):
            kind, L, B, s, q = point
            what = f"{kind} L={L} B={B}" + (f" s={s} q={q}" if q > 1 else "")
            bar.update(task, description=what)
            if not console.is_terminal:
                # a log file gets a line as each point starts: the first one starts the engine,
                # which takes minutes, and the result line only comes after it
                console.print(f"kapc calibrate: point {j}/{len(todo)}: {what} ...")
            t0 = time.perf_counter()
            samples, extra = measure_point(bench, grid, point)
            setup = {name: v for name in ENGINE_SETUP if (v := getattr(bench, name, ""))}
            if setup and kind != "plain":  # measured on kapc's engine, set up like this
                extra = {**(extra or {}), **setup}
            part.add(point, samples, extra)
            bar.console.print(
                f"  {kind:10} L={L:<5} B={B:<3}"
                + (f" s={s:<5} q={q}" if q > 1 else "")
                + "  "
                + ", ".join(f"{x.kind} {x.seconds * 1000:.1f} ms" for x in samples)
                + (f"  acceptance {extra['acceptance']}" if extra and "acceptance" in extra else "")
                + f"  ({time.perf_counter() - t0:.0f}s)"
            )
            bar.advance(task)


def _profile_of(
    bench, part: Partial, base: Profile | None, only: tuple[str, ...], cpu: str
) -> Profile:
    """The profile of the measured points (with `base`: the base's, those kinds measured anew),
    measured on `cpu` (`machine_cpu`)."""
    setup = {name: getattr(bench, name, "") or part.engine_setup(name) for name in ENGINE_SETUP}
    # with a base, a partial file left by an interrupted full run may hold other kinds of point
    samples = part.samples(None if base is None else only)
    acceptance = {
        rule: fit
        for rule, pts in part.acceptance_points().items()
        if (fit := fit_acceptance(pts)) is not None
    }
    if base is not None:
        again = {x.kind for x in samples}  # the step kinds measured anew are fitted again
        # new samples replace the base's at the same point; the base's other points stay, so
        # `--only resting,cycle --contexts 7936 --batches 8` adds that cell to a profile (it
        # once dropped every other point of those kinds, and their fits with them)
        at = {_point(x) for x in samples}
        samples = [x for x in base.samples if _point(x) not in at] + samples
        return msgspec.structs.replace(
            base,
            samples=tuple(samples),
            created=now(),
            fits=fit_steps(samples) if again else base.fits,
            acceptance=acceptance if "acceptance" in only else dict(base.acceptance),
            cpu=cpu,
            **{name: v or getattr(base, name) for name, v in setup.items()},
        )
    return Profile(
        engine=bench.engine,
        engine_version=bench.engine_version,
        model=bench.model,
        model_fingerprint=bench.fingerprint,
        dtype=bench.dtype,
        device=bench.device,
        threads=bench.threads,
        block_size=bench.block_size,
        created=now(),
        samples=tuple(samples),
        fits=fit_steps(samples),
        acceptance=acceptance,
        note=bench.note,
        cpu=cpu,
        **setup,
    )


def _point(x: StepSample) -> tuple:
    return (x.kind, x.batch, x.query, x.visible)


def median_step(deltas: list[float]) -> float:
    """The median of per-step times, the first two dropped (the step that finishes the prompt's
    uncached tail, and the first full step)."""
    xs = deltas[2:] if len(deltas) > 4 else deltas
    return statistics.median(xs) if xs else float("nan")


def cycle_times(log: list[tuple], rows: int, q: int) -> CycleTimes:
    """Step times from the hook's step log (`kapc.runtime.planner.StepRecord`s, as tuples) of a
    run in which all `rows` rows draft q-1 tokens per step: a step's verification is the time
    from the previous call's exit to this call's entry, when the previous call drafted q-1
    tokens for every row; the page choice made inside a call's forwards is the cycle's
    `select`, not its drafts'."""
    from kapc.runtime.planner import StepRecord

    steps = [StepRecord(*rec) for rec in log]
    full = [r.drafting == rows and r.steps == q - 1 for r in steps]
    verify = [cur.entered - prev.left for prev, cur, f in zip(steps, steps[1:], full) if f]
    cycles = [r for r, f in zip(steps, full) if f and q > 1]
    return CycleTimes(
        draft=median_step([(r.forward_s - r.select_s) / (q - 1) for r in cycles]),
        propose=median_step([r.left - r.entered - r.forward_s for r in cycles]),
        verify=median_step(verify),
        select=median_step([r.select_s for r in cycles]),
    )


def acceptance_points(results: list[dict], k: int) -> list[tuple[float, int, float, int]]:
    """(s, context, p, tries) per request: p = accepted drafts at positions 1..k over the drafts
    tried there (a draft is tried only when every earlier one was accepted)."""
    pts = []
    for r in results:
        per_pos = r.get("accepted_per_pos") or []
        cycles = r["proposed"] / k if k else 0
        tried = cycles + sum(per_pos[:-1])
        if tried > 0 and r.get("retained_ratio"):
            pts.append(
                (
                    float(r["retained_ratio"]),
                    int(r["prompt_tokens"]),
                    sum(per_pos) / tried,
                    int(tried),
                )
            )
    return pts


def access_of(mode: str, plans) -> list | None:
    """Each calibration plan's access policy under `mode`: None (its own pages) for static, else
    query-chosen pages at the plan's own retained ratio, so both modes' points share their s."""
    if mode == "static":
        return None
    from kapc.lower.kapb import decode_plan
    from kapc.policy import AccessPolicy

    return [AccessPolicy(mode=mode, budget=decode_plan(p).header.retained_ratio) for p in plans]


def build_acceptance_cases(
    grid: Grid, context: int, block_size: int, k: int, model: str | None = None
) -> list[tuple[list[int], list[bytes]]]:
    """Prompt ids and plan bytes (one per budget) for the calibration split at `context` tokens,
    for `model` (a name or folder; the default model when None): the prompts are its tokens and
    the plans carry its fingerprint, or the engine refuses them. Runs the frontend: call it in a
    child process before starting an in-process vLLM engine."""
    from kapc.compiler import compile_to_kapb
    from kapc.frontend.hybrid import hotpotqa_prior
    from kapc.lower.kapb import decode_plan
    from kapc.passes import CompileContext

    ctx = CompileContext(model)
    cases = []
    for i in range(CALIBRATION_QUESTIONS, CALIBRATION_QUESTIONS + grid.acceptance_questions):
        prior = hotpotqa_prior(i, context_tokens=context, model=model)
        plans = [
            compile_to_kapb(
                prior,
                f"ground,align-spans,select{{budget-ratio={b}}},"
                f"resolve-pages{{block-size={block_size}}},"
                f"compact{{k={k},profile=none,access=static}}",
                ctx,
            )
            for b in grid.budgets
        ]
        ids = [int(t) for t in decode_plan(plans[0]).prompt_token_ids]
        cases.append((ids, plans))
    return cases


def timing_prompts(rows: int, tokens: int, model_dir=None) -> list[list[int]]:
    """`rows` distinct long HotpotQA prompts (dev questions 5, 12, 19, ..., padded with hard
    negatives) in the model's tokens, each cut to `tokens`; every context length takes a prefix
    of each."""
    from kapc.runtime.prompts import build_prompt

    out = []
    for r in range(rows):
        ids = build_prompt(model_dir, 5 + 7 * r, target_tokens=tokens + 256).token_ids
        if len(ids) < tokens:
            raise RuntimeError(f"timing prompt {r} has {len(ids)} tokens, fewer than {tokens}")
        out.append(ids[:tokens])
    return out


class ReferenceBench:
    """The reference executor (PyTorch over its paged KV cache)."""

    engine = "reference"
    engine_version = "kapc"

    def __init__(
        self,
        block_size: int = 16,
        threads: int | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        max_context: int = 8192,
        max_batch: int = 16,
        model=None,
        prompts=None,
        kv_cache_gib: float | None = None,
    ):
        """`model`: a RuntimeModel to use instead of the default (benchmarks.gpu passes a
        random-weight one); `prompts(rows, tokens)`: the timing prompts (default: HotpotQA)."""
        import torch

        from kapc.runtime.model import load_model

        if threads:
            torch.set_num_threads(threads)
        self.m = model or load_model(device=device, dtype=getattr(torch, dtype) if dtype else None)
        self._make_prompts = prompts or (
            lambda rows, tokens: timing_prompts(rows, tokens, self.m.path)
        )
        self._kv_cache_gib = kv_cache_gib
        self.block_size = block_size
        self.model, self.fingerprint = self.m.name, self.m.fingerprint
        self.dtype = str(self.m.dtype).removeprefix("torch.")
        self.device = str(self.m.device)
        self.threads = torch.get_num_threads()
        self.note = ""
        self._prompts = None
        self._max_context, self._max_batch = max_context, max_batch
        self._ex = None

    def _executor(self):
        from kapc.runtime.executor import Executor

        if self._ex is None:
            need = self._max_batch * (self._max_context + 1024) * self.m.kv_bytes_per_token()
            self._ex = Executor(
                self.m,
                block_size=self.block_size,
                kv_cache_gib=self._kv_cache_gib or max(1.0, 2.5 * need / 2**30),
                prefix_cache=True,
                honor_predicted_loss=False,
            )
        return self._ex

    def _rows(self, L: int, B: int) -> list[list[int]]:
        if self._prompts is None:
            self._prompts = self._make_prompts(self._max_batch, self._max_context)
        return [p[:L] for p in self._prompts[:B]]

    def plain(self, L: int, B: int, steps: int) -> float:
        from kapc.runtime.executor import Request

        ex = self._executor()
        rows = self._rows(L, B)
        ex.generate([Request(ids, max_tokens=1) for ids in rows])  # prefill into the prefix cache
        _, stats = ex.generate(
            [Request(ids, max_tokens=steps + 1, ignore_eos=True) for ids in rows]
        )
        return stats.verify_s / max(1, stats.verify_forwards)

    def resting(self, L: int, B: int, steps: int) -> float:
        return self.plain(L, B, steps)  # the executor has one decode path with or without plans

    def cycle(
        self,
        L: int,
        B: int,
        s: float,
        q: int,
        steps: int,
        access: str = "static",
        accept: str = "greedy",
    ) -> CycleTimes:
        from kapc.lower.kapb import FallbackPolicy
        from kapc.policy import AccessPolicy
        from kapc.runtime.executor import Request
        from kapc.runtime.planning import plan_from_blocks, spread_blocks

        ex = self._executor()
        keep = FallbackPolicy(min_acceptance=0.0, max_retained=1.0)
        policy = None if access == "static" else AccessPolicy(mode=access, budget=s)
        reqs = [
            Request(
                ids,
                plan=plan_from_blocks(
                    self.m,
                    ids,
                    spread_blocks(L, self.block_size, s),
                    block_size=self.block_size,
                    k=q - 1,
                    pays=True,
                    fallback=keep,
                ),
                access=policy,
                max_tokens=steps * q,
                ignore_eos=True,
                accept=accept,
            )
            for ids in self._rows(L, B)
        ]
        _, st = ex.generate(reqs)
        return CycleTimes(
            draft=(st.proposal_s - st.select_s) / max(1, st.draft_forwards),
            propose=0.0,
            verify=st.verify_s / max(1, st.verify_forwards),
            select=st.select_s / max(1, st.cycles),
        )

    def acceptance(
        self, grid: Grid, context: int
    ) -> dict[str, list[tuple[float, int, float, int]]]:
        from kapc.lower.kapb import decode_plan
        from kapc.runtime.executor import Request

        k = 4
        ex = self._executor()
        pts: dict[str, list] = {}
        for ids, plans in build_acceptance_cases(
            grid, context, self.block_size, k, str(self.m.path)
        ):
            for mode in grid.access_modes:
                access = access_of(mode, plans) or [None] * len(plans)
                for rule in grid.rules:
                    res, _ = ex.generate(
                        [
                            Request(
                                ids,
                                plan=decode_plan(p),
                                accept=rule,
                                access=a,
                                max_tokens=grid.acceptance_tokens,
                                ignore_eos=True,
                            )
                            for p, a in zip(plans, access)
                        ]
                    )
                    pts.setdefault(acceptance_key(rule, mode), []).extend(
                        acceptance_points(
                            [
                                {
                                    "proposed": r.proposed,
                                    "retained_ratio": r.retained_ratio,
                                    "prompt_tokens": r.prompt_tokens,
                                    "accepted_per_pos": r.accepted_per_pos,
                                }
                                for r in res
                            ],
                            k,
                        )
                    )
        return pts

    def close(self) -> None:
        self._ex = None


def show(profile: Profile) -> str:
    """A readable summary of a profile: what was measured, and how well the fits match."""
    lines = [
        f"profile {profile.key}  ({profile.engine} {profile.engine_version}, {profile.model}, "
        f"{profile.dtype} on {profile.device}, {profile.threads} threads, block size "
        f"{profile.block_size}, {profile.created})"
    ]
    if profile.note:
        lines.append(f"  note: {profile.note}")
    here = machine_cpu()
    if not profile.cpu:
        lines.append("  CPU: not recorded (measured before profiles named it)")
    elif profile.cpu != here:
        lines.append(f"  CPU: {profile.cpu}; this machine's is {here}: not used here")
    else:
        lines.append(f"  CPU: {profile.cpu}")
    if profile.attention_kernel:
        lines.append(f"  attention kernel of kapc's engine: {profile.attention_kernel}")
    if profile.draft_weights:
        lines.append(f"  draft forwards read: {profile.draft_weights}")
    if "plain" in profile.fits and "resting" in profile.fits:
        gains = [
            profile.seconds("plain", B, L) / profile.seconds("resting", B, L)
            for L in (2048, 8192)
            for B in (1, 8)
        ]
        lines.append(
            f"  kapc's engine without plans decodes {min(gains):.2f}x to {max(gains):.2f}x "
            f"as fast as plain decoding (resting against plain, 2K-8K x 1-8); plans are "
            f"predicted against resting"
        )
    if "verify" in profile.fits and "verify_tolerant" in profile.fits:
        extra = [
            profile.seconds("verify_tolerant", B, L, q) / profile.seconds("verify", B, L, q)
            for L in (2048, 8192)
            for B in (1, 8)
            for q in (3, 9)
        ]
        lines.append(
            f"  top-N verification costs {min(extra):.2f}x to {max(extra):.2f}x a greedy "
            f"one (2K-8K x 1-8, q 3-9)"
        )
    lines += _fits_and_samples(profile)
    for rule, a in profile.acceptance.items():
        pts = ", ".join(f"s={s:.3f} L={L}: p={p:.2f} ({n})" for s, L, p, n in a.points)
        lines.append(
            f"  acceptance {rule}: logit p = {a.a:.3f} + {a.b:.3f} log s + {a.c:.3f} "
            f"log(L/4096); p(s=0.1, L=4096) = {a.p(0.1, 4096):.2f}, p(0.1, 8192) = "
            f"{a.p(0.1, 8192):.2f}; measured {pts}"
        )
    lines += pays_from_table(profile)
    return "\n".join(lines)


def _fits_and_samples(profile: Profile) -> list[str]:
    lines = []
    for kind, fit in profile.fits.items():
        terms = " + ".join(
            f"{c * 1e3:.4g}ms*{f}" if f != "1" else f"{c * 1e3:.4g}ms"
            for f, c in zip(fit.features, fit.coef)
            if c > 0
        )
        held = "-" if fit.forecast_error is None else f"{fit.forecast_error:.1%}"
        lines.append(
            f"  {kind:15} {fit.samples:3d} samples, rms rel. error {fit.rel_error:.1%} "
            f"(left out: {held}): {terms or '0'}"
        )
    lines.append(f"  {'kind':15} {'B':>3} {'q':>2} {'visible':>7} {'measured':>10} {'fitted':>10}")
    for smp in profile.samples:
        fitted = (
            profile.seconds(smp.kind, smp.batch, smp.visible, smp.query)
            if smp.kind in profile.fits
            else float("nan")
        )
        lines.append(
            f"  {smp.kind:15} {smp.batch:>3} {smp.query:>2} {smp.visible:>7} "
            f"{smp.seconds * 1e3:>8.1f}ms {fitted * 1e3:>8.1f}ms"
        )
    return lines


def forecast_check(profile: Profile, measured: Profile, against: str = "") -> str:
    """How well `profile`'s step models forecast the steps another profile of the same engine,
    model and machine measured (say, at contexts and batches `profile` never timed): per kind,
    the rms and the worst relative error."""
    if measured.key != profile.key:
        raise ProfileError(
            f"{against or 'the other profile'} is {measured.key}, not {profile.key}: a forecast "
            "is checked against the same engine, model, dtype and machine"
        )
    lines = [f"  forecast of the steps {against or 'the other profile'} measured:"]
    for kind in profile.fits:
        rows = [x for x in measured.samples if x.kind == kind and x.seconds > 0]
        if not rows:
            continue
        errs = [
            (profile.seconds(kind, x.batch, x.visible, x.query) - x.seconds) / x.seconds
            for x in rows
        ]
        worst = max(range(len(errs)), key=lambda i: abs(errs[i]))
        w = rows[worst]
        lines.append(
            f"  {kind:15} {len(rows):3d} steps, rms error {np.sqrt(np.mean(np.square(errs))):.1%}, "
            f"worst {errs[worst]:+.1%} (B={w.batch} q={w.query} visible={w.visible})"
        )
    return "\n".join(lines)


PAYS_FROM_S = (0.05, 0.1, 0.2)  # retained ratios the table states (the paper's s at 8K-128K)


def pays_from_table(profile: Profile) -> list[str]:
    """Per batch size the profile measured, the context from which a plan pays (the paper's
    KV_crit) at a few retained ratios, greedy, at the acceptance the profile expects. Lengths past
    the longest context the profile measured are extrapolated by its step models, and say so."""
    from kapc.policy import profile_pays_from

    if not {"draft", "verify"} <= set(profile.fits) or not (
        {"plain", "resting"} & set(profile.fits)
    ):
        return []
    batches = sorted({x.batch for x in profile.samples if x.kind == "verify"})
    measured = max((x.visible for x in profile.samples), default=0)
    fit = profile.acceptance_fit("greedy")
    where = (
        "the profile's greedy acceptance model at each length"
        if fit is not None
        else "p = 0.8 (the compiler's default: the profile measured no acceptance)"
    )
    lines = [
        f"  a plan pays from (the paper's KV_crit, tokens of context; greedy, the best k, "
        f"{where}; * past the longest context measured, {measured:,}):",
        "  " + f"{'s':>6}" + "".join(f"{'B=' + str(b):>10}" for b in batches),
    ]
    for s in PAYS_FROM_S:
        cells = []
        for b in batches:
            at = profile_pays_from(profile, b, s)
            cells.append("never" if at is None else f"{at:,}" + ("*" if at > measured else ""))
        lines.append("  " + f"{s:>6.2f}" + "".join(f"{c:>10}" for c in cells))
    return lines


def plot(profile: Profile, path: str | Path) -> Path:
    """Measured against fitted step times, one panel per step kind, with the y = x line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in FEATURES if k in profile.fits]
    fig, axes = plt.subplots(1, len(kinds), figsize=(3.2 * len(kinds), 3.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        pts = [
            (s.seconds * 1e3, profile.seconds(kind, s.batch, s.visible, s.query) * 1e3, s.batch)
            for s in profile.samples
            if s.kind == kind
        ]
        m, f, b = (np.array(x) for x in zip(*pts))
        sc = ax.scatter(m, f, c=np.log2(b), cmap="viridis", s=18)
        hi = max(m.max(), f.max()) * 1.05
        ax.plot([0, hi], [0, hi], color="grey", lw=0.8)
        ax.set_title(f"{kind} (rms {profile.fits[kind].rel_error:.0%})", fontsize=9)
        ax.set_xlabel("measured ms")
        ax.set_ylabel("fitted ms")
    fig.colorbar(sc, ax=axes[0].tolist(), label="log2 batch")
    fig.suptitle(f"{profile.key}", fontsize=9)
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
