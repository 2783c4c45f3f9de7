"""A call graph of every function: uftrace against kprewrite (the anchor users know).

    python3 benchmarks/callgraph_uftrace.py [--runs N] [--n N] [--compare TREE] [--verbose]

One CPU-bound C program (recursive fib over a small mixing function, and a loop
calling the same function), built twice with gcc -O2: plainly, and with -pg for
uftrace.  Six variants run in each round, in an order that rotates from round
to round: the plain build (the baseline), the -pg build alone (what -pg's mcount
calls cost by themselves), `uftrace record` of the -pg build (Debian's uftrace),
and the plain build rewritten by kprewrite with `[[function_graph]] symbol_name =
"*"` (a kprobe and a kretprobe with a trace line on every function), tracing to
a file (KPREWRITE_TRACE): one write(2) a line, with lines gathered
(KPREWRITE_TRACE_BUFFER=1), and binary records into the file mapped shared
(KPREWRITE_TRACE_FORMAT=binary), formatted only when read, as uftrace's are.
Every run's output must equal the baseline's.

A run's time is its wall time from spawn to reap, and its CPU time (user + sys
of the child and the children it reaped, os.wait4's rusage: uftrace's recorder
threads included).  The headline is paired: each round's variant time over the
baseline's of the same round, the median of those ratios (with the range), and
the cost per call: (variant - baseline) / calls, of the wall time and of the CPU time
(the machine's other load lengthens the first more), the calls counted from
kprewrite's trace (its entry and return lines paired by rewriter/trace/callgraph.py).
Before the rounds, the graphs are compared: the calls per function of `uftrace
report` against `kprewrite report`'s (of the text trace; the binary trace's must
be the same).  The load average is printed before and
after: the machine may be shared.

--compare TREE: a seventh variant, the plain build rewritten by TREE's kprewrite (another
checkout, e.g. a worktree of main) with binary records, in the same rounds: a change to
the runtime measured against what it changes, under the same load."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KPREWRITE = [sys.executable, "-m", "rewriter"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) unsigned long mix(unsigned long x)
{
    for (int i = 0; i < 40; i++)
        x = x * 6364136223846793005UL + 1442695040888963407UL;
    return x;
}
__attribute__((noinline)) unsigned long fib(int n) { return n < 2 ? mix(n) & 1 : fib(n - 1) + fib(n - 2); }
__attribute__((noinline)) unsigned long sum(int n)
{
    unsigned long s = 0;
    for (int i = 0; i < n; i++)
        s += mix(i);
    return s;
}
int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 20;
    unsigned long r = 0;
    for (int k = 0; k < 4; k++)
        r += fib(n) + sum(20000);
    printf("%lu\n", r);
    return 0;
}
"""
SPEC = '[[function_graph]]\nsymbol_name = "*"\n'


def sh(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))}: {r.stderr.strip()}")
    return r


def timed(cmd, env=None, cwd=None) -> tuple[float, float, str]:
    """(wall s, CPU s of the child and its reaped children, stdout)."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))}: exit {p.returncode}")
    return wall, ru.ru_utime + ru.ru_stime, out.decode()


def uftrace_calls(d: Path) -> dict[str, int]:
    """Calls per function from `uftrace report` (columns: total, self, calls, function)."""
    out = sh(["uftrace", "report", "-d", str(d), "--no-pager"]).stdout
    calls = {}
    for line in out.splitlines():
        parts = line.split()
        # "  1.234 us   0.567 us   10  func": value unit value unit calls name
        if len(parts) == 6 and parts[4].isdigit():
            calls[parts[5]] = int(parts[4])
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7, help="rounds (default 7)")
    ap.add_argument("--n", type=int, default=24, help="fib(N) (default 24: some 680,000 calls)")
    ap.add_argument("--compare", metavar="TREE", type=Path,
                    help="also the binary variant rewritten by TREE's kprewrite (a checkout), in the same rounds")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args()
    if not shutil.which("uftrace"):
        sys.exit("uftrace is not installed (Debian: apt-get install uftrace)")
    print(f"load average before: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}"
          f" ({os.cpu_count()} CPUs)")
    with tempfile.TemporaryDirectory(prefix="kp-cg-") as tmp:
        tmp = Path(tmp)
        (tmp / "prog.c").write_text(PROGRAM)
        plain, pg, ours = tmp / "prog", tmp / "prog.pg", tmp / "prog.kp"
        sh(["gcc", "-O2", str(tmp / "prog.c"), "-o", str(plain)])
        sh(["gcc", "-O2", "-pg", str(tmp / "prog.c"), "-o", str(pg)])
        (tmp / "graph.toml").write_text(SPEC)
        sh([*KPREWRITE, "instrument", str(plain), "--spec", str(tmp / "graph.toml"), "-o", str(ours), "-q"], env=ENV,
           cwd=ROOT)
        theirs = tmp / "prog.cmp.kp"
        if a.compare:
            sh([sys.executable, "-m", "rewriter", "instrument", str(plain), "--spec", str(tmp / "graph.toml"),
                "-o", str(theirs), "-q"], env={**os.environ, "PYTHONPATH": str(a.compare.resolve())},
               cwd=a.compare.resolve())     # not this tree's rewriter/ by `-m` from the current folder
            if theirs.read_bytes() == ours.read_bytes():
                print(f"note: {a.compare} rewrites the program to the same bytes as this tree")
        trace, btrace, udir = tmp / "trace.txt", tmp / "trace.bin", tmp / "uftrace.data"

        # The two graphs, once: calls per function.
        env = {**os.environ, "KPREWRITE_TRACE": str(trace)}
        benv = {**os.environ, "KPREWRITE_TRACE": str(btrace), "KPREWRITE_TRACE_FORMAT": "binary"}
        sh([str(ours), str(a.n)], env=env)
        sh([str(ours), str(a.n)], env=benv)
        rep = json.loads(sh([*KPREWRITE, "report", str(trace), "--format", "json"], env=ENV).stdout)["calls"]
        brep = json.loads(sh([*KPREWRITE, "report", str(btrace), "--format", "json"], env=ENV).stdout)["calls"]
        # by name: the report lists functions by total time, and sum()'s (its 80,000 calls of mix()
        # and the probes' cost around them) is near mix()'s, so a preemption may swap the two
        bcalls = sorted((f["function"], f["calls"]) for f in brep["functions"])
        tcalls = sorted((f["function"], f["calls"]) for f in rep["functions"])
        if bcalls != tcalls:
            sys.exit(f"the binary trace's calls differ from the text trace's: {bcalls} against {tcalls}"
                     f" (unfinished {brep['unfinished']}, {rep['unfinished']}; returns with no entry"
                     f" {brep['unmatched_returns']}, {rep['unmatched_returns']})")
        ours_calls = {f["function"]: f["calls"] for f in rep["functions"]}
        sh(["uftrace", "record", "-d", str(udir), str(pg), str(a.n)], cwd=tmp)   # -pg's gmon.out goes there
        uf_calls = uftrace_calls(udir)
        calls = rep["count"]
        lines = len(trace.read_text().splitlines())
        bsize = btrace.stat().st_blocks * 512      # allocated: the file is grown a window at a time
        print(f"calls traced: kprewrite {calls} ({lines} trace lines, {trace.stat().st_size / 1e6:.1f} MB; "
              f"binary {bsize / 1e6:.1f} MB allocated), "
              f"unfinished {rep['unfinished']}, returns with no entry {rep['unmatched_returns']}")
        usize = sum(f.stat().st_size for f in udir.glob("*.dat"))
        print(f"uftrace's records: {usize / 1e6:.1f} MB")
        print("calls per function (kprewrite / uftrace):",
              ", ".join(f"{f} {ours_calls.get(f, 0)}/{uf_calls.get(f, 0)}"
                        for f in sorted(set(ours_calls) | set(uf_calls))))

        def prep_ours():
            trace.unlink(missing_ok=True)

        def prep_ours_bin():
            btrace.unlink(missing_ok=True)

        def prep_uftrace():
            shutil.rmtree(udir, ignore_errors=True)

        variants = [
            ("plain", [str(plain), str(a.n)], None, None),
            ("-pg alone", [str(pg), str(a.n)], None, None),
            ("uftrace record (-pg)", ["uftrace", "record", "-d", str(udir), str(pg), str(a.n)], None, prep_uftrace),
            ("kprewrite [[function_graph]]", [str(ours), str(a.n)], env, prep_ours),
            ("  with KPREWRITE_TRACE_BUFFER=1", [str(ours), str(a.n)], {**env, "KPREWRITE_TRACE_BUFFER": "1"},
             prep_ours),
            ("  KPREWRITE_TRACE_FORMAT=binary", [str(ours), str(a.n)], {**benv, "KPREWRITE_TRACE_FORMAT": "binary"},
             prep_ours_bin),
        ]
        if a.compare:
            variants.append((f"  binary, {a.compare.name}'s", [str(theirs), str(a.n)], benv, prep_ours_bin))
        want = None
        res = {name: [] for name, *_ in variants}
        for rnd in range(a.runs):
            k = rnd % len(variants)
            for name, cmd, e, prep in variants[k:] + variants[:k]:
                if prep:
                    prep()
                wall, cpu, out = timed(cmd, e, cwd=tmp)
                if want is None:
                    want = out
                if out != want:
                    sys.exit(f"{name}: output differs: {out!r} != {want!r}")
                res[name].append((wall, cpu))
                if a.verbose:
                    print(f"  round {rnd} {name}: wall {wall:.3f} s, cpu {cpu:.3f} s")
    print(f"load average after: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    base = res["plain"]
    print()
    print(f"{'variant':<30} {'wall (median)':>14} {'ratio (range)':>22} {'CPU ratio':>10} {'ns/call':>9}"
          f" {'CPU ns/call':>12}")
    for name, *_ in variants:
        walls = [w for w, _ in res[name]]
        ratios = [w / b for (w, _), (b, _) in zip(res[name], base)]
        cratios = [c / max(b, 1e-6) for (_, c), (_, b) in zip(res[name], base)]
        per_call = statistics.median(w - b for (w, _), (b, _) in zip(res[name], base)) / calls * 1e9
        cpu_call = statistics.median(c - b for (_, c), (_, b) in zip(res[name], base)) / calls * 1e9
        print(f"{name:<30} {statistics.median(walls):>12.3f} s "
              f"{statistics.median(ratios):>8.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) "
              f"{statistics.median(cratios):>9.2f}x {per_call:>9.0f} {cpu_call:>12.0f}")


if __name__ == "__main__":
    main()
