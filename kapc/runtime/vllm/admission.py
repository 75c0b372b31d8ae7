"""Plans compiled at admission: a request may carry its frontend's prior (`prior.json`) instead of
a compiled `.kapb`, and the engine's worker compiles it, against the engine's own model, block size
and calibration profile, with the default pipeline.

The prompt a prior renders to (its messages through the model's chat template) must be the prompt
the engine tokenised for the request; the proposer's usual plan check (`check_plan_matches`)
refuses the request's plan, for that request only, when it is not.

A server sees the same prior many times (a retry, a benchmark, a frontend that caches its
retrieval), so compiled plans are kept by the prior's content hash: a repeated prior compiles once.

Compiling is off the engine's step: the compiler runs in a process of its own
(kapc.runtime.vllm.compile_process says why not a thread), one prior at a time, started with its
tokenizer loaded when the engine starts (`warm`); a thread of the worker waits on each answer so
the step never does. The scheduler starts a
request's compile as the request arrives (`start_compiling`), so it runs while the prompt is
prefilled; a request whose plan is not ready by its first decode step decodes plainly
(`PlanSession.compiling`) and drafts from the step its plan is admitted.
Torch-free, vLLM-free: the worker calls it with plain values.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kapc.errors import KapcError
from kapc.runtime.session import (
    OPTS_KEY,
    PLAN_KEY,
    PRIOR_KEY,
    EngineRules,
    PlanSession,
    request_options,
)
from kapc.runtime.vllm.compile_process import CompileProcess, CompilerFailed

log = logging.getLogger("vllm.kapc")
CACHED_PLANS = 256  # compiled plans kept per engine, least recently used dropped first


@dataclass(frozen=True)
class Compiled:
    """One prior's plan: the `.kapb` bytes, the seconds compiling it took (booked on the request
    it was compiled for, even when the compile started before its admission; 0.0 when the plan
    came from another request's compile) and whether it did."""

    data: bytes
    seconds: float
    cached: bool


def prior_text(value) -> bytes:
    """A prior as sent: JSON text (the OpenAI server's `vllm_xargs` carry strings) or, from
    Python, a dict. Raises KapcError for anything else."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()
    raise KapcError(
        f"{PRIOR_KEY} must be the prior's JSON text or object, not {type(value).__name__}"
    )


class PlanCompiler:
    """Compiles priors for one engine: its model folder, KV block size and the engine name the
    compiler finds its profile under (kapc.policy.ENGINE_BLOCK_SIZE: "vllm-cpu" or "vllm-gpu")
    with the threads its worker computes with (`threads`; 0: unknown), in a process of its own
    that a thread of this one waits on."""

    def __init__(
        self,
        model: str,
        block_size: int,
        engine: str,
        capacity: int = CACHED_PLANS,
        threads: int = 0,
    ):
        self.model, self.block_size, self.engine = model, int(block_size), engine
        self.capacity = int(capacity)
        self._plans: OrderedDict[str, bytes] = OrderedDict()
        self._running: dict[str, Future] = {}  # compiles in flight, by key
        self._early: set[str] = set()  # compiles started early, no request admitted with them yet
        self._unclaimed: dict[str, float] = {}  # seconds of early compiles done, unclaimed
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kapc-compile")
        self._process = CompileProcess(model, engine, threads)
        # the child exits with its pipe when this compiler is dropped, or with this process
        weakref.finalize(self, self._process.close)

    def key(self, text: bytes) -> str:
        return hashlib.sha256(text + b"\0" + str(self.block_size).encode()).hexdigest()

    def warm(self) -> None:
        """Start the compile process now (it loads the compiler and the tokenizer), so the first
        prior compiles as fast as the rest."""
        self._thread.submit(self._process.start)

    @property
    def process_id(self) -> int | None:
        """The compile process's pid (None before it starts)."""
        return self._process.pid

    def close(self) -> None:
        """Stop the compile process (a later prior starts it again)."""
        self._thread.submit(self._process.close).result()

    def compile(self, value) -> Compiled:
        """The plan of a prior, compiled now or taken from the cache. Raises KapcError (the prior's
        own errors name their JSON path) when it cannot be compiled."""
        return self.submit(value).result()

    def submit(self, value, early: bool = False) -> Future:
        """The plan of a prior (a Future of `Compiled`): taken from the cache, joined to the same
        prior's compile in flight, or compiled by the compile process. `early`: started as the
        request arrives, before admission asks; the first admission that asks is given the
        compile as its own. The future raises KapcError when the prior cannot be compiled; a
        value that is no prior raises here."""
        text = prior_text(value)
        key = self.key(text)
        with self._lock:
            data = self._plans.get(key)
            if data is not None:
                self._plans.move_to_end(key)
                seconds = None if early else self._unclaimed.pop(key, None)
                done: Future = Future()
                done.set_result(Compiled(data, seconds or 0.0, cached=seconds is None))
                return done
            running = self._running.get(key)
            if running is None:
                running = self._running[key] = self._thread.submit(self._compile, text, key)
                if early:
                    self._early.add(key)
            elif not early:
                self._early.discard(key)  # admission joins it: the result is its own
            return running

    def _compile(self, text: bytes, key: str) -> Compiled:
        try:
            t0 = time.perf_counter()
            data = self._process.compile(text, self.block_size)
            seconds = time.perf_counter() - t0
            with self._lock:
                self._plans[key] = data
                if key in self._early:
                    self._early.discard(key)
                    self._unclaimed[key] = seconds
                while len(self._plans) > self.capacity:
                    self._unclaimed.pop(self._plans.popitem(last=False)[0], None)
            return Compiled(data=data, seconds=seconds, cached=False)
        finally:
            with self._lock:
                self._running.pop(key, None)
                self._early.discard(key)  # a compile that failed is no one's


_early: dict[str, PlanCompiler] = {}  # "compiler": the engine's, where its scheduler can reach it


def compile_early(compiler: PlanCompiler) -> None:
    """Let the scheduler of this process start compiles as requests arrive (`start_compiling`)."""
    _early["compiler"] = compiler


def start_compiling(*extras: dict | None) -> None:
    """Start compiling the priors arriving requests carry (their vLLM `extra_args`), so that
    each plan is ready, or nearly, when the request's first decode step admits it. Never
    raises: a bad prior is refused, with the reason, at admission."""
    compiler = _early.get("compiler")
    for extra in extras:
        if compiler is None or not extra or extra.get(PRIOR_KEY) is None or PLAN_KEY in extra:
            continue
        try:
            compiler.submit(extra[PRIOR_KEY], early=True)
        except Exception:  # noqa: BLE001, S110 - admission says why
            pass


def admit_request(
    s: PlanSession,
    extra: dict,
    prompt_ids,
    rules: Callable[[], EngineRules],
    compiler: Callable[[], PlanCompiler],
    sampling_params=None,
) -> None:
    """Admit the plan a request carries in its `extra_args` (a .kapb, or a prior compiled here
    by `compiler()`), if any, under the engine's `rules()` and the request's vLLM
    `sampling_params`; a request whose plan cannot apply is refused with the reason. A prior
    whose plan is still compiling leaves the session `compiling`; called again once
    `s.compiled`, it admits the plan."""
    if s.compiled:
        return admit_compiled(s, extra, prompt_ids, rules, sampling_params)
    data = _plan_data(s, extra, compiler)
    if isinstance(data, Future):
        if not data.done():
            s.compiling(data)
            return
        data = _compiled(s, data)
    if data is None:
        return
    _admit_plan(s, data, extra, prompt_ids, rules, sampling_params)


def admit_compiled(s: PlanSession, extra: dict, prompt_ids, rules, sampling_params=None) -> None:
    """Admit a `compiling` session whose plan has been compiled (`s.compiled`)."""
    pending, s.compiling_plan = s.compiling_plan, None
    s.status, s.reason = "none", None
    data = _compiled(s, pending)
    if data is not None:
        _admit_plan(s, data, extra, prompt_ids, rules, sampling_params)


def _admit_plan(s: PlanSession, data: bytes, extra: dict, prompt_ids, rules, sampling_params):
    try:
        opts = request_options(extra.get(OPTS_KEY))
    except KapcError as exc:
        s.refuse(f"plan refused: {exc}", exc)
        return
    s.admit(data, prompt_ids, opts, rules(), random_sampling=sampling_is_random(sampling_params))


def sampling_is_random(sp) -> bool:
    """Whether vLLM SamplingParams sample (temperature above zero) rather than decode greedily."""
    if sp is None:
        return False
    t = getattr(sp, "temperature", 0.0)
    return t is not None and t > 1e-5


def _plan_data(s: PlanSession, extra: dict, compiler: Callable[[], PlanCompiler]):
    """The .kapb bytes a request carries, or the compile of its prior (a Future), or None (no
    plan, or refused with the reason)."""
    data = extra.get(PLAN_KEY)
    if data is not None:
        s.source = "kapb"
        if not isinstance(data, str):
            return bytes(data)
        try:  # text, e.g. from the OpenAI server's `vllm_xargs`
            return base64.b64decode(data, validate=True)
        except ValueError:
            s.refuse(f"plan refused: {PLAN_KEY} text is not base64 (of a .kapb)")
            return None
    if extra.get(PRIOR_KEY) is None:
        return None
    s.source = "prior"
    try:
        return compiler().submit(extra[PRIOR_KEY])
    except KapcError as exc:
        s.refuse(f"prior refused: {exc}", exc)
        return None


def _compiled(s: PlanSession, pending: Future) -> bytes | None:
    """A finished compile's plan, its time booked on the session (None: refused, with why)."""
    try:
        compiled = pending.result()
    except KapcError as exc:
        s.refuse(f"prior refused: {exc}", exc)
        return None
    except Exception as exc:  # noqa: BLE001 - one request's prior must not stop the engine
        why = str(exc) if isinstance(exc, CompilerFailed) else f"{type(exc).__name__}: {exc}"
        log.error("kapc: compiling the prior of request %s failed: %s", s.tag, why)
        s.refuse(f"prior refused: the compiler failed on it ({why})")
        return None
    s.compile_s, s.compile_cached = compiled.seconds, compiled.cached
    return compiled.data
