"""kprewrite's cache of derived data that is costly and never changes for the same
inputs (the jump targets of a whole kernel image, the compiled runtime): keyed by
a hash of everything it depends on, written atomically, safe to delete.

Where: $KPREWRITE_CACHE, else $XDG_CACHE_HOME/kprewrite, else ~/.cache/kprewrite.
A cache that cannot be written is simply not used."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

VERSION = b"kprewrite-cache-1"


def cache_dir() -> Path:
    d = os.environ.get("KPREWRITE_CACHE")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kprewrite"


def key(*parts: bytes) -> str:
    h = hashlib.sha256(VERSION)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


def get(kind: str, k: str) -> bytes | None:
    try:
        return (cache_dir() / kind / k).read_bytes()
    except OSError:
        return None


def put(kind: str, k: str, data: bytes) -> None:
    d = cache_dir() / kind
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, d / k)
    except OSError:
        pass
