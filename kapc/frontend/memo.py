"""An optional on-disk memo of per-text model outputs (dense embeddings, spaCy entities).

Off unless `KAPC_FRONTEND_MEMO` names a file (the recall benchmark turns it on with `--memo`).
One SQLite file (WAL, so several processes may share it), keyed by a hash of what the value
depends on: the kind of value, the model, the precision and the text. Values are the exact
bytes the model produced, so a memoised run gives the same priors as a fresh one on the same
machine. The memo only ever saves time: a damaged or unwritable file is ignored.
"""

from __future__ import annotations

import functools
import hashlib
import sqlite3
import threading
from pathlib import Path

from kapc import settings


def _key(kind: str, text: str) -> bytes:
    return hashlib.blake2b(f"{kind}\x00{text}".encode(), digest_size=16).digest()


class Memo:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), timeout=60, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS memo (k BLOB PRIMARY KEY, v BLOB NOT NULL)")
        self._db.commit()

    def get_many(self, kind: str, texts: list[str]) -> dict[str, bytes]:
        """text -> stored bytes, for the texts that are stored."""
        out: dict[str, bytes] = {}
        keys = {_key(kind, t): t for t in texts}
        ks = list(keys)
        with self._lock:
            for i in range(0, len(ks), 500):
                chunk = ks[i : i + 500]
                rows = self._db.execute(
                    f"SELECT k, v FROM memo WHERE k IN ({','.join('?' * len(chunk))})", chunk
                )
                for k, v in rows:
                    out[keys[bytes(k)]] = bytes(v)
        return out

    def put_many(self, kind: str, items: dict[str, bytes]) -> None:
        if not items:
            return
        with self._lock:
            self._db.executemany(
                "INSERT OR REPLACE INTO memo (k, v) VALUES (?, ?)",
                [(_key(kind, t), v) for t, v in items.items()],
            )
            self._db.commit()


@functools.cache
def _open(path: str) -> Memo | None:
    try:
        return Memo(Path(path))
    except (OSError, sqlite3.Error):
        return None


def memo() -> Memo | None:
    """The memo named by KAPC_FRONTEND_MEMO, or None when it is unset or cannot be opened."""
    path = settings.frontend_memo()
    return _open(path) if path else None


def get_many(kind: str, texts: list[str]) -> dict[str, bytes]:
    m = memo()
    if m is None or not texts:
        return {}
    try:
        return m.get_many(kind, texts)
    except sqlite3.Error:
        return {}


def put_many(kind: str, items: dict[str, bytes]) -> None:
    m = memo()
    if m is None:
        return
    try:
        m.put_many(kind, items)
    except sqlite3.Error:
        pass
