"""`.kapb`: the binary plan a runtime loads.

Layout (all integers little-endian):

    offset  size  field
    0       8     magic  b"KAPB\\x00\\r\\n\\x1a"  (catches text-mode mangling, like PNG's)
    8       4     format version (u32)
    12      4     header length H (u32): msgpack-encoded `PlanHeader`
    16      8     total file length (u64): catches truncation before anything is parsed
    24      32    SHA-256 of bytes [56, total): catches any flipped byte
    56      H     header
    ...           arrays, each 64-byte aligned, at the offsets the header lists

Arrays are raw little-endian integers so that `numpy.frombuffer` / `torch.frombuffer` view them
without copying. The header says what the plan was compiled for (model, tokenizer and template
fingerprints, block size, prompt hash) so that a runtime refuses a plan that does not match.
Fields are only ever appended, with defaults; `FORMAT_VERSION` grows when old readers must refuse.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

from kapc.errors import KapcError, bounded
from kapc.files import read_input, write_output
from kapc.limits import MAX_BATCH, MAX_BLOCK_SIZE, MAX_K, MAX_PROMPT_TOKENS
from kapc.policy import AccessPolicy, access_problem

MAGIC = b"KAPB\x00\r\n\x1a"
FORMAT_VERSION = 2  # 2: the header's access policy (a version-1 plan reads as static access)
READS_VERSIONS = (1, 2)
_PREFIX = struct.Struct("<8sIIQ32s")  # magic, version, header length, total length, sha256
_ALIGN = 64


class KapbError(KapcError):
    """A `.kapb` that cannot be used; the message says what is wrong."""


class FallbackPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """When the runtime decodes with the full context instead of the plan."""

    max_retained: float = 0.5  # refuse plans whose retained ratio s exceeds this
    min_acceptance: float = 0.3  # fall back when observed acceptance stays below this ...
    acceptance_window: int = 32  # ... over this many proposed tokens
    on_predicted_loss: bool = True  # fall back when the cost model predicts no gain
    min_separation: float = 0.0  # fall back when the priors separate the kept passages less


class CostPrediction(msgspec.Struct, frozen=True, kw_only=True):
    """What the compiler predicted (kapc.policy.predict): the speedup at the expected acceptance
    `h`, from the memory-bound model or from a calibration profile (`basis`)."""

    weight_bytes: int
    kv_bytes: int  # full-context KV bytes of this prompt
    batch: int
    s: float
    h: float
    k: int
    speedup: float
    pays: bool
    basis: str = "memory-bound"
    break_even: float | None = None  # acceptance rate h at which the plan breaks even
    p: float | None = None  # the per-draft acceptance the prediction assumed


class ArrayRef(msgspec.Struct, frozen=True, array_like=True):
    name: str
    dtype: str  # numpy dtype string, little-endian ("<i4")
    offset: int
    count: int


class PlanHeader(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    kapc_version: str
    model: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    template_fingerprint: str
    block_size: int
    prompt_tokens: int
    prompt_hash: str  # "sha256:" of the prompt token ids as little-endian int32
    visible_prompt_tokens: int  # prompt tokens the proposal sees
    retained_ratio: float
    padded_blocks: int  # compact table width padded to a stable bucket
    k: int
    accept: str  # "greedy" or "top{N}"
    fallback: FallbackPolicy
    cost: CostPrediction
    arrays: tuple[ArrayRef, ...] = ()
    access: AccessPolicy = AccessPolicy()
    # the priors' separation of kept from dropped passages (select's; None: nothing dropped)
    prior_separation: float | None = None


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """A plan in memory: the header plus its arrays (views into the file's bytes, not copies).

    prompt_token_ids: int32[prompt_tokens]
    selected_blocks:  int32[n]  logical prompt blocks the proposal reads, ascending; the last is the
                                block holding the last prompt token (the tail)
    positions:        int32[visible_prompt_tokens]  logical position of each visible prompt token,
                                in compact-view order
    """

    header: PlanHeader
    prompt_token_ids: np.ndarray
    selected_blocks: np.ndarray
    positions: np.ndarray

    @property
    def format_version(self) -> int:
        return FORMAT_VERSION


def prompt_hash(token_ids) -> str:
    return "sha256:" + hashlib.sha256(np.asarray(token_ids, dtype="<i4").tobytes()).hexdigest()


_ARRAY_NAMES = ("prompt_token_ids", "selected_blocks", "positions")
_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(PlanHeader)


def encode_plan(header: PlanHeader, prompt_token_ids, selected_blocks, positions) -> bytes:
    arrays = {
        "prompt_token_ids": np.ascontiguousarray(prompt_token_ids, dtype="<i4"),
        "selected_blocks": np.ascontiguousarray(selected_blocks, dtype="<i4"),
        "positions": np.ascontiguousarray(positions, dtype="<i4"),
    }
    # The header holds the array offsets, which depend on the header's own length: lay the arrays
    # out after a header encoded with placeholder offsets of the final width, then re-encode.
    refs = tuple(ArrayRef(n, "<i4", 2**62, a.size) for n, a in arrays.items())
    for _ in range(2):
        head = _header_encoder.encode(msgspec.structs.replace(header, arrays=refs))
        offset = _align(_PREFIX.size + len(head))
        new_refs = []
        for name, arr in arrays.items():
            new_refs.append(ArrayRef(name, "<i4", offset, arr.size))
            offset = _align(offset + arr.nbytes)
        refs = tuple(new_refs)
    head = _header_encoder.encode(msgspec.structs.replace(header, arrays=refs))
    body = bytearray(head)
    for ref in refs:
        gap = ref.offset - _PREFIX.size - len(body)
        assert gap >= 0, "array offsets computed for a shorter header"
        body.extend(b"\0" * gap)
        body.extend(arrays[ref.name].tobytes())
    total = _PREFIX.size + len(body)
    digest = hashlib.sha256(body).digest()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(head), total, digest) + bytes(body)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def decode_plan(data: bytes | memoryview, source: str = "<kapb>") -> Plan:
    buf = memoryview(data)
    if len(buf) < _PREFIX.size:
        raise KapbError(
            f"{source}: truncated: {len(buf)} bytes is shorter than the "
            f"{_PREFIX.size}-byte .kapb prefix"
        )
    magic, version, head_len, total, digest = _PREFIX.unpack_from(buf)
    if magic != MAGIC:
        raise KapbError(f"{source}: not a .kapb file (bad magic {bytes(magic)!r})")
    if version not in READS_VERSIONS:
        newer = (
            "newer than this kapc reads; upgrade kapc"
            if version > FORMAT_VERSION
            else "too old; recompile the plan"
        )
        raise KapbError(
            f"{source}: format version {version} is {newer} (this kapc reads "
            f"versions {', '.join(map(str, READS_VERSIONS))})"
        )
    if len(buf) != total:
        what = "truncated" if len(buf) < total else "has trailing bytes"
        raise KapbError(f"{source}: {what}: {len(buf)} bytes, the header says {total}")
    if hashlib.sha256(buf[_PREFIX.size :]).digest() != digest:
        raise KapbError(
            f"{source}: checksum mismatch: the file is corrupt (SHA-256 of the body "
            f"does not match the one recorded at compile time)"
        )
    try:
        header = _header_decoder.decode(buf[_PREFIX.size : _PREFIX.size + head_len])
    except msgspec.DecodeError as exc:
        raise KapbError(f"{source}: unreadable header: {bounded(str(exc))}") from None
    if version == 1:  # version 1 had no access policy: its plans read their own pages
        header = msgspec.structs.replace(header, access=AccessPolicy())
    arrays = {}
    floor = _PREFIX.size + head_len  # arrays follow the header and never overlap one another
    for ref in header.arrays:
        where = f"{source}: array {ref.name!r}"
        if ref.name not in _ARRAY_NAMES or ref.name in arrays:
            raise KapbError(
                f"{where}: unknown or listed twice (a plan holds "
                f"{', '.join(_ARRAY_NAMES)} once each)"
            )
        if ref.dtype != "<i4":
            raise KapbError(f"{where}: type {ref.dtype!r}, expected '<i4'")
        end = ref.offset + ref.count * 4
        if ref.count < 0 or ref.offset < floor or ref.offset % _ALIGN or end > total:
            raise KapbError(
                f"{where}: {ref.count} entries at offset {ref.offset} lie outside the "
                f"file's array area ({floor}..{total})"
            )
        floor = end
        arrays[ref.name] = np.frombuffer(buf, dtype="<i4", count=ref.count, offset=ref.offset)
    missing = [n for n in _ARRAY_NAMES if n not in arrays]
    if missing:
        raise KapbError(f"{source}: missing arrays {missing}")
    plan = Plan(header=header, **arrays)
    problem = plan_problem(plan)
    if problem:
        raise KapbError(f"{source}: inconsistent plan: {problem}")
    return plan


def plan_problem(plan: Plan) -> str | None:
    """The first way a plan's header and arrays disagree, or None. A checksum proves the bytes are
    the ones written, not that what was written makes sense (a hand-made or buggy writer's plan)."""
    h = plan.header
    n, bs = h.prompt_tokens, h.block_size
    for name in ("retained_ratio",):
        if not math.isfinite(getattr(h, name)):
            return f"{name} is not a finite number"
    if n < 1 or n > MAX_PROMPT_TOKENS:
        return f"prompt_tokens {n} is outside 1..{MAX_PROMPT_TOKENS}"
    if not 1 <= bs <= MAX_BLOCK_SIZE:
        return f"block_size {bs} is outside 1..{MAX_BLOCK_SIZE}"
    if not 1 <= h.k <= MAX_K:
        return f"k={h.k} is outside 1..{MAX_K}"
    if not re.fullmatch(r"greedy|top[2-9]", h.accept):
        return f"acceptance rule {h.accept!r} is not greedy or top2..top9"
    if plan.prompt_token_ids.size != n:
        return f"{plan.prompt_token_ids.size} prompt token ids for prompt_tokens={n}"
    if n and int(plan.prompt_token_ids.min()) < 0:
        return "a prompt token id is negative"
    if prompt_hash(plan.prompt_token_ids) != h.prompt_hash:
        return "prompt_hash does not match the prompt token ids"
    blocks = plan.selected_blocks.astype(np.int64)
    tail = (n - 1) // bs
    if blocks.size == 0 or blocks[0] < 0 or np.any(np.diff(blocks) <= 0) or blocks[-1] != tail:
        return f"selected_blocks must ascend without repeats and end with the tail block {tail}"
    want = (blocks[:, None] * bs + np.arange(bs)).ravel()
    want = want[want < n]
    if plan.positions.size != want.size or not np.array_equal(plan.positions, want):
        return "positions are not the prompt tokens of the selected blocks"
    if h.visible_prompt_tokens != want.size:
        return (
            f"visible_prompt_tokens {h.visible_prompt_tokens}, the selected blocks hold {want.size}"
        )
    if abs(h.retained_ratio - want.size / n) > 1e-6:
        return f"retained_ratio {h.retained_ratio} is not visible/prompt tokens ({want.size}/{n})"
    if h.padded_blocks < blocks.size:
        return f"padded_blocks {h.padded_blocks} is below the {blocks.size} selected blocks"
    fb, c = h.fallback, h.cost
    if not (0.0 <= fb.max_retained <= 1.0 and 0.0 <= fb.min_acceptance <= 1.0):
        return "fallback: max_retained and min_acceptance must lie in [0, 1]"
    if not 1 <= fb.acceptance_window <= 1_000_000:
        return f"fallback: acceptance_window {fb.acceptance_window} is outside 1..1000000"
    if not all(math.isfinite(x) for x in (c.s, c.h, c.speedup)) or c.speedup <= 0:
        return "cost: s, h and speedup must be finite, speedup positive"
    if c.p is not None and not (math.isfinite(c.p) and 0.0 <= c.p <= 1.0):
        return f"cost: p={c.p} must lie in [0, 1]"
    if not (0.0 <= c.h <= 1.0 and abs(c.s - h.retained_ratio) <= 1e-6):
        return f"cost: h={c.h} must lie in [0, 1] and s={c.s} equal retained_ratio"
    access = access_problem(h.access)
    if access:
        return access
    if c.k != h.k or not 1 <= c.batch <= MAX_BATCH or c.weight_bytes < 0 or c.kv_bytes < 0:
        return (
            f"cost: k={c.k} must be the plan's ({h.k}), batch={c.batch} within 1..{MAX_BATCH}, "
            f"byte counts not negative"
        )
    return None


def write_plan(path: str | Path, data: bytes) -> None:
    write_output(path, data, "-o")  # never leaves a half-written plan under the real name


def read_plan(path: str | Path) -> Plan:
    return decode_plan(read_input(path, ".kapb"), str(path))


class PlanMismatch(KapbError):
    """The plan was compiled for another model, tokenizer, block size or prompt."""


def check_plan_matches(
    plan: Plan,
    *,
    model_fingerprint: str | None = None,
    tokenizer_fingerprint: str | None = None,
    block_size: int | None = None,
    prompt_token_ids=None,
) -> None:
    """Raise PlanMismatch naming the first thing that differs between the plan and the request."""
    h = plan.header
    if model_fingerprint is not None and model_fingerprint != h.model_fingerprint:
        raise PlanMismatch(
            f"plan {h.name!r} was compiled for another model ({h.model}, "
            f"{h.model_fingerprint[:19]}), this engine runs {model_fingerprint[:19]}"
        )
    if tokenizer_fingerprint is not None and tokenizer_fingerprint != h.tokenizer_fingerprint:
        raise PlanMismatch(f"plan {h.name!r} was compiled with another tokenizer")
    if block_size is not None and block_size != h.block_size:
        raise PlanMismatch(
            f"plan {h.name!r} was compiled for block size {h.block_size}, "
            f"the engine uses {block_size}"
        )
    if prompt_token_ids is not None:
        got = prompt_hash(prompt_token_ids)
        if got != h.prompt_hash:
            raise PlanMismatch(
                f"plan {h.name!r} was compiled for another prompt "
                f"({h.prompt_tokens} tokens, {h.prompt_hash[:19]}), the request has "
                f"{len(prompt_token_ids)} tokens, {got[:19]}"
            )


AcceptRule = Literal["greedy", "top2", "top3", "top4", "top5"]
