"""The engines `kapc bench` decodes on, behind one small interface: decode a batch (each prompt
with its plan or none) and time it, and measure a cold time to first token.

- `vllm`: vLLM's own engine (`kapc.runtime.vllm`): a plain engine for full-context decoding and the
  prompt baselines, and an engine with kapc's hook for the plans (`--baseline shared`: the hook's
  engine for everything, which saves one prefill of every long prompt on a slow machine);
- `reference`: kapc's reference executor (`kapc.runtime.executor`) on the same model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Output:
    tokens: list[int]
    text: str
    finish: str  # "eos" or "length"
    status: str = "none"  # "plan", "fallback", "refused" or "none" (no plan)
    reason: str | None = None
    s: float | None = None  # the retained ratio the proposals ran at
    proposed: int = 0
    accepted: int = 0
    cycles: int = 0


@dataclass
class BatchRun:
    outputs: list[Output]
    decode_s: float  # wall seconds of the decode (prompts already in the prefix cache)
    prefill_s: float = 0.0  # wall seconds of the untimed-for-throughput prefill before it
    extra: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(len(o.tokens) for o in self.outputs)


class VllmEngine:
    """One vLLM engine (`kind` "plain" or "kapc"), started in this process."""

    def __init__(
        self,
        kind: str,
        block_size: int,
        max_model_len: int,
        batch: int,
        k: int,
        kv_cache_gib: float | None = None,
        model: str | None = None,
    ):
        from kapc.runtime.vllm import make_engine

        self.kind = kind
        self.eng = make_engine(
            model,
            block_size=block_size,
            k=k,
            method="kapc" if kind == "kapc" else "none",
            max_model_len=max_model_len,
            max_num_seqs=batch,
            kv_cache_gib=kv_cache_gib,
            in_process=True,
        )

    def decode(
        self,
        prompts: list[list[int]],
        plans: list | None,
        max_tokens: int,
        accept: str | None = None,
        honor: bool = False,
    ) -> BatchRun:
        from kapc.runtime.vllm import generate

        t0 = time.perf_counter()
        generate(self.eng, prompts, None, max_tokens=1)  # prefill into the prefix cache
        prefill = time.perf_counter() - t0
        res = generate(
            self.eng,
            prompts,
            plans,
            max_tokens=max_tokens,
            accept=accept,
            honor_predicted_loss=honor,
            min_acceptance=honor,
        )
        outs = [
            Output(
                tokens=r["tokens"],
                text=r["text"],
                finish="eos" if r["finish_reason"] == "stop" else r["finish_reason"],
                status=r["status"],
                reason=r["reason"],
                s=r["retained_ratio"],
                proposed=r["proposed"],
                accepted=r["accepted"],
                cycles=r["cycles"],
            )
            for r in res
        ]
        return BatchRun(outs, decode_s=res[0]["batch_s"], prefill_s=prefill)

    def ttft(self, prompt: list[int], plan=None) -> float:
        """Seconds to the first token of one prompt on an empty prefix cache (with its plan, so
        the hook's admission counts)."""
        from kapc.runtime.vllm import generate

        self.eng.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        generate(
            self.eng,
            [prompt],
            None if plan is None else [plan],
            max_tokens=1,
            honor_predicted_loss=False,
        )
        return time.perf_counter() - t0

    def close(self) -> None:
        self.eng.close()


class ReferenceEngine:
    """kapc's reference executor (plain PyTorch over a paged KV cache)."""

    def __init__(
        self,
        kind: str,
        block_size: int,
        max_model_len: int,
        batch: int,
        k: int,
        kv_cache_gib: float | None = None,
        model: str | None = None,
    ):
        from kapc.runtime.executor import Executor
        from kapc.runtime.model import load_model

        self.kind = kind
        self.model = load_model(model)
        self.ex = Executor(self.model, block_size=block_size, kv_cache_gib=kv_cache_gib or 4.0)

    def decode(self, prompts, plans, max_tokens, accept=None, honor=False) -> BatchRun:
        from kapc.runtime.executor import Request

        self.ex.honor_predicted_loss = honor
        plans = [_loaded(p) for p in plans or [None] * len(prompts)]
        res, stats = self.ex.generate(
            [
                Request(p, plan=pl, max_tokens=max_tokens, accept=accept)
                for p, pl in zip(prompts, plans)
            ]
        )
        tok = self.model.tokenizer
        outs = [
            Output(
                tokens=list(r.tokens),
                text=tok.decode(r.tokens, skip_special_tokens=True),
                finish=r.finish_reason,
                status="none"
                if pl is None
                else ("plan" if r.mode == "plan" and not r.fallback_reason else "fallback"),
                reason=r.fallback_reason,
                s=r.retained_ratio,
                proposed=r.proposed,
                accepted=r.accepted,
                cycles=r.cycles,
            )
            for r, pl in zip(res, plans)
        ]
        return BatchRun(outs, decode_s=stats.decode_s, prefill_s=stats.prefill_s)

    def ttft(self, prompt, plan=None) -> float:
        from kapc.runtime.executor import Request

        t0 = time.perf_counter()
        self.ex.generate([Request(prompt, plan=_loaded(plan), max_tokens=1)])
        return time.perf_counter() - t0

    def close(self) -> None:
        self.ex = None


def _loaded(plan):
    """The executor takes a loaded plan; the sweep hands `.kapb` bytes (what vLLM's requests
    carry)."""
    if isinstance(plan, (bytes, bytearray)):
        from kapc.lower.kapb import decode_plan

        return decode_plan(bytes(plan))
    return plan


ENGINES = {"vllm": VllmEngine, "reference": ReferenceEngine}
