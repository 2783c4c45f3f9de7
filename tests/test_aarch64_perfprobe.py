"""Probes by name (perf probe's syntax) on an AArch64 user program, cross-built and run under
qemu-aarch64 whatever the host (so it runs in the default x86-64 run too): the DWARF register
map of rewriter/arch/aarch64/fetchregs.py (x0-x30, sp) names parameters, members through
pointers, strings, a local at a source line (in the frame: DW_OP_fbreg on the CFA from
.eh_frame) and `$retval`, with the fetch args `perf probe -D` writes for the same definitions,
and the events print the values the program computes."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import ALL_ARCHES, kprewrite, qemu_command, write_spec

ARCHES = ALL_ARCHES      # conftest: cross-built, runs on either host
CC = "aarch64-linux-gnu-gcc"

PROG_C = r"""
#include <stdio.h>
#include <string.h>
struct point { int x; long y; const char *name; };
__attribute__((noinline)) long work(struct point *p, int k, const char *s)
{
	long acc = p->x * k;
	for (int i = 0; i < k; i++)
		acc += p->y + strlen(s) + strlen(p->name);
	return acc;
}
int main(int argc, char **argv)
{
	struct point pt = { 7, 100 + argc, "alpha" };
	long r = 0;
	for (int k = 1; k <= 3; k++)
		r += work(&pt, k, argv[0]);
	printf("r=%ld\n", r);
	return 0;
}
"""
# work:5 is `return acc;` (perf probe's lines count from the function's first line); at -O2
# `acc` is gone there (optimized out, as gdb says), so that definition is -O0's only.
DEFS = ["work p->x p->y k s:string p->name:string", "work:5 acc", "work%return $retval"]


def defs(prog) -> list[str]:
    return DEFS if prog.parent.name.startswith("a64perfprobe-O0") else [DEFS[0], DEFS[2]]


@pytest.fixture(scope="module", params=["0", "2"])
def prog(request, tmp_path_factory):
    if not shutil.which(CC):
        pytest.skip(f"{CC} not installed (gcc-aarch64-linux-gnu)")
    d = tmp_path_factory.mktemp(f"a64perfprobe-O{request.param}")
    (d / "prog.c").write_text(PROG_C)
    subprocess.run([CC, "-g", f"-O{request.param}", "-o", d / "prog", d / "prog.c"], check=True)
    return d / "prog"


def _ours(prog, tmp_path) -> list[str]:
    spec = write_spec(tmp_path, "probes = [" + ", ".join(f'"{d}"' for d in defs(prog)) + "]\n")
    r = kprewrite("check", prog, "--spec", spec)
    return [l.split(": ", 1)[1] for l in r.stdout.splitlines() if l.startswith("probes[")]


def test_perf_agrees(prog, tmp_path):
    """Each definition compiles to one line; at -O0 its fetch args are perf probe -D's (the
    kernel's arm64 names: %x0.., +off(%xN)); the addresses are perf's too."""
    perf = shutil.which("perf")
    ours = _ours(prog, tmp_path)
    assert len(ours) == len(defs(prog)), ours
    if not prog.parent.name.startswith("a64perfprobe-O0"):      # at the entry, in the argument registers
        assert ours[0].split()[2:] == ["x=+0(%x0):s32", "y=+8(%x0):s64", "k=%x1:s32", "s_string=+0(%x2):string",
                                       "name=+0(+16(%x0)):string"], ours
    for d, mine in zip(defs(prog), ours):
        r = subprocess.run([perf, "probe", "-x", str(prog), "-D", d], capture_output=True, text=True) if perf else None
        if r is None or r.returncode:
            pytest.skip("perf probe -D does not work here")
        (theirs,) = [l for l in r.stdout.splitlines() if l[:2] in ("p:", "r:")]
        assert int(theirs.split()[1].rsplit(":", 1)[1], 16) == _addr(prog, mine), (theirs, mine)
        if prog.parent.name.startswith("a64perfprobe-O0") and "$retval" not in d:
            assert theirs.split()[2:] == mine.split()[2:], (theirs, mine)


def _addr(prog, line: str) -> int:
    """The file address our line probes: its symbol+offset, through nm."""
    where = line.split()[1]
    sym, _, off = where.partition("+")
    nm = subprocess.run(["aarch64-linux-gnu-nm", str(prog)], capture_output=True, text=True, check=True).stdout
    base = next(int(a, 16) for a, _, n in (l.split() for l in nm.splitlines() if len(l.split()) == 3) if n == sym)
    return base + (int(off, 16) if off else 0)


def test_values_under_qemu(prog, tmp_path):
    """Rewritten and run under qemu-aarch64: every call's parameters, members, strings, the local
    before the return and the return value, as the program computes them (argc 1: y = 101;
    "alpha" adds 5 a turn)."""
    out = tmp_path / "prog.kp"
    spec = write_spec(tmp_path, "probes = [" + ", ".join(f'"{d}"' for d in defs(prog)) + "]\n")
    kprewrite("instrument", prog, "--spec", spec, "-o", out)
    trace = tmp_path / "trace.txt"
    r = subprocess.run([*qemu_command("aarch64"), str(out)], capture_output=True, text=True,
                       env={"KPREWRITE_TRACE": str(trace), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert r.returncode == 0, r.stderr
    n = len(str(out))
    assert r.stdout == f"r={sum(7 * k + k * (106 + n) for k in (1, 2, 3))}\n", r.stdout
    lines = trace.read_text().splitlines()
    entries = [l.split(": ", 1)[1].split(") ", 1)[1] for l in lines if " work: " in l]
    assert entries == [f'x=7 y=101 k={k} s_string="{out}" name="alpha"' for k in (1, 2, 3)], lines
    locals_ = [l.rsplit(") ", 1)[1] for l in lines if " work_L5: " in l or " work_5: " in l]
    if len(defs(prog)) == 3:
        assert locals_ == [f"acc={7 * k + k * (106 + n)}" for k in (1, 2, 3)], lines
    rets = [l.rsplit(") ", 1)[1] for l in lines if " work__return: " in l]
    assert rets == [f"retval={7 * k + k * (106 + n)}" for k in (1, 2, 3)], lines
