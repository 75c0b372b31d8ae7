"""Take a `.kapb` apart and put it back together, so that a mutated header or mutated arrays are
re-sealed (total length and SHA-256 recomputed, layout as in kapc/lower/kapb.py) and reach the
checks behind the checksum instead of dying at "checksum mismatch"."""

from __future__ import annotations

import hashlib
import math
import random
import struct

import msgspec

MAGIC = b"KAPB\x00\r\n\x1a"
PREFIX = struct.Struct("<8sIIQ32s")  # magic, version, header length, total length, sha256
ALIGN = 64
ARRAY_NAMES = ("prompt_token_ids", "selected_blocks", "positions")


def is_kapb(data: bytes) -> bool:
    return len(data) >= PREFIX.size and data[:8] == MAGIC


def unseal(data: bytes) -> tuple[int, int, bytes]:
    """(format version, header length, body) of a plan; the body is everything after the prefix."""
    _, version, head_len, _, _ = PREFIX.unpack_from(data)
    return version, head_len, bytes(data[PREFIX.size :])


def reseal(body: bytes, head_len: int, version: int = 1, magic: bytes = MAGIC) -> bytes:
    """A prefix whose total length and checksum match `body`."""
    head_len &= 0xFFFFFFFF
    version &= 0xFFFFFFFF
    total = PREFIX.size + len(body)
    return PREFIX.pack(magic, version, head_len, total, hashlib.sha256(body).digest()) + body


def split(data: bytes) -> tuple[dict, dict[str, list[int]]]:
    """A valid plan as an untyped header dict (msgpack map) and its arrays as int lists."""
    version, head_len, body = unseal(data)
    header = msgspec.msgpack.decode(body[:head_len])
    arrays = {}
    for name, _dtype, offset, count in header.get("arrays", []):
        raw = data[offset : offset + 4 * count]
        arrays[name] = list(struct.unpack(f"<{len(raw) // 4}i", raw[: len(raw) // 4 * 4]))
    return header, arrays


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _i32(values) -> bytes:
    return b"".join(struct.pack("<i", ((int(v) + 2**31) % 2**32) - 2**31) for v in values)


def build(
    header: dict, arrays: dict[str, list[int]], *, relayout: bool = True, version: int = 1
) -> bytes:
    """Lay out `arrays` after the msgpack-encoded `header` the way encode_plan does and seal it.
    With relayout=False the header's own `arrays` refs (possibly mutated) are kept as they are, and
    the array bytes are still written at the aligned offsets after the header."""
    header = dict(header)
    names = list(arrays)
    if relayout:
        refs = [[n, "<i4", 2**62, len(arrays[n])] for n in names]
        for _ in range(2):
            head = msgspec.msgpack.encode({**header, "arrays": refs})
            offset = _align(PREFIX.size + len(head))
            new = []
            for n in names:
                new.append([n, "<i4", offset, len(arrays[n])])
                offset = _align(offset + 4 * len(arrays[n]))
            refs = new
        header["arrays"] = refs
    head = msgspec.msgpack.encode(header)
    body = bytearray(head)
    offset = _align(PREFIX.size + len(body))
    for n in names:
        body.extend(b"\0" * (offset - PREFIX.size - len(body)))
        blob = _i32(arrays[n])
        body.extend(blob)
        offset = _align(PREFIX.size + len(body))
    return reseal(bytes(body), len(head), version)


# ---- structured mutation (shared by the atheris custom mutator and the hypothesis generator) ----

EVIL_INTS = [
    0,
    1,
    -1,
    2,
    3,
    7,
    15,
    16,
    17,
    63,
    64,
    65,
    -64,
    2**31 - 1,
    2**31,
    -(2**31),
    2**32,
    2**53 + 1,
    2**62,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
]
EVIL_FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e308, -1e308, 5e-324, math.inf, -math.inf, math.nan]
EVIL_STRS = [
    "",
    "greedy",
    "top1",
    "top3",
    "top99",
    "bogus",
    "\x00",
    "é",
    "a" * 300,
    "sha256:",
    "sha256:" + "0" * 64,
]
EVIL_ANY = EVIL_INTS + EVIL_FLOATS + EVIL_STRS + [None, True, False, [], {}, [1, 2]]
SCALARS = [
    "name",
    "kapc_version",
    "model",
    "model_fingerprint",
    "tokenizer_fingerprint",
    "template_fingerprint",
    "block_size",
    "prompt_tokens",
    "prompt_hash",
    "visible_prompt_tokens",
    "retained_ratio",
    "padded_blocks",
    "k",
    "accept",
]
NESTED = {
    "fallback": ["max_retained", "min_acceptance", "acceptance_window", "on_predicted_loss"],
    "cost": ["weight_bytes", "kv_bytes", "batch", "s", "h", "k", "speedup", "pays"],
}


def _evil_value(rng: random.Random, old):
    if isinstance(old, bool) or rng.random() < 0.15:
        return rng.choice(EVIL_ANY)
    if isinstance(old, int):
        return rng.choice([old + rng.choice([-1, 1]), -old, old * 2, old // 2] + EVIL_INTS)
    if isinstance(old, float):
        return rng.choice([old * 2, -old, old + 1e-3] + EVIL_FLOATS)
    if isinstance(old, str):
        return rng.choice([old[:-1], old + "x", old.upper()] + EVIL_STRS)
    return rng.choice(EVIL_ANY)


def mutate(data: bytes, rng: random.Random, steps: int = 1) -> bytes:
    """One to a few semantic mutations of a valid plan (header fields, array refs, array contents),
    re-sealed. Falls back to returning `data` unchanged if it is not a well-formed plan."""
    try:
        header, arrays = split(data)
    except Exception:  # noqa: BLE001 - not a plan we can take apart
        return data
    if not isinstance(header, dict):
        return data
    relayout = True
    for _ in range(steps):
        try:
            _mutate_once(header, arrays, rng)
        except _KeepRefs:
            relayout = False
        except Exception:  # noqa: BLE001 - a field already mutated into an odd type
            pass
    try:
        return build(header, arrays, relayout=relayout)
    except Exception:  # noqa: BLE001 - an unencodable value (e.g. int out of msgpack range)
        return data


class _KeepRefs(Exception):
    """Raised by a mutation of the array refs: keep them as they are (no relayout)."""


def _mutate_once(header: dict, arrays: dict, rng: random.Random) -> None:
    op = rng.randrange(9)
    if op == 0:  # a scalar header field
        key = rng.choice(SCALARS)
        header[key] = _evil_value(rng, header.get(key))
    elif op == 1 and NESTED:  # fallback / cost field
        sub = rng.choice(list(NESTED))
        d = dict(header.get(sub) or {})
        key = rng.choice(NESTED[sub])
        d[key] = _evil_value(rng, d.get(key))
        header[sub] = d
    elif op == 2 and arrays:  # change one array's contents
        name = rng.choice(list(arrays))
        a = list(arrays[name])
        how = rng.randrange(7)
        if how == 0 and a:
            a.pop(rng.randrange(len(a)))
        elif how == 1:
            a.insert(rng.randrange(len(a) + 1), rng.choice(EVIL_INTS + a[:5]))
        elif how == 2 and a:
            i = rng.randrange(len(a))
            a[i] = rng.choice([a[i] + 1, a[i] - 1, -a[i], 0] + EVIL_INTS)
        elif how == 3:
            a.reverse()
        elif how == 4:
            a = a + a[-1:]
        elif how == 5:
            a = []
        else:
            a = [x + rng.choice([-1, 1]) for x in a]
        arrays[name] = a
    elif op == 3:  # an array ref field, keeping the bytes where they are
        refs = [list(r) for r in header.get("arrays", [])]
        if refs:
            r = rng.choice(refs)
            i = rng.randrange(4)
            r[i] = (
                _evil_value(rng, r[i])
                if i != 0
                else rng.choice(list(ARRAY_NAMES) + ["header", "bogus", ""])
            )
            if i == 2 and rng.random() < 0.5:
                r[2] = rng.choice([0, 64, -64, r[2] - 64, r[2] + 64, 2**62])
            if i == 3 and rng.random() < 0.5:
                r[3] = rng.choice([-1, -2, 0, r[3] + 1, r[3] - 1, r[3] * 2, 2**40])
        header["arrays"] = refs
        raise _KeepRefs
    elif op == 4:  # drop, duplicate or reorder refs
        refs = [list(r) for r in header.get("arrays", [])]
        how = rng.randrange(3)
        if how == 0 and refs:
            refs.pop(rng.randrange(len(refs)))
        elif how == 1 and refs:
            refs.append(list(rng.choice(refs)))
        else:
            rng.shuffle(refs)
        header["arrays"] = refs
        raise _KeepRefs
    elif op == 5:  # drop or add a header key
        if rng.random() < 0.5 and header:
            header.pop(rng.choice(list(header)))
        else:
            header[rng.choice(["bogus", "extra", "k2"])] = rng.choice(EVIL_ANY)
    elif op == 6 and arrays:  # swap the contents of two arrays
        a, b = rng.sample(list(arrays), 2) if len(arrays) > 1 else (None, None)
        if a:
            arrays[a], arrays[b] = arrays[b], arrays[a]
    elif op == 7:  # consistent-looking change: shift the selected blocks / block size
        bs = header.get("block_size")
        if isinstance(bs, int) and bs > 0:
            header["block_size"] = rng.choice([bs // 2, bs * 2, 1, bs + 1])
    else:  # prompt_tokens and the token array changed together
        ids = list(arrays.get("prompt_token_ids", []))
        cut = rng.randrange(len(ids) + 1) if ids else 0
        arrays["prompt_token_ids"] = ids[:cut]
        header["prompt_tokens"] = cut
