#!/usr/bin/env python3
"""Rewrite time: `kprewrite instrument` with a probe on every function entry of a
library (by default Debian's libpython3.11), the median of --runs runs.

    python3 benchmarks/rewrite_time.py [--runs N] [--compare TREE] [LIBRARY]

Each run is the whole command (`python -m rewriter instrument LIBRARY --spec
all.toml -o OUT`, the spec `[[kprobe]] symbol_name = "*"`), as a user runs it:
the interpreter's start, the imports, the pipeline, the probe table's gcc and
the link.  Its wall time and its CPU time (user + sys of the command and its
children, os.wait4) are printed with the load average before it, then the
medians.  The compiled runtime comes from kprewrite's cache (the first run
fills it).  Every run's output must be the same bytes.  --compare TREE
(repeatable) times another checkout's rewriter in the same rounds, the trees
in turn (in reverse order every other round), and says whether their outputs
are the same bytes."""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = Path("/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0")


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("library", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--compare", action="append", default=[], type=Path, metavar="TREE",
                    help="also time the rewriter of another checkout")
    a = ap.parse_args()
    if not a.library.exists():
        print(f"rewrite_time.py: {a.library}: no such file", file=sys.stderr)
        return 1
    trees = [ROOT] + [t.resolve() for t in a.compare]
    with tempfile.TemporaryDirectory(prefix="kp-rewrite-time-") as tmp:
        d = Path(tmp)
        spec = d / "all.toml"
        spec.write_text('[[kprobe]]\nsymbol_name = "*"\n')
        sides = {}
        for i, tree in enumerate(trees):
            env = {**os.environ, "PYTHONPATH": str(tree)}
            sides[str(tree)] = ([sys.executable, "-m", "rewriter", "instrument", str(a.library), "--spec", str(spec),
                                 "-o", str(d / f"out{i}")], env, d / f"out{i}")
        walls = {k: [] for k in sides}
        cpus = {k: [] for k in sides}
        sums = {k: set() for k in sides}
        for r in range(a.runs):
            for k in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                cmd, env, out = sides[k]
                load = open("/proc/loadavg").read().split()[0]
                wall, cpu, rc = timed(cmd, env, d / "stderr")
                if rc != 0:
                    print(f"{k}: exit status {rc}: {' '.join(cmd)}\n{(d / 'stderr').read_text()}", file=sys.stderr)
                    return 1
                sums[k].add(hashlib.sha256(out.read_bytes()).hexdigest())
                walls[k].append(wall)
                cpus[k].append(cpu)
                print(f"run {r + 1} {k}: {wall:.2f} s wall, {cpu:.2f} s CPU (load {load})", flush=True)
        print(f"{a.library.name}, {a.runs} runs, {os.cpu_count()} CPUs:")
        for k in sides:
            print(f"  {k}: median {statistics.median(walls[k]):.2f} s wall "
                  f"({min(walls[k]):.2f}-{max(walls[k]):.2f}), {statistics.median(cpus[k]):.2f} s CPU")
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
