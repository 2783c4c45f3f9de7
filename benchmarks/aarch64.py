#!/usr/bin/env python3
"""AArch64 per-hit benchmarks under qemu-aarch64 (TCG on the x86-64 host): a
tight loop calling a trivial function, cross-built with aarch64-linux-gnu-gcc,
rewritten by this tree, run under `qemu-aarch64 -L <sysroot>`.

Rows (each against the uninstrumented binary of the same run; original and
rewritten interleaved, RUNS times each, medians):
  o  optimized kprobe (one B to a detour), empty pre_handler;
  b  breakpoint kprobe (--no-optimize: brk #0x004, SIGTRAP, the
     instruction stepped out of line or simulated), empty pre_handler;
  s  breakpoint kprobe on a PC-relative instruction (adr),
     which the SIGTRAP handler simulates (no second trap);
  r  kretprobe (every exit hooked, the return hooks jump-optimized), empty handler.
And the rewrite time of each (`kprewrite instrument`, wall clock).

--real: Debian 12's arm64 busybox (static) and libsqlite3 (loaded by Debian's arm64
sqlite3 shell) with a kprobe on every function entry (`symbol_name = "*"`, no handler:
light hits), each run paired with the original in the same round (the order flipped
every round), the median of the rounds' ratios of the child's user + sys time.  The
packages are fetched with `apt-get download` (dpkg --add-architecture arm64) into
$KPREWRITE_ARM64_CACHE, else ~/.cache/kprewrite/debian-arm64 (the cache
tests/test_aarch64_real_software.py fills, with the same layout).  --count: the
instructions each run executes instead (QEMU's -d in_asm,exec through a pipe: exact, and
the same under any load), one run each.

Run: python3 benchmarks/aarch64.py [--real [--rounds R] [--cpu CPU] [--also TREE] [--count]]
(BENCH_N, BENCH_N_TRAP, BENCH_RUNS to scale the loop rows)
"""
import argparse
import random
import resource
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KPREWRITE = [sys.executable, "-m", "rewriter"]
TREE_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
N = int(os.environ.get("BENCH_N", 5_000_000))
N_TRAP = int(os.environ.get("BENCH_N_TRAP", 20_000))
RUNS = int(os.environ.get("BENCH_RUNS", 5))
CC = "aarch64-linux-gnu-gcc"
SYSROOT = "/usr/aarch64-linux-gnu"

LOOP = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
__attribute__((noinline)) long target(long x) { __asm__ volatile("" : "+r"(x)); return x + 1; }
/* Row "s": its first instruction is an adr, which a breakpoint probe simulates. */
__asm__(".text\n.globl target_adr\n.type target_adr,%function\ntarget_adr:\n"
        "  adr x1, target_adr\n  add x0, x0, #1\n  ret\n.size target_adr,.-target_adr\n");
long target_adr(long x);
int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 1000000;
	struct timespec a, b;
	long s = 0;
	clock_gettime(CLOCK_MONOTONIC, &a);
	if (argc > 2)
		for (long i = 0; i < n; i++)
			s += target_adr(i);
	else
		for (long i = 0; i < n; i++)
			s += target(i);
	clock_gettime(CLOCK_MONOTONIC, &b);
	printf("%.3f %ld\n", (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec), s);
	return 0;
}
"""

HANDLERS = r"""
#include <kprewrite/kprobes.h>
int empty_pre(struct kprobe *p, struct pt_regs *regs) { return 0; }
int empty_ret(struct kretprobe_instance *ri, struct pt_regs *regs) { return 0; }
"""

SPECS = {
    "kprobe.toml": 'handlers = ["handlers.c"]\n[[kprobe]]\nsymbol_name = "target"\npre_handler = "empty_pre"\n',
    "adr.toml": 'handlers = ["handlers.c"]\n[[kprobe]]\nsymbol_name = "target_adr"\npre_handler = "empty_pre"\n',
    "return.toml": 'handlers = ["handlers.c"]\n[[kretprobe]]\nsymbol_name = "target"\nhandler = "empty_ret"\n',
}


def qemu() -> list[str]:
    q = shutil.which("qemu-aarch64")
    if not q or not shutil.which(CC):
        sys.exit("needs qemu-aarch64 and aarch64-linux-gnu-gcc (Debian: qemu-user, gcc-aarch64-linux-gnu)")
    return [q, "-L", SYSROOT]


def rewrite(exe: Path, spec: Path, out: Path, *extra: str, tree: str | None = None) -> tuple[Path, float]:
    """`kprewrite instrument` by this tree's rewriter (or another tree's); (output, wall seconds)."""
    env = TREE_ENV if tree is None else dict(os.environ, PYTHONPATH=tree)
    t = time.perf_counter()
    # cwd: out's folder, not a tree's (python3 -m would import the rewriter found there first).
    subprocess.run([*KPREWRITE, "instrument", str(exe), "--spec", str(spec), "-o", str(out), *extra],
                   check=True, env=env, cwd=out.parent)
    return out, time.perf_counter() - t


def time_ns(exe: Path, n: int, *args: str) -> float:
    r = subprocess.run([*qemu(), str(exe), str(n), *args], capture_output=True, text=True, check=True)
    return float(r.stdout.split()[0])


def fmt(ns: float) -> str:
    return f"{ns / 1000:.2f} µs" if ns >= 1000 else f"{ns:.2f} ns"


CACHE = Path(os.environ.get("KPREWRITE_ARM64_CACHE", Path.home() / ".cache" / "kprewrite" / "debian-arm64"))
REAL_PACKAGES = ["busybox-static", "sqlite3", "libsqlite3-0", "libreadline8", "libtinfo6", "zlib1g"]
EVERY_ENTRY = '[[kprobe]]\nsymbol_name = "*"\n'
SQL = """
CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, v REAL);
WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {rows})
INSERT INTO t(name, v) SELECT printf('n%07d', (x * 7919) % {rows}), x * 1.5 FROM c;
CREATE INDEX t_name ON t(name);
SELECT count(*), sum(v), min(name), max(name) FROM t;
SELECT count(*) FROM t a JOIN t b ON a.name = b.name WHERE a.id % 13 = 0;
UPDATE t SET v = v * 2 WHERE id % 7 = 0;
SELECT round(avg(v), 3), count(DISTINCT substr(name, 1, 5)) FROM t;
"""


def sysroot() -> Path:
    """Debian's arm64 packages, extracted once into CACHE/root."""
    root, done = CACHE / "root", CACHE / "packages"
    if done.is_file() and set(REAL_PACKAGES) <= set(done.read_text().split()):
        return root
    debs = CACHE / "debs-bench"
    debs.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["apt-get", "download", "-q", *(f"{p}:arm64" for p in REAL_PACKAGES)], cwd=debs,
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit("apt-get download of arm64 packages failed (dpkg --add-architecture arm64 && apt-get update): "
                 + r.stderr.strip().splitlines()[-1])
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def cpu_run(cmd: list[str], stdin: bytes, env: dict) -> tuple[float, bytes]:
    """User + sys seconds of the child, and its standard output (exit 0 asserted)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, input=stdin, capture_output=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.decode()[-300:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), r.stdout


def executed(cmd: list[str], stdin: bytes, env: dict, tmp: Path) -> tuple[int, bytes]:
    """Instructions QEMU executed running cmd (`qemu-aarch64 ...`), deterministic: with
    `-d in_asm,exec,nochain` every translated block is listed once (its instructions)
    and logged at each execution (a `Trace` line naming its pc), read from a pipe; and
    the program's standard output."""
    fifo, inp, outp = tmp / "qemu.log", tmp / "stdin", tmp / "stdout"
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    inp.write_bytes(stdin)
    with open(inp, "rb") as i, open(outp, "wb") as o:
        p = subprocess.Popen([cmd[0], "-d", "in_asm,exec,nochain", "-D", str(fifo), *cmd[1:]], stdin=i, stdout=o,
                             stderr=subprocess.DEVNULL, env=env)
        size, total, block, first = {}, 0, 0, None
        with open(fifo, "rb") as log:
            for line in log:
                if line.startswith(b"Trace "):
                    total += size[int(line.split(b"/", 2)[1], 16)]
                elif line.startswith(b"0x"):
                    if first is None:
                        first = int(line.split(b":", 1)[0], 16)
                    block += 1
                elif first is not None:              # the blank line after a block
                    size[first], block, first = block, 0, None
        if p.wait() != 0:
            sys.exit(f"{' '.join(cmd)}: exit {p.returncode}")
    return total, outp.read_bytes()


def real(rounds: int, cpu: str | None, lines: int, rows: int, also: str | None, count: bool = False):
    """Every function entry of busybox and libsqlite3 probed, paired rounds under qemu-aarch64
    (also: another tree's rewrite run in the same rounds)."""
    q = [*qemu(), *(["-cpu", cpu] if cpu else [])]
    root = sysroot()
    libdirs = f"{root}/usr/lib/aarch64-linux-gnu:{root}/lib/aarch64-linux-gnu"
    trees = {"this tree": None, **({also: also} if also else {})}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        spec = tmp / "every.toml"
        spec.write_text(EVERY_ENTRY)
        rng = random.Random(42)
        numbers = "".join(f"{rng.randint(-10**6, 10**6)}\n" for _ in range(lines)).encode()
        env = dict(os.environ)
        env.pop("KPREWRITE_PROFILE", None)
        sqlite3 = [*q, str(root / "usr" / "bin" / "sqlite3"), ":memory:"]
        lib = (root / "usr" / "lib" / "aarch64-linux-gnu" / "libsqlite3.so.0").resolve()
        cases = {   # name -> (what, stdin, {variant: (command, env)}, {tree: rewrite seconds})
            "busybox": (f"`busybox sort -n`, {lines:,} lines", numbers,
                        {"original": ([*q, str(root / "bin" / "busybox"), "sort", "-n"], env)}, {}),
            "sqlite3": (f"`sqlite3 :memory:`, {rows:,} rows", SQL.format(rows=rows).encode(),
                        {"original": (sqlite3, dict(env, LD_LIBRARY_PATH=libdirs))}, {}),
        }
        for k, (label, tree) in enumerate(trees.items()):
            bb, cases["busybox"][3][label] = rewrite(root / "bin" / "busybox", spec, tmp / f"busybox{k}", tree=tree)
            cases["busybox"][2][label] = ([*q, str(bb), "sort", "-n"], env)
            (tmp / f"sq{k}").mkdir()
            _, cases["sqlite3"][3][label] = rewrite(lib, spec, tmp / f"sq{k}" / "libsqlite3.so.0", tree=tree)
            cases["sqlite3"][2][label] = (sqlite3, dict(env, LD_LIBRARY_PATH=f"{tmp / f'sq{k}'}:{libdirs}"))
        if count:
            print(f"qemu-aarch64{' -cpu ' + cpu if cpu else ''} TCG, instructions executed (`-d in_asm,exec`)")
            print("| object | workload | original | " + " | ".join(trees) + " |")
            print("|---|---|---:|" + "---:|" * len(trees))
            for name, (what, stdin, variants, secs) in cases.items():
                n = {v: executed(variants[v][0], stdin, variants[v][1], tmp) for v in variants}
                if len({out for _, out in n.values()}) != 1:
                    sys.exit(f"{name}: a rewrite prints otherwise than the original")
                o = n["original"][0]
                print(f"| {name} | {what} | {o:,} | " + " | ".join(f"{n[t][0]:,} (**{n[t][0] / o:.3f}×**)"
                                                                   for t in trees) + " |")
            return
        load = os.getloadavg()
        res = {}
        for name, (what, stdin, variants, secs) in cases.items():
            times = {v: [] for v in variants}
            names = list(variants)
            for i in range(rounds):
                order = names[i % len(names):] + names[:i % len(names)]     # each variant first in turn
                out = {}
                for v in order if i % 2 == 0 else order[::-1]:
                    t, out[v] = cpu_run(variants[v][0], stdin, variants[v][1])
                    times[v].append(t)
                if len(set(out.values())) != 1:
                    sys.exit(f"{name}: a rewrite prints otherwise than the original")
                print(f"{name} round {i}: " + ", ".join(f"{v} {times[v][-1]:.2f} s" for v in names), file=sys.stderr)
            for label in trees:
                ratios = [n / o for n, o in zip(times[label], times["original"])]
                res[name, label] = (what, statistics.median(times["original"]), statistics.median(times[label]),
                                    statistics.median(ratios), min(ratios), max(ratios), secs[label])
        load2 = os.getloadavg()
    print(f"qemu-aarch64{' -cpu ' + cpu if cpu else ''} TCG; {rounds} paired rounds; load average "
          f"{load[0]:.2f} before, {load2[0]:.2f} after")
    print("| object | rewriter | workload | user + sys, original (median) | rewritten (median) "
          "| paired ratio (median) | range | rewrite time |")
    print("|---|---|---|---:|---:|---:|---|---:|")
    for (name, label), (what, o, n, r, lo, hi, sec) in res.items():
        print(f"| {name} | {label} | {what} | {o:.2f} s | {n:.2f} s | **{r:.3f}×** | {lo:.3f}–{hi:.3f}× | {sec:.1f} s |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real", action="store_true", help="busybox and sqlite3, every function entry probed")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu", help="qemu-aarch64 -cpu (default: QEMU's, max)")
    ap.add_argument("--lines", type=int, default=200_000, help="busybox sort's input")
    ap.add_argument("--rows", type=int, default=20_000, help="sqlite3's table")
    ap.add_argument("--also", metavar="TREE", help="--real: another kprewrite tree's rewrite in the same rounds")
    ap.add_argument("--count", action="store_true",
                    help="--real: instructions executed (deterministic) instead of CPU time")
    a = ap.parse_args()
    if a.real:
        return real(a.rounds, a.cpu, a.lines, a.rows, a.also, a.count)
    qemu()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "loop.c").write_text(LOOP)
        (tmp / "handlers.c").write_text(HANDLERS)
        for name, text in SPECS.items():
            (tmp / name).write_text(text)
        orig = tmp / "loop"
        subprocess.run([CC, "-O2", str(tmp / "loop.c"), "-o", str(orig)], check=True)
        rows = {   # row -> (what, binary, rewrite seconds, calls, extra args)
            "o": ("optimized kprobe, empty pre_handler", *rewrite(orig, tmp / "kprobe.toml", tmp / "loop.o"), N, ()),
            "b": ("breakpoint kprobe (brk, stepped out of line), empty pre_handler",
                  *rewrite(orig, tmp / "kprobe.toml", tmp / "loop.b", "--no-optimize"), N_TRAP, ()),
            "s": ("breakpoint kprobe on an adr (simulated), empty pre_handler",
                  *rewrite(orig, tmp / "adr.toml", tmp / "loop.s", "--no-optimize"), N_TRAP, ("adr",)),
            "r": ("kretprobe (exits hooked), empty handler", *rewrite(orig, tmp / "return.toml", tmp / "loop.r"), N, ()),
        }
        base_keys = {(N, ()), (N_TRAP, ()), (N_TRAP, ("adr",))}
        times = {k: [] for k in list(rows) + [f"orig{n},{a}" for n, a in base_keys]}
        for _ in range(RUNS):
            for n, a in sorted(base_keys):
                times[f"orig{n},{a}"].append(time_ns(orig, n, *a) / n)
            for k, (_, exe, _, n, a) in rows.items():
                times[k].append(time_ns(exe, n, *a) / n)
        print(f"qemu-aarch64 TCG; {RUNS} runs each, medians; N={N} (o, r), N_TRAP={N_TRAP} (b, s)")
        print("| row | what | per call, original | per call, rewritten | per hit | ratio | rewrite time |")
        print("|---|---|---|---|---|---|---|")
        for k, (what, exe, secs, n, a) in rows.items():
            o = statistics.median(times[f"orig{n},{a}"])
            w = statistics.median(times[k])
            print(f"| {k} | {what} | {fmt(o)} | {fmt(w)} | {fmt(w - o)} | {w / o:.2f}× | {secs:.2f} s |")


if __name__ == "__main__":
    main()
