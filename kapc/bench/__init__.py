"""`kapc bench`: the evaluation harness. Answer quality and decode speed of kapc's plans against
full-context decoding and the paper's prompt-materialisation baselines, over context lengths,
HotpotQA and SQuAD questions, short and long answers, on vLLM or the reference executor.

- `kapc.bench.cases`: priors from the offline frontend, the workloads, the baselines' prompts;
- `kapc.bench.engines`: the engines behind one small interface;
- `kapc.bench.run`: the resumable sweep (`run_sweep`);
- `kapc.bench.metrics`, `kapc.bench.quality`: EM, F1, agreement, the similarity judge;
- `kapc.bench.report`: tables and plots.

docs/bench.md describes what each number means.
"""

from kapc.bench.run import METHODS, BenchConfig, BenchError, run_sweep

__all__ = ["BenchConfig", "BenchError", "METHODS", "run_sweep"]
