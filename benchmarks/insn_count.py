#!/usr/bin/env python3
"""Executed instructions per hit of each probe form, x86-64 against AArch64.

The same loop (a trivial function called N times) is built for x86-64 (gcc) and
AArch64 (aarch64-linux-gnu-gcc), rewritten with the spec that selects each form,
and run under QEMU user mode with one instruction per translation block and every
block's execution logged (`-singlestep -d exec,nochain`): one log line per
instruction executed, so the count is exact and does not move with the machine's
load.  Each binary runs with N1 and N2 calls; the start-up (the dynamic loader,
the runtime's init, the first hit's thread lookup) is the same in both, so

    instructions per hit = ((rewritten(N2) - rewritten(N1)) - (original(N2) - original(N1))) / (N2 - N1)

Forms (the handlers are in HANDLERS, the same C for both architectures):
  light      kprobe, no handler (counts the hit)
  clean      kprobe, pre_handler that reads no register
  regs       kprobe, pre_handler that loads one register from regs
  pt_regs    kprobe, pre_handler that may write regs (the whole struct pt_regs)
  kret       kretprobe, no handler
  kret_clean kretprobe, return handler that reads no register
  kret_regs  kretprobe, return handler reading regs_return_value()
  kret_entry kretprobe, empty entry_handler and return handler

AArch64 runs twice, under `QEMU_CPU=max` (LSE atomics, ARMv8.1+: the runtime rewrites
the light detours' increment into `stadd` at start-up) and `QEMU_CPU=cortex-a72` (none,
ARMv8.0: the LDXR/STXR loop as written); the other forms are the same on both.

Run: python3 benchmarks/insn_count.py [--tree DIR] [--baseline DIR] [--arch x86_64|aarch64]
     [--form NAME] [--write-table benchmarks/README.md]
(--tree: the kprewrite tree whose rewriter is measured, this one by default; --baseline:
another tree measured in the same run, its AArch64 columns added; --write-table: the
table written between <!-- insn_count:begin --> and <!-- insn_count:end --> in FILE).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
N1, N2 = 200, 1200

LOOP = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) long target(long x) { __asm__ volatile("" : "+r"(x)); return x + 1; }
int main(int argc, char **argv)
{
	long n = atol(argv[1]), s = 0;
	for (long i = 0; i < n; i++)
		s += target(i);
	printf("%ld\n", s);
	return 0;
}
"""

# ARG0: the first argument's register in struct pt_regs (never 0xdead: N2 is smaller).
HANDLERS = r"""
#include <kprewrite/kprobes.h>
#if defined(__x86_64__)
#define ARG0(r) ((r)->di)
#else
#define ARG0(r) ((r)->regs[0])
#endif
long seen;
int empty_pre(struct kprobe *p, struct pt_regs *regs) { return 0; }
int regs_pre(struct kprobe *p, struct pt_regs *regs) { seen += ARG0(regs); return 0; }
int write_pre(struct kprobe *p, struct pt_regs *regs) { if (ARG0(regs) == 0xdead) ARG0(regs) = 0; return 0; }
int empty_ret(struct kretprobe_instance *ri, struct pt_regs *regs) { return 0; }
int regs_ret(struct kretprobe_instance *ri, struct pt_regs *regs) { seen += regs_return_value(regs); return 0; }
int empty_entry(struct kretprobe_instance *ri, struct pt_regs *regs) { return 0; }
"""

FORMS = {   # name -> (what, spec body)
    "light": ("kprobe, no handler", '[[kprobe]]\nsymbol_name = "target"\n'),
    "clean": ("kprobe, pre_handler reads no register",
              '[[kprobe]]\nsymbol_name = "target"\npre_handler = "empty_pre"\n'),
    "regs": ("kprobe, pre_handler loads one register",
             '[[kprobe]]\nsymbol_name = "target"\npre_handler = "regs_pre"\n'),
    "pt_regs": ("kprobe, pre_handler may write regs",
                '[[kprobe]]\nsymbol_name = "target"\npre_handler = "write_pre"\n'),
    "kret": ("kretprobe, no handler", '[[kretprobe]]\nsymbol_name = "target"\n'),
    "kret_clean": ("kretprobe, handler reads no register",
                   '[[kretprobe]]\nsymbol_name = "target"\nhandler = "empty_ret"\n'),
    "kret_regs": ("kretprobe, handler reads regs_return_value()",
                  '[[kretprobe]]\nsymbol_name = "target"\nhandler = "regs_ret"\n'),
    "kret_entry": ("kretprobe, empty entry_handler and handler",
                   '[[kretprobe]]\nsymbol_name = "target"\nhandler = "empty_ret"\nentry_handler = "empty_entry"\n'),
}

ARCHES = {   # name -> (compiler, QEMU command, the CPUs it runs on: None for QEMU's default)
    "x86_64": ("gcc", ["qemu-x86_64"], [None]),
    "aarch64": ("aarch64-linux-gnu-gcc", ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"], ["max", "cortex-a72"]),
}
CPU_NAME = {None: "", "max": " LSE (`max`)", "cortex-a72": " no LSE (`cortex-a72`)"}
MARKER = "insn_count"


def executed(qemu: list[str], exe: Path, n: int, log: Path) -> tuple[int, str]:
    """Instructions QEMU executed running `exe n` (one `Trace` line each), and its output."""
    r = subprocess.run([*qemu, "-singlestep", "-d", "exec,nochain", "-D", str(log), str(exe), str(n)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{exe} {n}: exit {r.returncode}\n{r.stdout}{r.stderr}")
    with open(log, "rb") as f:
        count = sum(1 for line in f if line.startswith(b"Trace "))
    log.unlink()
    return count, r.stdout


def per_hit(qemu, orig: Path, new: Path, tmp: Path) -> float:
    o1, oo1 = executed(qemu, orig, N1, tmp / "log")
    o2, oo2 = executed(qemu, orig, N2, tmp / "log")
    r1, ro1 = executed(qemu, new, N1, tmp / "log")
    r2, ro2 = executed(qemu, new, N2, tmp / "log")
    if (ro1, ro2) != (oo1, oo2):
        sys.exit(f"{new}: prints {ro1!r} {ro2!r}, the original {oo1!r} {oo2!r}")
    return ((r2 - r1) - (o2 - o1)) / (N2 - N1)


def write_table(path: Path, text: str) -> None:
    """Replace what lies between <!-- insn_count:begin --> and <!-- insn_count:end --> in path."""
    begin, end = f"<!-- {MARKER}:begin -->", f"<!-- {MARKER}:end -->"
    doc = path.read_text()
    i, j = doc.find(begin), doc.find(end)
    if i < 0 or j < i:
        sys.exit(f"insn_count: {path} has no {begin} ... {end} pair to write the table between")
    path.write_text(doc[:i + len(begin)] + "\n" + text + doc[j:])
    print(f"wrote the table between {begin} and {end} in {path}", file=sys.stderr)


def commit_of(tree: str) -> str:
    return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", default=str(HERE.parent), help="the kprewrite tree to measure")
    ap.add_argument("--baseline", help="another tree, its AArch64 columns measured in the same run")
    ap.add_argument("--arch", action="append", choices=list(ARCHES), help="default: both")
    ap.add_argument("--form", action="append", choices=list(FORMS), help="default: all")
    ap.add_argument("--write-table", type=Path, metavar="FILE",
                    help=f"write the table between <!-- {MARKER}:begin --> and <!-- {MARKER}:end --> in FILE")
    a = ap.parse_args()
    arches = a.arch or list(ARCHES)
    forms = a.form or list(FORMS)
    if a.write_table and f"<!-- {MARKER}:begin -->" not in a.write_table.read_text():
        sys.exit(f"insn_count: {a.write_table} has no <!-- {MARKER}:begin --> marker")
    trees = [(a.tree, commit_of(a.tree))] + ([(a.baseline, commit_of(a.baseline))] if a.baseline else [])
    # Columns: (tree, commit, arch, cpu); the baseline's for AArch64 only (x86-64's outputs are
    # the same bytes, benchmarks/byte_identity.py).
    cols = [(t, c, arch, cpu) for t, c in trees for arch in arches for cpu in ARCHES[arch][2]
            if t == a.tree or arch == "aarch64"]
    qv = subprocess.run(["qemu-x86_64", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    res = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "loop.c").write_text(LOOP)
        (tmp / "handlers.c").write_text(HANDLERS)
        for arch in arches:
            cc, qemu, _ = ARCHES[arch]
            if not shutil.which(cc) or not shutil.which(qemu[0]):
                sys.exit(f"needs {cc} and {qemu[0]}")
            orig = tmp / f"loop.{arch}"
            subprocess.run([cc, "-O2", str(tmp / "loop.c"), "-o", str(orig)], check=True)
            for tree, commit in trees:
                if not any(col[0] == tree and col[2] == arch for col in cols):
                    continue
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
                for form in forms:
                    spec = tmp / f"{form}.toml"
                    spec.write_text('handlers = ["handlers.c"]\n' + FORMS[form][1])
                    new = tmp / f"loop.{arch}.{form}"
                    subprocess.run([sys.executable, "-m", "rewriter", "instrument", str(orig), "--spec", str(spec),
                                    "-o", str(new)], check=True, env=env, cwd=tmp)
                    for cpu in ARCHES[arch][2]:
                        q = qemu[:1] + (["-cpu", cpu] if cpu else []) + qemu[1:]
                        res[tree, arch, cpu, form] = per_hit(q, orig, new, tmp)
                        print(f"{commit} {arch}{CPU_NAME[cpu]} {form}: {res[tree, arch, cpu, form]:.2f}", file=sys.stderr)
    head = (f"Generated by `python3 benchmarks/insn_count.py {' '.join(sys.argv[1:])}` on "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {qv}; N = {N1}, {N2}; "
            + "; ".join(f"{'tree' if t == a.tree else 'baseline'} at {c}" for t, c in trees) + ".")
    lines = [head, "", "| form | what | " + " | ".join(
        f"{arch.replace('_', '-')}{CPU_NAME[cpu]}{'' if t == a.tree else f' {c}'}" for t, c, arch, cpu in cols) + " |",
        "|---|---|" + "---:|" * len(cols)]
    for form in forms:
        lines.append(f"| {form} | {FORMS[form][0]} | " + " | ".join(
            f"{res[t, arch, cpu, form]:.1f}" for t, c, arch, cpu in cols) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.write_table:
        write_table(a.write_table, text)


if __name__ == "__main__":
    main()
