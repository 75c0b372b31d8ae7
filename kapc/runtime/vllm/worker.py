"""Worker extension mixed into vLLM's worker (`LLM(worker_extension_cls=...)`): reaches the model
runner and the proposer from the driver through `llm.collective_rpc(...)`."""

from __future__ import annotations


class KapWorkerExtension:
    def _kapc_proposer(self):
        from kapc.runtime.vllm.proposer import KapProposer

        drafter = getattr(self.model_runner, "drafter", None)
        if not isinstance(drafter, KapProposer):
            raise RuntimeError(
                "this vLLM engine was not started with kapc's proposer "
                "(speculative_config method custom_class, model "
                "kapc.runtime.vllm.proposer.KapProposer)"
            )
        return drafter

    def kapc_bind(self) -> dict:
        """Bind the proposer to this worker's model runner; returns what it sees."""
        p = self._kapc_proposer()
        p.bind(self.model_runner)
        p._setup(self.model_runner)
        return {
            "k": p.k,
            "block_size": p.block_size,
            "layers": len(p.setup.layout.layer_names),
            "device": str(self.model_runner.device),
        }

    def kapc_use_profile(self, source: str = "auto", online: bool = True) -> str | None:
        """Choose the step policy's profile ("auto", "none" or a path), scaled by measured step
        times unless `online` is False; returns its key."""
        return self._kapc_proposer().use_profile(source, online)

    def kapc_threads(self) -> int:
        """The threads this worker computes with."""
        import torch

        return torch.get_num_threads()

    def kapc_stats(self, pop: bool = False, tag: str | None = None) -> dict:
        """Per-request proposal statistics (by tag; only `tag`'s when given) and proposer
        timing."""
        p = self._kapc_proposer()
        if p._runner is not None:
            p._prune(p._runner)
        return p.stats(pop=pop, tag=tag)

    def kapc_step_log(self, pop: bool = True) -> list[tuple]:
        """Per engine step, the proposer's call as a `kapc.runtime.planner.StepRecord` (as a
        tuple); `kapc.runtime.vllm.calibrate` turns them into step times."""
        p = self._kapc_proposer()
        out = [tuple(record) for record in p.planner.log]
        if pop:
            p.planner.log.clear()
        return out

    def kapc_metrics(self) -> dict:
        """Counts since the engine started (`kapc.runtime.session.ServedTotals`, plus the steps
        held before a prefill and the requests in the batch), for the server's `/metrics`."""
        import msgspec

        p = self._kapc_proposer()
        if p._runner is not None:
            p._prune(p._runner)
        return {
            **msgspec.to_builtins(p.totals),
            "prefill_held_steps": p.planner.prefill_holds,
            "live": len(p.sessions),
        }
