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

Run: python3 benchmarks/aarch64.py   (BENCH_N, BENCH_N_TRAP, BENCH_RUNS to scale)
"""
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


def rewrite(exe: Path, spec: Path, out: Path, *extra: str) -> tuple[Path, float]:
    t = time.perf_counter()
    subprocess.run([*KPREWRITE, "instrument", str(exe), "--spec", str(spec), "-o", str(out), *extra],
                   check=True, env=TREE_ENV)
    return out, time.perf_counter() - t


def time_ns(exe: Path, n: int, *args: str) -> float:
    r = subprocess.run([*qemu(), str(exe), str(n), *args], capture_output=True, text=True, check=True)
    return float(r.stdout.split()[0])


def fmt(ns: float) -> str:
    return f"{ns / 1000:.2f} µs" if ns >= 1000 else f"{ns:.2f} ns"


def main():
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
