"""vLLM's side of `kapc calibrate` (see kapc.runtime.calibrate): plain steps are timed on a plain
engine (no speculative decoding: what users would otherwise run) from the difference of two runs'
wall times; kapc's steps are timed on an engine with the hook from the proposer's own step log,
which brackets every engine step."""

from __future__ import annotations

import os
import time

from kapc.runtime.calibrate import (CycleTimes, Grid, acceptance_points, build_acceptance_cases,
                                    cycle_times, median_step, timing_prompt)

K_MAX = 7  # the hook engine is started with k = 7: verification of up to q = 8 tokens


class VllmBench:
    engine_version = ""

    def __init__(self, block_size: int = 32, max_context: int = 7936, max_batch: int = 16,
                 kv_cache_gib: float = 4.0, dtype: str | None = None):
        import torch
        import vllm

        from kapc.models import ensure_default_model, load_assets
        from kapc.runtime.vllm import check_vllm_version, engine_block_size

        check_vllm_version()
        self.engine = "vllm-cpu" if not torch.cuda.is_available() else "vllm-gpu"
        self.engine_version = vllm.__version__
        self.model_dir = ensure_default_model(weights=True)
        assets = load_assets(str(self.model_dir))
        self.assets = assets
        self.model, self.fingerprint = assets.name, assets.fingerprint
        self.block_size = engine_block_size(block_size)
        self.dtype = dtype or ("float32" if self.engine == "vllm-cpu" else "bfloat16")
        self.device = "cpu" if self.engine == "vllm-cpu" else "cuda"
        # the in-process engine runs OMP with every core (make_engine(in_process=True))
        self.threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
        self.max_context, self.max_batch, self.kv_cache_gib = max_context, max_batch, kv_cache_gib
        self.note = ("every row of a batch decodes the same prompt (shared prompt KV blocks); "
                     "plans are synthetic selections of s of the prompt")
        self._ids = None
        self._eng = None
        self._method = None
        self._warm: set[int] = set()
        self._accept_cases = None

    # ---- engines ---------------------------------------------------------------------------
    def _engine(self, method: str):
        from kapc.runtime.vllm import make_engine

        if self._method != method:
            self.close()
            self._eng = make_engine(self.model_dir, block_size=self.block_size,
                                    k=K_MAX if method == "kapc" else 4, method=method,
                                    max_model_len=min(8192, self.max_context + 512),
                                    max_num_seqs=self.max_batch, kv_cache_gib=self.kv_cache_gib,
                                    in_process=True, dtype=self.dtype)
            self._method = method
            self._warm = set()
        return self._eng

    def _prompt(self, eng, L: int) -> list[int]:
        from kapc.runtime.vllm import generate

        if self._ids is None:
            self._ids = timing_prompt(self.max_context)
        ids = self._ids[:L]
        if L not in self._warm:  # prefill once into the prefix cache, and warm the decode path
            generate(eng, [ids], None, max_tokens=4, ignore_eos=True)
            self._warm.add(L)
        return ids

    def close(self) -> None:
        if self._eng is not None:
            self._eng.close()
        self._eng, self._method = None, None

    # ---- measurements ----------------------------------------------------------------------
    def plain(self, L: int, B: int, steps: int) -> float:
        from kapc.runtime.vllm import generate

        eng = self._engine("none")
        ids = self._prompt(eng, L)
        walls = {}
        for n in (4, 4 + steps):
            t0 = time.perf_counter()
            generate(eng, [ids] * B, None, max_tokens=n, ignore_eos=True)
            walls[n] = time.perf_counter() - t0
        return (walls[4 + steps] - walls[4]) / steps

    def _step_log(self, eng, pop: bool = True) -> list[tuple]:
        return eng.llm.collective_rpc("kapc_step_log", kwargs={"pop": pop})[0]

    def resting(self, L: int, B: int, steps: int) -> float:
        from kapc.runtime.vllm import generate

        eng = self._engine("kapc")
        ids = self._prompt(eng, L)
        self._step_log(eng)
        generate(eng, [ids] * B, None, max_tokens=steps + 4, ignore_eos=True)
        log = self._step_log(eng)
        return median_step([b[1] - a[1] for a, b in zip(log, log[1:])])

    def cycle(self, L: int, B: int, s: float, q: int, steps: int) -> CycleTimes:
        from kapc.lower.kapb import FallbackPolicy
        from kapc.runtime.planning import PlanTarget, plan_from_blocks, spread_blocks
        from kapc.runtime.vllm import generate

        eng = self._engine("kapc")
        ids = self._prompt(eng, L)
        plan = plan_from_blocks(PlanTarget(self.assets), ids,
                                spread_blocks(L, self.block_size, s), block_size=self.block_size,
                                k=q - 1, pays=True,
                                fallback=FallbackPolicy(min_acceptance=0.0, max_retained=1.0))
        self._step_log(eng)
        generate(eng, [ids] * B, [plan] * B, max_tokens=steps * q + 4, ignore_eos=True,
                 honor_predicted_loss=False, min_acceptance=False, k=q - 1)
        return cycle_times(self._step_log(eng), B, q)

    def acceptance(self, grid: Grid) -> dict[str, list[tuple[float, float, int]]]:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        from kapc.runtime.vllm import generate

        k = 4
        if self._accept_cases is None:
            # the frontend's libraries must not load in a process that runs vLLM in-process
            # (docs/vllm.md): build the priors and plans in a child
            self.close()
            with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
                self._accept_cases = pool.submit(build_acceptance_cases, grid, self.block_size,
                                                 k).result()
        eng = self._engine("kapc")
        pts: dict[str, list] = {rule: [] for rule in grid.rules}
        for ids, plans in self._accept_cases:
            for rule in grid.rules:
                res = generate(eng, [ids] * len(plans), plans, max_tokens=grid.acceptance_tokens,
                               ignore_eos=True, honor_predicted_loss=False, min_acceptance=False,
                               k=k, accept=rule)
                pts[rule] += acceptance_points(res, k)
        return pts
