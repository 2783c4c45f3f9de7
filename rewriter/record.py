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

Libraries (--lib LIB): each is rewritten too, into the entry's lib/ folder under the
name PROG loads it by, and that folder goes first on LD_LIBRARY_PATH.  A probe option
applies to each object (PROG, each LIB) that has a function its symbol names (or its
glob matches): `--graph 'z*' --lib libz.so.1` traces zlib's calls; a probe that applies
to none is an error naming them all.  A spec file's probes are PROG's.

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


def _key(path: str, spec, options: dict, optimize: bool, libs: list[str]) -> str:
    from . import cache
    doc = {"spec": os.path.abspath(spec) if spec else None, "options": {k: list(v) for k, v in options.items()},
           "optimize": optimize, "cwd": os.getcwd(), "libs": [[os.path.abspath(p), _sha(p)] for p in libs]}
    return cache.key(b"record-1", cache.code_version(), (_sha(path) or "").encode(),
                     json.dumps(doc, sort_keys=True).encode())


def _valid(entry: Path, name: str) -> bool:
    try:
        read = json.loads((entry / "read.json").read_text())
    except (OSError, ValueError):
        return False
    return (entry / name).exists() and all(_sha(p) == h for p, h in read["files"])


def find_library(prog: str, lib: str) -> tuple[str, str]:
    """(path, the name PROG loads it by) of LIB: a path (with a slash; its file name), or a
    name (its soname, or the start of it: libz, libz.so) of a library PROG loads, as ldd lists
    them."""
    if "/" in lib:
        if os.path.isdir(lib):
            raise KprewriteError(f"{lib}: is a directory")
        if not os.path.exists(lib):
            raise KprewriteError(f"{lib}: no such file")
        return lib, os.path.basename(lib)
    try:
        out = subprocess.run(["ldd", prog], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    found = []
    for line in out.splitlines():
        name, arrow, rest = line.strip().partition(" => ")
        path = rest.split(" (")[0].strip()
        if arrow and path.startswith("/") and (name == lib or name.startswith(lib + ".")):
            found.append((path, name))
    if not found:
        raise KprewriteError(f"--lib {lib}: {os.path.basename(prog)} loads no library of that name (ldd)")
    return found[0]


def _function_names(path: str) -> set[str]:
    from . import targets
    image = targets.load(path)
    image.target.load_symbols(image, None)
    return {n for f in image.functions for n in [f.name, *f.aliases]}


def _symbol_of(option: str, text: str) -> str:
    """The symbol (or glob) a probe option names."""
    import re
    words = text.split()
    if not words:
        return ""
    if option == "events":          # [pr][MAXACTIVE][:[GRP/]EVENT] SYM[+OFFS]|ADDR ...
        return re.split(r"[+:]", words[1], maxsplit=1)[0] if len(words) > 1 else ""
    if option == "probes":          # [EVENT=]FUNC[@SRC][:RLN|+OFFS|%return] ...
        w = words[0].split("=", 1)[-1]
        return re.split(r"[@:+%]", w, maxsplit=1)[0]
    return words[0].split("+", 1)[0]


def split_probes(objects: list[tuple[str, str]], options: dict) -> list[dict]:
    """The probe options of each object: those whose symbol the object has a function of
    (or whose glob matches one); an error for an option that names none's."""
    import fnmatch
    names = [_function_names(path) for path, _ in objects]
    per = [{k: [] for k in options} for _ in objects]
    errors = []
    for k, texts in options.items():
        if k == "handlers":
            continue
        for text in texts:
            sym = _symbol_of(k, text)
            if sym[:1].isdigit():       # an address: PROG's
                hits = [0]
            else:
                glob = any(c in sym for c in "*?[")
                hits = [i for i, n in enumerate(names)
                        if (any(fnmatch.fnmatchcase(x, sym) for x in n) if glob else sym in n)]
            if not hits:
                opt = {"kprobes": "--kprobe", "kretprobes": "--kretprobe", "graphs": "--graph",
                       "events": "--event", "probes": "--probe"}[k]
                errors.append(f"{opt} {text!r}: no function {sym!r} in "
                              f"{' or '.join(os.path.basename(n) for _, n in objects)}")
            for i in hits:
                per[i][k].append(text)
    if errors:
        raise KprewriteError(*errors)
    for p in per:
        if any(p.values()):
            p["handlers"] = list(options.get("handlers", ()))
    return per


def rewrite(prog: str, spec, options: dict, *, optimize: bool = True, progress: bool = False,
            verbose: bool = False, libs=()) -> tuple[Path, Path | None, bool, Path | None]:
    """(the program to run, a temporary folder to delete after the run or None, whether it
    came from the cache, the folder of rewritten libraries or None)."""
    from . import api, cache
    path = find_program(prog)
    name = os.path.basename(path)
    if not any(options.values()) and spec is None:
        options = {**options, "graphs": [DEFAULT_GRAPH]}
    found = [find_library(path, lib) for lib in libs]
    k = _key(path, spec, options, optimize, [p for p, _ in found])
    use_cache = cache.trusted(KIND)
    root = cache.cache_dir() / KIND
    entry = root / k
    if use_cache and _valid(entry, name):
        os.utime(entry)             # used now: the last to be pruned
        return entry / name, None, True, (entry / "lib" if found else None)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-" if use_cache else "kprewrite-record-",
                                dir=root if use_cache else None))
    try:
        per = split_probes([(path, name), *found], options) if found else [options]
        deps = []
        outs = [(path, tmp / name, per[0], spec)]
        if found:
            (tmp / "lib").mkdir()
            outs += [(p, tmp / "lib" / n, o, None) for (p, n), o in zip(found, per[1:])]
        for src, out, opts, sp in outs:
            if not any(opts.values()) and sp is None:
                if src == path:         # PROG itself has no probe: it runs as it is
                    os.symlink(os.path.abspath(path), out)
                    deps.append(path)
                continue
            r = api.instrument(src, sp, out, optimize=optimize, progress=progress, **opts)
            if verbose:
                for line in r.skipped_lines:
                    print(f"kprewrite: {os.path.basename(src)}: {line}", file=sys.stderr)
            deps += r.deps
        files = sorted(set(deps))
        (tmp / "read.json").write_text(json.dumps({"files": [[p, _sha(p)] for p in files]}, indent=0))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    lib_dir = "lib" if found else None
    if not use_cache:
        return tmp / name, tmp, False, (tmp / lib_dir if lib_dir else None)
    shutil.rmtree(entry, ignore_errors=True)
    try:
        os.rename(tmp, entry)
    except OSError:                 # another record made it meanwhile: use ours, once
        return tmp / name, tmp, False, (tmp / lib_dir if lib_dir else None)
    cache.prune(root.iterdir())
    return entry / name, None, False, (entry / lib_dir if lib_dir else None)


def check_output(output: str) -> str:
    """FILE's absolute path; an error if it cannot be written there (asked before the rewrite)."""
    out = os.path.abspath(output)
    if os.path.isdir(out):
        raise file_error(output, IsADirectoryError())
    if not os.path.isdir(os.path.dirname(out)):
        raise file_error(output, FileNotFoundError(), write=True)
    return out


def run(exe: Path, argv: list[str], output: str, lib_dir: Path | None = None) -> int:
    """Run exe as argv (argv[0] as given) with binary records going to output, lib_dir first
    on the library path; its status."""
    out = check_output(output)
    if os.path.lexists(out):
        os.replace(out, out + ".old")
    env = {**os.environ, "KPREWRITE_TRACE": out, "KPREWRITE_TRACE_FORMAT": "binary"}
    if lib_dir is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([str(lib_dir)] + [p for p in [os.environ.get("LD_LIBRARY_PATH")] if p])
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
