#!/usr/bin/env python3
"""Reading a binary trace (issue 42, item 5): `kprewrite trace --format graph` (output
to /dev/null) and `kprewrite report` on the binary trace of a real server under load.

    python3 benchmarks/trace_read.py [--runs N] [--compare TREE] [--rounds R] [--trace FILE]

The trace: Debian's memcached (4 worker threads) rewritten with `[[function_graph]]
symbol_name = "*"` and KPREWRITE_TRACE_FORMAT=binary, under tests/test_server_load.py's
load generator (16 clients, R rounds of 1 set + 2 gets each; every reply checked), then
stopped with SIGTERM.  It is made once per --rounds and kept in ~/.cache/kprewrite/bench
(--trace FILE reads a given trace instead); its size and its report's CALLS line are printed.

Each round runs every command of every tree (this checkout, then each --compare TREE; in
reverse order every other round) as a user runs it: `python -m rewriter ...` with the
tree on PYTHONPATH, standard output to a file in the first round (the trees' outputs
must be the same bytes) and to /dev/null after.  A run's wall time, CPU time (user + sys)
and peak RSS (ru_maxrss; both from os.wait4's rusage of that run's process) are recorded; the table gives
medians with their ranges, and each tree's median over the last tree's."""
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
CACHE = Path(os.environ.get("KPREWRITE_BENCH_CACHE", Path.home() / ".cache" / "kprewrite" / "bench"))


def make_trace(rounds: int) -> Path:
    """memcached's function_graph binary trace under the load, made once per rounds."""
    out = CACHE / f"memcached-graph-{rounds}.trace"
    if out.exists():
        return out
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    import test_server_load as T                      # noqa: E402
    from conftest import cc, instrument, write_spec    # noqa: E402
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kprewrite-traceread-"))
    prog = tmp / "memcached"
    prog.write_bytes(T._memcached().read_bytes())
    prog.chmod(0o755)
    load = cc(tmp, "load", T.LOAD.read_text(), "-O2", "-pthread")
    kp = instrument(prog, write_spec(tmp, T.SPECS["function_graph"][0]), tmp / "memcached.kp")
    part = out.with_suffix(".part")
    part.unlink(missing_ok=True)
    got = T.serve(kp, load, T.CLIENTS, rounds, T.GETS,
                  {"KPREWRITE_TRACE": str(part), "KPREWRITE_TRACE_FORMAT": "binary"})
    assert got["status"] == 0, got["stderr"]
    part.rename(out)
    return out


def timed(tree: Path, args: list[str], out: Path) -> tuple[float, float, float]:
    """(wall seconds, peak RSS in MiB, CPU seconds) of `python -m rewriter ARGS` from tree,
    stdout to out."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with open(out, "wb") as f:
        t = time.monotonic()
        p = subprocess.Popen([sys.executable, "-m", "rewriter", *args], env=env, cwd=tree, stdout=f,
                             stderr=subprocess.PIPE)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.monotonic() - t
    err = p.stderr.read().decode(errors="replace")
    p.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{tree}: {' '.join(args)} failed: {err.strip()[-300:]}")
    return wall, ru.ru_maxrss / 1024, ru.ru_utime + ru.ru_stime


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--compare", action="append", default=[], metavar="TREE")
    ap.add_argument("--rounds", type=int, default=1350, help="the load's rounds per client (default 1350: a 92 MB trace)")
    ap.add_argument("--trace", type=Path, help="read this binary trace instead of making one")
    args = ap.parse_args()
    trace = args.trace or make_trace(args.rounds)
    print(f"trace: {trace} ({trace.stat().st_size / 1e6:.1f} MB)", flush=True)
    trees = [ROOT] + [Path(t).resolve() for t in args.compare]
    cmds = {"trace --format graph": ["trace", str(trace), "--format", "graph"],
            "report": ["report", str(trace)]}
    tmp = Path(tempfile.mkdtemp(prefix="kprewrite-traceread-out-"))
    res = {(t, c): [] for t in trees for c in cmds}
    for r in range(args.runs):
        order = trees if r % 2 == 0 else trees[::-1]
        load = os.getloadavg()[0]
        for c, a in cmds.items():
            digests = set()
            for i, t in enumerate(order):
                out = tmp / f"{i}.out" if r == 0 else Path(os.devnull)
                res[(t, c)].append(timed(t, a, out))
                if r == 0:
                    digests.add(digest(out))
                    if c == "report" and t == ROOT:
                        calls = next((ln for ln in out.read_text().splitlines() if ln.startswith("CALLS:")), "")
                        print(f"  {calls}", flush=True)
                    out.unlink()
            if r == 0 and len(digests) > 1:
                sys.exit(f"{c}: the trees print different text")
        print(f"round {r + 1} (load {load:.2f}): " + "; ".join(
            f"{t.name} {c} {res[(t, c)][-1][0]:.1f} s" for t in order for c in cmds), flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    print("| command | tree | wall, median (range) | CPU, median | peak RSS, median | vs " + trees[-1].name
          + " (wall) |")
    print("|---|---|---|---|---|---|")
    for c in cmds:
        base = statistics.median(w for w, _, _ in res[(trees[-1], c)])
        for t in trees:
            ws = [w for w, _, _ in res[(t, c)]]
            rss = statistics.median(m for _, m, _ in res[(t, c)])
            cpu = statistics.median(u for _, _, u in res[(t, c)])
            med = statistics.median(ws)
            print(f"| `{c}` | {t.name} | {med:.1f} s ({min(ws):.1f}–{max(ws):.1f}) | {cpu:.1f} s | {rss:.0f} MiB "
                  f"| {med / base:.3f}× |")


if __name__ == "__main__":
    main()
