"""Plans compiled at admission: a request may carry its frontend's prior (`prior.json`) instead of
a compiled `.kapb`, and the engine's worker compiles it, against the engine's own model, block size
and calibration profile, with the default pipeline.

The prompt a prior renders to (its messages through the model's chat template) must be the prompt
the engine tokenised for the request; the proposer's usual plan check (`check_plan_matches`)
refuses the request's plan, for that request only, when it is not.

A server sees the same prior many times (a retry, a benchmark, a frontend that caches its
retrieval), so compiled plans are kept by the prior's content hash: a repeated prior compiles once.
Torch-free, vLLM-free: the worker calls it with plain values.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
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

log = logging.getLogger("vllm.kapc")
CACHED_PLANS = 256  # compiled plans kept per engine, least recently used dropped first


@dataclass(frozen=True)
class Compiled:
    """One prior's plan: the `.kapb` bytes, the seconds this request waited for them (0.0 when
    the plan came from the cache) and whether it did."""

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
    compiler finds its profile under (kapc.policy.ENGINE_BLOCK_SIZE: "vllm-cpu" or "vllm-gpu")."""

    def __init__(self, model: str, block_size: int, engine: str, capacity: int = CACHED_PLANS):
        self.model, self.block_size, self.engine = model, int(block_size), engine
        self.capacity = int(capacity)
        self._plans: OrderedDict[str, bytes] = OrderedDict()
        self._ctx = None  # one CompileContext: the tokenizer loads once per engine

    def key(self, text: bytes) -> str:
        return hashlib.sha256(text + b"\0" + str(self.block_size).encode()).hexdigest()

    def compile(self, value) -> Compiled:
        """The plan of a prior, compiled now or taken from the cache. Raises KapcError (the prior's
        own errors name their JSON path) when it cannot be compiled."""
        from kapc.compiler import compile_to_kapb
        from kapc.passes import CompileContext
        from kapc.prior import decode_prior

        text = prior_text(value)
        key = self.key(text)
        data = self._plans.get(key)
        if data is not None:
            self._plans.move_to_end(key)
            return Compiled(data=data, seconds=0.0, cached=True)
        t0 = time.perf_counter()
        prior = decode_prior(text, f"<request {PRIOR_KEY}>")
        if self._ctx is None:
            self._ctx = CompileContext(model=self.model, engine=self.engine)
        data = compile_to_kapb(prior, None, self._ctx, block_size=self.block_size)
        self._plans[key] = data
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
        return Compiled(data=data, seconds=time.perf_counter() - t0, cached=False)


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
    `sampling_params`; a request whose plan cannot apply is refused with the reason."""
    data = _plan_data(s, extra, compiler)
    if data is None:
        return
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


def _plan_data(s: PlanSession, extra: dict, compiler: Callable[[], PlanCompiler]) -> bytes | None:
    """The .kapb bytes a request carries, or compiled from its prior (None: no plan, or refused
    with the reason)."""
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
        compiled = compiler().compile(extra[PRIOR_KEY])
    except KapcError as exc:
        s.refuse(f"prior refused: {exc}", exc)
        return None
    except Exception as exc:  # noqa: BLE001 - one request's prior must not stop the engine
        log.exception("kapc: compiling the prior of request %s failed", s.tag)
        s.refuse(f"prior refused: the compiler failed on it ({type(exc).__name__}: {exc})")
        return None
    # compilation runs in the engine's step: the figure is reported
    s.compile_s, s.compile_cached = compiled.seconds, compiled.cached
    return compiled.data
