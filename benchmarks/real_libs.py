"""Real libraries from Debian's packages with a probe on every function entry
(the optimizer's table), or with --kretprobe a kretprobe on every function:
how many entries are jump-optimized (and, for kretprobes, how each
return site is hooked), and how much slower a real workload runs.

    python3 benchmarks/real_libs.py [--runs N] [--scale [NAME=]K ...] [--cpu N] [--warmup N]
                                    [--verbose] [--compare TREE] [--kretprobe [--maxactive N] [--handler]]
                                    [NAME ...]
                                    (sqlite3 busybox crypto stdcxx lua python)

Each workload runs on the original and on the rewritten object (a library
through LD_LIBRARY_PATH, an executable itself: busybox, lua5.4); the outputs must
be equal.  Two are interpreters: Debian's lua5.4 (its VM is in the executable)
and the running Python's shared libpython (pyenv's), each sorting numbers with a
comparator or key written in the language.  The
probes carry no handler (they count hits).  Every binary first runs --warmup
times unmeasured (page cache, dynamic loader); then --runs rounds, each the
original and every variant one after the other, the original first in even
rounds and last in odd ones.  A run's CPU time is that child's own user + sys
(os.wait4's rusage), its wall time from spawn to reap; the time the hypervisor
stole from the VM over the rounds (/proc/stat) is printed with the load, and the
runs' involuntary context switches (rusage nivcsw: how often a run was made to
wait for its CPU, the sign of a contended round).

The headline is paired: each round's variant time divided by the original's of
the same round (adjacent runs share the machine's momentary state, so its drift
cancels), reported as the median of those ratios with their interquartile
range.  The medians of the times (and the best runs) are printed too, as
before, and the low end: the ratio of the two sides' lower quartiles and of
their best runs, and the median ratio of the quiet pairs (both runs within 10%
of their side's best).  This VM has slow spells of a second or more that no
in-guest counter shows (no steal, no preemption); they only add time, so when
the original's slowest run is over 10% above its best ("noisy round") the low
end is the steadier figure.  --scale K multiplies the workload's length (sqlite3's rows, busybox's
lines, the C++ program's strings, the hashed file named K times, the numbers the Lua
and Python scripts sort) so that a run
lasts long enough for the timer and start-up to vanish; NAME=K scales that
workload only (about a second each: --scale 4 --scale busybox=3 --scale
stdcxx=5 --scale crypto=30).  --cpu N pins every measured run to CPU N
(sched_setaffinity in the child), so that two cores in different states are
not mixed.  --compare TREE (repeatable) also rewrites the object with the
kprewrite of another source tree (another branch's checkout) and runs it in the
same rounds.  --kretprobe alone gives light kretprobes (no handler: no instance
is claimed, docs/kretprobes.md); --kretprobe --maxactive N gives each one a
pool of N instances, which is the instance form (claimed at each entry, freed
at each return hook; calls nested deeper than N in one function count in
nmissed).  --handler gives each kretprobe issue 42's return handler, which reads
regs (`nonzero += regs_return_value(regs) != 0`: the inlined hook builds struct
pt_regs).  The load average is printed before and after: the
machine may be shared."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import subprocess
import sysconfig
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KPREWRITE = [sys.executable, "-m", "rewriter"]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
LIBDIR = Path("/usr/lib/x86_64-linux-gnu")
WORKLOADS = ("sqlite3", "busybox", "crypto", "stdcxx", "lua", "python")
LUA = """local n = tonumber(arg[1])
local t = {}
math.randomseed(42)
for r = 1, 3 do
  for i = 1, n do t[i] = math.random(1, 1000000) end
  table.sort(t)
  table.sort(t, function(a, b) return a > b end)
end
print(t[1], t[n])
"""
PY = """import random, sys
n = int(sys.argv[1])
random.seed(42)
for r in range(3):
    t = [random.randint(1, 1000000) for i in range(n)]
    t.sort(key=lambda a: (a % 1000, a))
    t.sort(key=lambda a: -a)
print(t[0], t[-1])
"""
QUIET = 1.10        # a run within 10% of its side's best counts as undisturbed

SQL = """
CREATE TABLE t(a INTEGER PRIMARY KEY, b TEXT, c REAL);
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {rows})
INSERT INTO t SELECT i, printf('row %d %x', i, i * 7919), i * 0.5 FROM n;
CREATE INDEX tb ON t(b);
SELECT count(*), sum(c), max(b) FROM t WHERE b LIKE 'row 1%';
SELECT b FROM t ORDER BY b DESC LIMIT 3;
SELECT a % 10, count(*), avg(c) FROM t GROUP BY a % 10;
UPDATE t SET c = c * 2 WHERE a % 3 = 0;
SELECT sum(c) FROM t;
"""

CXX = r"""
#include <algorithm>
#include <iostream>
#include <map>
#include <string>
#include <vector>
#ifndef N
#define N 300000L
#endif
int main()
{
    std::vector<std::string> v;
    for (long i = 0; i < N; i++)
        v.push_back("item " + std::to_string(i * 7919 % 100003) + " " + std::to_string(i));
    std::sort(v.begin(), v.end());
    std::map<std::string, int> m;
    for (const std::string &x : v)
        m[x.substr(0, 7)]++;
    std::cout << v.front() << " | " << v.back() << " | " << m.size() << std::endl;
    return 0;
}
"""


# --handler: issue 42's return handler, which reads regs.
HANDLER_FILE = "bench_handler.c"
HANDLER = r"""
#include <kprewrite/kprobes.h>
unsigned long nonzero;
int kp_bench_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	nonzero += regs_return_value(regs) != 0;
	return 0;
}
"""


def check(obj: Path, spec: Path, tree: Path = ROOT) -> tuple[int, Counter, Counter]:
    """(probes, their decisions, the return sites by hook kind: `ret`/`tail` jump-hooked,
    `int3` breakpoint return hooks, `trampoline function` for functions whose returns
    the trampoline catches, `light function` for light kretprobes, whose exits (`light
    ret`/`light tail`) are left as they are)."""
    r = subprocess.run([*KPREWRITE, "check", str(obj), "--spec", str(spec), "--format", "json"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(tree)), cwd=tree)
    ps = json.loads(r.stdout)["probes"]
    hooks = Counter()
    for p in ps:
        ret = p.get("returns")
        if not ret:
            continue
        if ret["mode"] == "trampoline":
            hooks["trampoline function"] += 1
        if ret["mode"] == "light":
            hooks["light function"] += 1
        for site in ret["sites"]:
            # a light kretprobe's exits are left as they are: `light ret` / `light tail`
            hooks["int3" if site["int3"] else f"light {site['kind']}" if ret["mode"] == "light" else site["kind"]] += 1
    return len(ps), Counter(p["decision"] for p in ps), hooks


def timed(cmd, env, stdin: Path | None, out: Path, cpu: int | None) -> tuple[float, float, int, bytes]:
    """(wall seconds, user + sys seconds, involuntary context switches, stdout) of one run.

    The CPU time is this child's own rusage from wait4(), not a difference of
    RUSAGE_CHILDREN (which sums every reaped child).  stdin, stdout and stderr
    are files, so no thread of ours feeds or drains pipes while it runs."""
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    err = out.with_suffix(".err")
    with open(stdin or os.devnull, "rb") as fi, open(out, "wb") as fo, open(err, "wb") as fe:
        t = time.monotonic()
        p = subprocess.Popen(cmd, stdin=fi, stdout=fo, stderr=fe, env={**os.environ, **(env or {})},
                             preexec_fn=pin)
        _, status, ru = os.wait4(p.pid, 0)
        dt = time.monotonic() - t
    p.returncode = os.waitstatus_to_exitcode(status)     # reaped here, not by Popen
    if p.returncode:
        raise SystemExit(f"{cmd[0]}: exit {p.returncode}: {err.read_bytes()[-500:]!r}")
    return dt, ru.ru_utime + ru.ru_stime, ru.ru_nivcsw, out.read_bytes()


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def steal() -> float:
    """Seconds the hypervisor has kept this VM's vCPUs from running (/proc/stat's steal
    column, all CPUs): time a run waits for in wall time, and that noise can explain."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def iqr(xs: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile)."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def measure(name: str, tmp: Path, runs: int = 3, compare: list[Path] = (), scale: int = 1,
            cpu: int | None = None, warmup: int = 1, verbose: bool = False, kind: str = "kprobe",
            maxactive: int | None = None, handler: bool = False) -> None:
    spec = tmp / "all.toml"
    spec.write_text((f'handlers = ["{HANDLER_FILE}"]\n' if handler else "")
                    + f'[[{kind}]]\nsymbol_name = "*"\n' + (f"maxactive = {maxactive}\n" if maxactive else "")
                    + ('handler = "kp_bench_ret"\n' if handler else ""))
    if handler:
        (tmp / HANDLER_FILE).write_text(HANDLER)
    work = tmp / name
    work.mkdir()
    stdin = None
    if name == "sqlite3":
        stdin = work / "script.sql"
        stdin.write_text(SQL.format(rows=200000 * scale))
        obj, cmd, what = LIBDIR / "libsqlite3.so.0", ["sqlite3", ":memory:"], f"{200000 * scale} rows"
    elif name == "crypto":
        data = work / "data"
        data.write_bytes(os.urandom(1 << 20) * 48)
        # --scale hashes the same 48 MiB K times (named K times: K digests), not a K times larger file
        obj, cmd = LIBDIR / "libcrypto.so.3", ["openssl", "dgst", "-sha256", "-sha1", *[str(data)] * scale]
        what = f"{48 * scale} MiB"
    elif name == "stdcxx":
        src = work / "w.cc"
        src.write_text(CXX)
        subprocess.run(["g++", "-O2", f"-DN={300000 * scale}L", "-o", str(work / "w"), str(src)], check=True)
        obj, cmd, what = LIBDIR / "libstdc++.so.6", [str(work / "w")], f"{300000 * scale} strings"
    elif name == "busybox":
        lines = work / "lines"
        lines.write_text("".join(f"{i * 7919 % 100003} line {i:x}\n" for i in range(300000 * scale)))
        obj, cmd = Path("/bin/busybox"), ["/bin/busybox", "sort", "-n", str(lines)]
        what = f"{300000 * scale} lines"
    elif name == "lua":
        # An interpreter (Debian's lua5.4, its VM linked into the executable): table.sort with
        # a Lua comparator calls small C functions (lua_geti, lua_pushvalue...) ~300 M times.
        script = work / "sort.lua"
        script.write_text(LUA)
        obj, cmd = Path("/usr/bin/lua5.4"), ["/usr/bin/lua5.4", str(script), str(200000 * scale)]
        what = f"3 x 2 sorts of {200000 * scale} numbers"
    elif name == "python":
        # The interpreter running this script, when its libpython is shared (pyenv's is): the same
        # sorts as lua's, in Python, through LD_LIBRARY_PATH (a RUNPATH yields to it).
        so = sysconfig.get_config_var("INSTSONAME")
        if not sysconfig.get_config_var("Py_ENABLE_SHARED") or not so:
            print(f"python: skipped, {sys.executable}'s libpython is not a shared library", flush=True)
            return
        script = work / "sort.py"
        script.write_text(PY)
        obj = Path(sysconfig.get_config_var("LIBDIR")) / so
        cmd, what = [sys.executable, str(script), str(200000 * scale)], f"3 x 2 sorts of {200000 * scale} numbers"
    else:
        raise SystemExit(f"unknown workload {name}")
    n, decisions, hooks = check(obj, spec)
    trees = {"this": ROOT, **{f"{i + 1}:{t.name}": t for i, t in enumerate(compare)}}
    if kind == "kretprobe":
        for label, tree in trees.items():
            h = hooks if tree == ROOT else check(obj, spec, tree)[2]
            print(f"{name}: return sites of {label}: " + ", ".join(f"{k} {v}" for k, v in sorted(h.items())),
                  flush=True)
    variants = {"orig": (cmd, {}, None)}    # label -> (cmd, env, profile)
    rewrite = 0.0
    for label, tree in trees.items():
        d = work / label.replace(":", "-")
        d.mkdir()
        out = d / obj.name
        t = time.monotonic()
        subprocess.run([*KPREWRITE, "instrument", str(obj), "--spec", str(spec), "-o", str(out)],
                       check=True, env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True, cwd=tree)
        if tree == ROOT:
            rewrite = time.monotonic() - t
        env_new: dict = {"KPREWRITE_PROFILE": str(d / "profile")}
        cmd_new = cmd
        if cmd[0] == str(obj):                  # an executable (busybox, lua5.4): run the rewrite
            cmd_new = [str(out), *cmd[1:]]
        else:
            env_new["LD_LIBRARY_PATH"] = str(d)
        variants[label] = (cmd_new, env_new, d / "profile")
    labels = list(variants)
    out_file = work / "stdout"

    def run(label: str) -> tuple[float, float, int, bytes]:
        c, e, profile = variants[label]
        if profile:
            profile.unlink(missing_ok=True)      # the runtime appends: keep the last run's
        return timed(c, e, stdin, out_file, cpu)

    before, started = load(), time.strftime("%H:%M:%S", time.gmtime())
    expected = None
    for _ in range(warmup):                      # page cache, dynamic loader; outputs checked too
        for label in labels:
            o = run(label)[3]
            if expected is None:
                expected = o
            elif o != expected:
                raise SystemExit(f"{name}: output differs ({label}, warm-up)")
    wall = {k: [] for k in labels}
    cpus = {k: [] for k in labels}
    preempted = {k: [] for k in labels}      # involuntary context switches: the run was made to wait
    stolen = steal()
    for i in range(runs):
        round_stolen = steal()
        order = labels if i % 2 == 0 else labels[::-1]   # the original first, then last
        for label in order:
            tw, tc, nivcsw, o = run(label)
            if expected is None:
                expected = o
            elif o != expected:
                raise SystemExit(f"{name}: output differs ({label})")
            wall[label].append(tw)
            cpus[label].append(tc)
            preempted[label].append(nivcsw)
        if verbose:
            print(f"    round {i + 1:2} ({'orig first' if i % 2 == 0 else 'orig last '}): "
                  + "; ".join(f"{k} {wall[k][-1]:.3f}/{cpus[k][-1]:.3f} s/{preempted[k][-1]}" for k in labels)
                  + f"  (wall/user+sys/preempted); steal {steal() - round_stolen:.2f} s", flush=True)
    after, stolen = load(), steal() - stolen
    hits = {label: sum(int(l.split()[1]) for l in profile.read_text().splitlines()
                       if len(l.split()) == 3 and l.split()[1].isdigit())
            for label, (_, _, profile) in variants.items() if profile}
    med = statistics.median
    wa, ca = med(wall["orig"]), med(cpus["orig"])
    print(f"{name}: {obj} {n} {kind}s, optimized {decisions['optimized']} "
          f"({100 * decisions['optimized'] / n:.1f}%), int3 {decisions['int3']}, refused {decisions['refused']}; "
          f"rewrite {rewrite:.1f} s; {' '.join(cmd[:2])} ({what}, scale {scale}); {runs} paired rounds "
          f"after {warmup} warm-up, cpu {'any' if cpu is None else cpu}, {started} UTC, "
          f"load {before} -> {after}, host steal {stolen:.2f} s, involuntary switches a run (median) "
          + ", ".join(f"{k} {med(preempted[k]):.0f}" for k in labels) + ", output equal", flush=True)
    for label in labels[1:]:
        rc = [b / a for a, b in zip(cpus["orig"], cpus[label])]
        rw = [b / a for a, b in zip(wall["orig"], wall[label])]
        (c1, c2, c3), (w1, w2, w3) = iqr(rc), iqr(rw)
        print(f"  {label:12} paired: user+sys {c2:.3f}x (IQR {c1:.3f}-{c3:.3f}x), "
              f"wall {w2:.3f}x (IQR {w1:.3f}-{w3:.3f}x), medians of {runs} pair ratios", flush=True)
        # The VM's slow spells (the host's, with no steal and no preemption to show them) only
        # ever add time, to whichever run they overlap: the low end of each side is the least
        # disturbed, and a pair whose two runs are both near their side's best ran in quiet.
        lo_o, lo_b = iqr(cpus["orig"])[0], iqr(cpus[label])[0]
        quiet = [b / a for a, b in zip(cpus["orig"], cpus[label])
                 if a <= QUIET * min(cpus["orig"]) and b <= QUIET * min(cpus[label])]
        print(f"  {'':12} low end: user+sys lower quartiles {lo_o:.2f} s -> {lo_b:.2f} s ({lo_b / lo_o:.3f}x), "
              f"best {min(cpus['orig']):.2f} s -> {min(cpus[label]):.2f} s "
              f"({min(cpus[label]) / min(cpus['orig']):.3f}x); quiet pairs (both within "
              f"{100 * (QUIET - 1):.0f}% of their side's best): "
              + (f"{statistics.median(quiet):.3f}x over {len(quiet)}" if quiet else "none")
              + f"; the original's slowest run {max(cpus['orig']) / min(cpus['orig']):.2f}x its best"
              + (" (noisy round)" if max(cpus["orig"]) > QUIET * min(cpus["orig"]) else ""), flush=True)
        wb, cb = med(wall[label]), med(cpus[label])
        per_hit = lambda a, b: 1e9 * (b - a) / hits[label] if hits[label] else 0.0  # noqa: E731
        print(f"  {'':12} medians: wall {wa:.2f} s -> {wb:.2f} s ({wb / wa:.2f}x, {per_hit(wa, wb):.1f} ns/hit); "
              f"user+sys {ca:.2f} s -> {cb:.2f} s ({cb / ca:.2f}x, {per_hit(ca, cb):.1f} ns/hit); "
              f"{hits[label]} hits in the last run; best user+sys {min(cpus['orig']):.2f} s -> "
              f"{min(cpus[label]):.2f} s ({min(cpus[label]) / min(cpus['orig']):.2f}x); "
              f"original's user+sys {min(cpus['orig']):.2f}-{max(cpus['orig']):.2f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--runs", type=int, default=3, help="paired rounds (default 3)")
    ap.add_argument("--scale", action="append", default=[], metavar="[NAME=]K",
                    help="multiply the workload's length by K (default 1: 200,000 rows, 300,000 lines...); "
                         "NAME=K for one workload only (repeatable)")
    ap.add_argument("--cpu", type=int, default=None, help="pin every measured run to this CPU")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured runs of each binary first (default 1)")
    ap.add_argument("--verbose", "-v", action="store_true", help="print every round's times")
    ap.add_argument("--compare", type=Path, action="append", default=[],
                    help="another kprewrite source tree, run in the same rounds (repeatable)")
    ap.add_argument("--kretprobe", action="store_true",
                    help="a kretprobe on every function (no handlers) instead of a kprobe")
    ap.add_argument("--maxactive", type=int, default=None, metavar="N",
                    help="with --kretprobe: maxactive = N for each, the instance form (without: light)")
    ap.add_argument("--handler", action="store_true",
                    help="with --kretprobe: a return handler reading regs on each (nonzero += "
                         "regs_return_value(regs) != 0)")
    args = ap.parse_args()
    if args.maxactive is not None and (not args.kretprobe or args.maxactive < 1):
        raise SystemExit("--maxactive N needs --kretprobe and N >= 1")
    if args.handler and not args.kretprobe:
        raise SystemExit("--handler needs --kretprobe")
    scales: dict[str | None, int] = {None: 1}
    for a in args.scale:
        name, _, k = a.rpartition("=")
        if ("=" in a and name not in WORKLOADS) or not k.isdigit() or int(k) < 1:
            raise SystemExit(f"--scale {a}: expected K or NAME=K, K a positive integer, NAME one of "
                             f"{' '.join(WORKLOADS)}")
        scales[name or None] = int(k)
    if args.runs < 1 or args.warmup < 0:
        raise SystemExit("--runs must be at least 1, --warmup at least 0")
    if args.cpu is not None and args.cpu not in os.sched_getaffinity(0):
        raise SystemExit(f"--cpu {args.cpu}: not one of this process's CPUs "
                         f"{sorted(os.sched_getaffinity(0))}")
    for name in args.names:
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name} ({' '.join(WORKLOADS)})")
    tmp = Path(tempfile.mkdtemp(prefix="kp-real-"))
    try:
        for name in args.names:
            measure(name, tmp, args.runs, [t.resolve() for t in args.compare], scales.get(name, scales[None]),
                    args.cpu, args.warmup, args.verbose, "kretprobe" if args.kretprobe else "kprobe",
                    args.maxactive, args.handler)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
