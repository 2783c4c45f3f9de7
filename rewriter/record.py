"""`kprewrite record` and `kprewrite replay`: a rewrite, a run and a recording in one
step, as `uftrace record -- PROG ARGS` and `perf record` are; `replay` prints the
recording as `trace --format graph` (or `text`) does.

The rewrite goes into kprewrite's cache (cache.py), in the folder record/KEY/ as
PROG's own file name (so that the process's name, and the trace's COMM, is PROG's).
KEY is a hash of kprewrite's code, PROG's bytes and the probes as given (the spec
file's path, the options, --no-optimize, the folder handler paths are relative to);
beside the output, read.json holds the hash of every file the rewrite read (the spec,
the handlers and the headers they include, the runtime's sources: what --depfile
lists), and an entry whose files changed is made again.  So a second `record` of the
same program and probes starts the program at once.  A cache folder that cannot be
used (cache.trusted()) gives a rewrite in a temporary folder, deleted after the run.

The run: PROG with ARGS, argv[0] as given, standard input, output and error its own,
and KPREWRITE_TRACE=FILE KPREWRITE_TRACE_FORMAT=binary added to its environment, so
that its hits store binary records in FILE (docs/events.md#binary-records-...).  An
existing FILE is renamed FILE.old first, as perf does with perf.data.  The exit status
of `record` is the program's (128 + N for a program killed by signal N)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from .errors import KprewriteError, file_error

DEFAULT_FILE = "kprewrite.data"
KIND = "record"
DEFAULT_GRAPH = "*"         # no probes given: a call graph of every function, as uftrace record


def _sha(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def find_program(prog: str) -> str:
    """PROG as a shell finds it: a path if it has a slash, else on PATH."""
    if "/" in prog:
        path = prog
    else:
        path = shutil.which(prog)
        if path is None:
            raise KprewriteError(f"{prog}: not found on PATH")
    if os.path.isdir(path):
        raise KprewriteError(f"{prog}: is a directory")
    if not os.path.exists(path):
        raise KprewriteError(f"{prog}: no such file")
    return path


def _key(path: str, spec, options: dict, optimize: bool) -> str:
    from . import cache
    doc = {"spec": os.path.abspath(spec) if spec else None, "options": {k: list(v) for k, v in options.items()},
           "optimize": optimize, "cwd": os.getcwd()}
    return cache.key(b"record-1", cache.code_version(), (_sha(path) or "").encode(),
                     json.dumps(doc, sort_keys=True).encode())


def _valid(entry: Path, name: str) -> bool:
    try:
        read = json.loads((entry / "read.json").read_text())
    except (OSError, ValueError):
        return False
    return (entry / name).is_file() and all(_sha(p) == h for p, h in read["files"])


def rewrite(prog: str, spec, options: dict, *, optimize: bool = True, progress: bool = False,
            verbose: bool = False) -> tuple[Path, Path | None, bool]:
    """(the rewritten program, a temporary folder to delete after the run or None, whether it
    came from the cache)."""
    from . import api, cache
    path = find_program(prog)
    name = os.path.basename(path)
    if not any(options.values()) and spec is None:
        options = {**options, "graphs": [DEFAULT_GRAPH]}
    k = _key(path, spec, options, optimize)
    use_cache = cache.trusted(KIND)
    root = cache.cache_dir() / KIND
    entry = root / k
    if use_cache and _valid(entry, name):
        os.utime(entry)             # used now: the last to be pruned
        return entry / name, None, True
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-" if use_cache else "kprewrite-record-",
                                dir=root if use_cache else None))
    try:
        r = api.instrument(path, spec, tmp / name, optimize=optimize, progress=progress, **options)
        if verbose:
            for line in r.skipped_lines:
                print(f"kprewrite: {line}", file=sys.stderr)
        files = sorted(set(r.deps))
        (tmp / "read.json").write_text(json.dumps({"files": [[p, _sha(p)] for p in files]}, indent=0))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not use_cache:
        return tmp / name, tmp, False
    shutil.rmtree(entry, ignore_errors=True)
    try:
        os.rename(tmp, entry)
    except OSError:                 # another record made it meanwhile: use ours, once
        return tmp / name, tmp, False
    cache.prune(root.iterdir())
    return entry / name, None, False


def run(exe: Path, argv: list[str], output: str) -> int:
    """Run exe as argv (argv[0] as given) with binary records going to output; its status."""
    out = os.path.abspath(output)
    d = os.path.dirname(out)
    if os.path.isdir(out):
        raise file_error(output, IsADirectoryError())
    if not os.path.isdir(d):
        raise file_error(output, FileNotFoundError(), write=True)
    if os.path.lexists(out):
        os.replace(out, out + ".old")
    env = {**os.environ, "KPREWRITE_TRACE": out, "KPREWRITE_TRACE_FORMAT": "binary"}
    # The terminal's ^C and ^\ go to the program (our process group's); we wait for its end.
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGQUIT)}
    try:
        p = subprocess.Popen(argv, executable=str(exe), env=env,
                             preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in old])
        status = p.wait()
    except OSError as e:
        raise KprewriteError(f"{argv[0]}: cannot run: {(e.strerror or str(e)).lower()}") from None
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 - status if status < 0 else status
