"""A vLLM scheduler that reserves k lookahead KV slots per decoding request.

vLLM reserves lookahead slots only for EAGLE-style and draft-model proposers; for `custom_class`
it reserves none, so a position the proposer drafts can lie past the request's allocated blocks.
This subclass makes `allocate_slots` reserve `num_speculative_tokens` more slots, so every draft
position P .. P+k-1 (P: the newest sampled token) falls inside the request's own blocks, whose
uncommitted slots the next verification rewrites. It runs in the engine-core process.
"""

from __future__ import annotations

from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import MambaSpec


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
