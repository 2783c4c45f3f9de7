"""kprewrite's cache of derived data that is costly and never changes for the same
inputs (the jump targets of a whole kernel image, the compiled runtime): keyed by
a hash of everything it depends on, written atomically, safe to delete.

Where: $KPREWRITE_CACHE, else $XDG_CACHE_HOME/kprewrite, else ~/.cache/kprewrite when
the home folder exists (kprewrite never makes the user's home), else
kprewrite-cache-<uid> in the temporary folder ($TMPDIR, /tmp).
A cache that cannot be written is simply not used.  Each kind keeps its KEEP most
recently used entries: an entry is touched when read, and the oldest beyond that
are deleted when a new one is written (a runtime edited often, or many images
analysed, would otherwise grow the folder without end).

A folder that is not this user's, or that others may write to, is not used at all
(trusted()): entries are unpickled and the compiled runtime is linked into every
output, so whoever may write there could choose code that kprewrite runs or writes
into an image (ssh refuses a ~/.ssh others can write for the same reason).  New
folders are made private (0700)."""
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
    base = os.environ.get("XDG_CACHE_HOME")
    if base:
        return Path(base) / "kprewrite"
    home = os.path.expanduser("~")
    if os.path.isdir(home):
        return Path(home) / ".cache" / "kprewrite"
    return _fallback()


def _fallback() -> Path:
    """The cache when there is no home folder to hold it (HOME names a missing folder:
    a service account, a build sandbox): one of this user's own in the temporary folder."""
    return Path(tempfile.gettempdir()) / f"kprewrite-cache-{os.geteuid()}"


def _private(p: Path) -> bool:
    """p is a folder of this user's that no one else may write to."""
    try:
        st = os.stat(p)
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def trusted(kind: str | None = None) -> bool:
    """The cache folder (and the kind's folder in it) may be read and written: this user's
    and private (made so when missing)."""
    root = cache_dir()
    try:
        if root == _fallback():
            # In a folder everyone may write: made here, never followed through a link
            # (another user's symbolic link there would choose where entries go).
            root.mkdir(mode=0o700, exist_ok=True)
            if os.path.islink(root):
                return False
        else:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if kind:
            (root / kind).mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return False
    return _private(root) and (not kind or _private(root / kind))


_CODE = None


def code_version() -> bytes:
    """A hash of kprewrite's own Python sources and of the version of Capstone, whose
    decoded functions an image's analysis holds: an entry derived by this code is keyed
    by it, so that an edited rewriter (or another Capstone) never reads what another
    version derived."""
    global _CODE
    if _CODE is None:
        import capstone         # (imported already by every arch's decoder)
        root = Path(__file__).resolve().parent
        h = hashlib.sha256(f"capstone {capstone.__version__}\0".encode())
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
    if not trusted(kind):
        return None
    f = cache_dir() / kind / k
    try:
        data = f.read_bytes()
        os.utime(f)             # used now: the last to be evicted
        return data
    except OSError:
        return None


def put(kind: str, k: str, data: bytes) -> None:
    d = cache_dir() / kind
    if not trusted(kind):
        return
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, d / k)
    except OSError:             # a full disk: no half entry left behind (prune() skips dot-files)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
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
