"""Reading inputs and writing outputs, with the size limits and the error messages every command
shares: a missing file, a directory, an oversized or endless input (`/dev/zero`), an output
directory that does not exist or cannot be written all end in one clear sentence, and an output
is never left half-written under its real name."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kapc.errors import KapcError
from kapc.limits import MAX_INPUT_BYTES


class FileError(KapcError):
    """An input that cannot be read or an output that cannot be written."""


def read_input(path: str | Path, what: str = "input", limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of `path`, refusing anything that is not a readable regular-sized file."""
    path = Path(path)
    try:
        if path.is_dir():
            raise FileError(f"{path}: is a directory, not a {what} file")
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise FileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise FileError(
            f"{path}: larger than the {limit >> 20} MiB a {what} may be (docs/limits.md)"
        )
    return data


def check_output(path: str | Path, option: str) -> Path:
    """Refuse an output path that cannot be written, before any work is done."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise FileError(f"{option} {path}: is a directory; give a file name")
    if not parent.exists():
        raise FileError(f"{option} {path}: the directory {parent} does not exist")
    if not parent.is_dir():
        raise FileError(f"{option} {path}: {parent} is not a directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise FileError(f"{option} {path}: the file is not writable")
    # os.access answers for permission bits only (root passes; read-only mounts do not): make
    # and remove a file beside the output to know
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise FileError(
            f"{option} {path}: the directory {parent} is not writable ({exc.strerror or exc})"
        ) from None
    return path


def write_output(path: str | Path, data: bytes | str, option: str = "output") -> None:
    """Write atomically: a temporary file beside `path`, renamed over it once complete, removed
    if anything fails."""
    path = check_output(path, option)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = None, None
    try:
        fd, tmp = tempfile.mkstemp(
            dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.", suffix=".tmp"
        )
        with os.fdopen(fd, "wb") as f:
            fd = None
            f.write(payload)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise FileError(f"{option} {path}: cannot write: {exc.strerror or exc}") from None
    finally:
        if fd is not None:
            os.close(fd)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


_UTF8_BOM = b"\xef\xbb\xbf"
_OTHER_BOMS = {
    b"\xff\xfe\x00\x00": "UTF-32",
    b"\x00\x00\xfe\xff": "UTF-32",
    b"\xff\xfe": "UTF-16",
    b"\xfe\xff": "UTF-16",
}


def without_bom(data: bytes) -> bytes:
    """`data` less a UTF-8 byte-order mark (some editors write one); raises FileError (no
    path: the caller's message adds it) for text in UTF-16 or UTF-32, which kapc does not read."""
    if data.startswith(_UTF8_BOM):
        return data[len(_UTF8_BOM) :]
    for bom, name in _OTHER_BOMS.items():
        if data.startswith(bom):
            raise FileError(
                f"the text is {name} (it starts with the byte-order mark "
                f"{bom.hex(' ').upper()}); save it as UTF-8"
            )
    return data
