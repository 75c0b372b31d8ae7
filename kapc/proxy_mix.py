"""ES-Mix calibrations: per layer, which proxy query chooses that layer's pages better.

EarlySelectKV builds layer l's query one layer early from layer l-1's input (ES-In) or from its
post-attention state (ES-Mid); which is closer to the true query differs by layer. A calibration
(`kapc calibrate proxy`, on HotpotQA questions the benchmarks do not use) measures, per layer, the
overlap between the pages each proxy chooses and the pages the true query chooses, and keeps the
better one. The file is small JSON; `compact{proxy=es-mix,mix=FILE}` copies its per-layer choice
into the plan (so a runtime never needs the file) and records its digest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

from kapc.errors import KapcError, bounded

MIX_VERSION = 1


class ProxyMixError(KapcError):
    """A proxy calibration that cannot be read or used."""


class ProxyMix(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    model: str
    model_fingerprint: str
    budget: float  # the retained ratio the overlaps were measured at
    questions: int
    overlap_in: tuple[float, ...]  # per layer (layer 0 chooses from its own query: 1.0)
    overlap_mid: tuple[float, ...]
    mix: tuple[str, ...]  # "in" or "mid" per layer
    created: str = ""

    @property
    def digest(self) -> str:
        return "sha256:" + hashlib.sha256(msgspec.json.encode(self)).hexdigest()


def choose_mix(overlap_in, overlap_mid) -> tuple[str, ...]:
    """Per layer, the proxy with the larger overlap (ES-Mid on a tie: it has seen more)."""
    return tuple("in" if a > b else "mid" for a, b in zip(overlap_in, overlap_mid))


def save_mix(mix: ProxyMix, path: str | Path) -> Path:
    from kapc.files import write_output

    path = Path(path)
    write_output(path, msgspec.json.format(msgspec.json.encode(mix), indent=1), "proxy calibration")
    return path


def load_mix(path: str | Path) -> ProxyMix:
    from kapc.files import read_input

    try:
        mix = msgspec.json.decode(read_input(path, "proxy calibration"), type=ProxyMix)
    except msgspec.DecodeError as exc:
        raise ProxyMixError(f"{path}: not a kapc proxy calibration: {bounded(str(exc))}") from None
    if mix.version != MIX_VERSION:
        raise ProxyMixError(
            f"{path}: proxy calibration version {mix.version}, this kapc reads "
            f"{MIX_VERSION}; run kapc calibrate proxy again"
        )
    n = len(mix.mix)
    if (
        not n
        or len(mix.overlap_in) != n
        or len(mix.overlap_mid) != n
        or any(m not in ("in", "mid") for m in mix.mix)
    ):
        raise ProxyMixError(
            f"{path}: a proxy calibration lists 'in' or 'mid' and both overlaps for every layer"
        )
    return mix
