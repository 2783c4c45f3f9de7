"""kprewrite's cache of derived data that is costly and never changes for the same
inputs (the jump targets of a whole kernel image, the compiled runtime): keyed by
a hash of everything it depends on, written atomically, safe to delete.

Where: $KPREWRITE_CACHE, else $XDG_CACHE_HOME/kprewrite, else ~/.cache/kprewrite.
A cache that cannot be written is simply not used.  Each kind keeps its KEEP most
recently used entries: an entry is touched when read, and the oldest beyond that
are deleted when a new one is written (a runtime edited often, or many images
analysed, would otherwise grow the folder without end)."""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

VERSION = b"kprewrite-cache-1"
# Entries kept per kind: a kernel's jump targets are some 8 MB, a compiled runtime 0.3 MB.
KEEP = 16


def cache_dir() -> Path:
    d = os.environ.get("KPREWRITE_CACHE")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kprewrite"


_CODE = None


def code_version() -> bytes:
    """A hash of kprewrite's own Python sources: an entry derived by this code (an
    image's analysis) is keyed by it, so that an edited rewriter never reads what
    another version derived."""
    global _CODE
    if _CODE is None:
        root = Path(__file__).resolve().parent
        h = hashlib.sha256()
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root).as_posix().encode()
            data = f.read_bytes()
            h.update(len(rel).to_bytes(8, "little") + rel + len(data).to_bytes(8, "little") + data)
        _CODE = h.digest()
    return _CODE


def key(*parts: bytes) -> str:
    h = hashlib.sha256(VERSION)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


def get(kind: str, k: str) -> bytes | None:
    f = cache_dir() / kind / k
    try:
        data = f.read_bytes()
        os.utime(f)             # used now: the last to be evicted
        return data
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
        return
    prune(d.iterdir())


def prune(entries, keep: int = KEEP) -> None:
    """Delete all but the `keep` most recently used of `entries` (files or folders;
    names starting with "." are another process's entries being written)."""
    aged = []
    for e in entries:
        if e.name.startswith("."):
            continue
        try:
            aged.append((e.stat().st_mtime, e.name, e))
        except OSError:
            pass
    for _, _, e in sorted(aged, reverse=True)[keep:]:
        try:
            shutil.rmtree(e) if e.is_dir() else e.unlink()
        except OSError:
            pass
