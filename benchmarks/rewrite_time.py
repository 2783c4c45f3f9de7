#!/usr/bin/env python3
"""Rewrite time: `kprewrite instrument` with a probe on every function entry of a
library (by default Debian's libpython3.11), or on every ftrace-site entry of
Debian's kernel (--kernel), the median of --runs runs in each cache state.

    python3 benchmarks/rewrite_time.py [--runs N] [--compare TREE] [--modes M,...] [LIBRARY]
    python3 benchmarks/rewrite_time.py --kernel [--runs N] [--compare TREE] [--modes M,...]

Each run is the whole command (`python -m rewriter instrument INPUT --spec SPEC -o
OUT`), as a user runs it: the interpreter's start, the imports, the pipeline, gcc
and ld.  The library's spec is `[[kprobe]] symbol_name = "*"`; the kernel's is
benchmarks/kernel_entries.py's, an empty C pre_handler on each of the 37,070
ftrace-site entries `check` lists.  Each run's wall time and CPU time (user +
sys of the command and its children: gcc, ld, the decoding workers; os.wait4)
are printed with the load average before it, then the medians per state.

The states of kprewrite's cache ($KPREWRITE_CACHE, one folder per tree, filled
by an untimed first run):
  empty   nothing cached: the runtime is compiled, the image analysed, the
          table compiled and linked (the first rewrite on a new machine);
  cold    only the compiled runtime cached: the first rewrite of this image;
  warm    everything the first run left (the image's analysis, the linked
          table): the same image rewritten again.
The interpreter reads its bytecode from a folder of the run's own
(PYTHONPYCACHEPREFIX; PYTHONDONTWRITEBYTECODE is dropped), as an installed
package's is, filled by the untimed run.  Every run's output must be the same
bytes.  --compare TREE (repeatable) times another checkout's rewriter in the
same rounds, the trees in turn (in reverse order every other round), and says
whether their outputs are the same bytes."""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = Path("/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0")
MODES = ("empty", "cold", "warm")


def timed(cmd: list[str], env: dict, log: Path) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of the command and its children, exit status); its
    standard error goes to `log`.  It runs in log's folder: `python -m` puts the
    current folder first on sys.path, before PYTHONPATH's tree."""
    with open(log, "wb") as err:
        t = time.monotonic()
        p = subprocess.Popen(cmd, env=env, cwd=log.parent, stdout=subprocess.DEVNULL, stderr=err)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.monotonic() - t
    p.returncode = os.waitstatus_to_exitcode(status)
    return wall, ru.ru_utime + ru.ru_stime, p.returncode


def kernel_input(d: Path) -> tuple[Path, Path]:
    """Debian's vmlinux and a spec with an empty C pre_handler on every ftrace-site entry
    (kernel_entries.py's), written in d."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernel_entries as ke
    k = ke.kernel_env.obtain_kernel()
    names = ke.ftrace_entries(k.vmlinux, d)
    (d / "h.c").write_text(ke.HANDLER)
    spec = d / "p.toml"
    spec.write_text('handlers = ["h.c"]\n' + "".join(f'[[kprobe]]\n{e}\npre_handler = "pre"\n' for e in names))
    print(f"kernel {k.release}: {len(names)} ftrace-site entries", flush=True)
    return k.vmlinux, spec


def cache_for(mode: str, filled: Path, scratch: Path) -> Path:
    """The KPREWRITE_CACHE folder of a run in `mode`: `filled` (the untimed run's) for
    warm, else a new folder, holding the compiled runtime for cold."""
    if mode == "warm":
        return filled
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir()
    if mode == "cold":
        for e in filled.glob("runtime-*"):
            shutil.copytree(e, scratch / e.name, symlinks=True)
    return scratch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("library", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--kernel", action="store_true", help="Debian's kernel, every ftrace-site entry")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help=f"cache states to time, of {', '.join(MODES)}")
    ap.add_argument("--compare", action="append", default=[], type=Path, metavar="TREE",
                    help="also time the rewriter of another checkout")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        print(f"rewrite_time.py: --modes: each of {', '.join(MODES)}", file=sys.stderr)
        return 1
    if not a.kernel and not a.library.exists():
        print(f"rewrite_time.py: {a.library}: no such file", file=sys.stderr)
        return 1
    trees = [ROOT] + [t.resolve() for t in a.compare]
    with tempfile.TemporaryDirectory(prefix="kp-rewrite-time-") as tmp:
        d = Path(tmp)
        if a.kernel:
            image, spec = kernel_input(d)
        else:
            image, spec = a.library, d / "all.toml"
            spec.write_text('[[kprobe]]\nsymbol_name = "*"\n')
        sides = {}
        for i, tree in enumerate(trees):
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "KPREWRITE_CACHE")}
            env.update(PYTHONPATH=str(tree), PYTHONPYCACHEPREFIX=str(d / f"pyc{i}"))
            (d / f"cache{i}").mkdir()
            sides[str(tree)] = ([sys.executable, "-m", "rewriter", "instrument", str(image), "--spec", str(spec),
                                 "-o", str(d / f"out{i}")], env, d / f"out{i}", d / f"cache{i}", d / f"scratch{i}")
        sums = {k: set() for k in sides}
        for k, (cmd, env, out, filled, _) in sides.items():          # fills the cache and the bytecode
            wall, cpu, rc = timed(cmd, {**env, "KPREWRITE_CACHE": str(filled)}, d / "stderr")
            if rc != 0:
                print(f"{k}: exit status {rc}: {' '.join(cmd)}\n{(d / 'stderr').read_text()}", file=sys.stderr)
                return 1
            sums[k].add(hashlib.sha256(out.read_bytes()).hexdigest())
            print(f"untimed first run {k}: {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
        walls = {(k, m): [] for k in sides for m in modes}
        cpus = {(k, m): [] for k in sides for m in modes}
        loads = {(k, m): [] for k in sides for m in modes}
        for r in range(a.runs):
            for m in modes:
                for k in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                    cmd, env, out, filled, scratch = sides[k]
                    cache = cache_for(m, filled, scratch)
                    load = open("/proc/loadavg").read().split()[0]
                    wall, cpu, rc = timed(cmd, {**env, "KPREWRITE_CACHE": str(cache)}, d / "stderr")
                    if rc != 0:
                        print(f"{k}: exit status {rc}: {' '.join(cmd)}\n{(d / 'stderr').read_text()}", file=sys.stderr)
                        return 1
                    sums[k].add(hashlib.sha256(out.read_bytes()).hexdigest())
                    walls[k, m].append(wall)
                    cpus[k, m].append(cpu)
                    loads[k, m].append(float(load))
                    print(f"run {r + 1} {m} {k}: {wall:.2f} s wall, {cpu:.2f} s CPU (load {load})", flush=True)
        print(f"{Path(image).name}{' (every ftrace-site entry)' if a.kernel else ''}, {a.runs} runs, "
              f"{os.cpu_count()} CPUs:")
        for k in sides:
            for m in modes:
                w, c, l = walls[k, m], cpus[k, m], loads[k, m]
                print(f"  {k} {m}: median {statistics.median(w):.2f} s wall ({min(w):.2f}-{max(w):.2f}), "
                      f"{statistics.median(c):.2f} s CPU ({min(c):.2f}-{max(c):.2f}), load {min(l):.1f}-{max(l):.1f}")
        bad = [k for k in sides if len(sums[k]) != 1]
        if bad:
            print(f"outputs differ from run to run: {', '.join(bad)}", file=sys.stderr)
            return 1
        same = len({next(iter(sums[str(t)])) for t in trees}) == 1
        if len(trees) > 1:
            print(f"  outputs of the trees: {'the same bytes' if same else 'DIFFERENT'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
