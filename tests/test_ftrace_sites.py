"""Ftrace sites in user ELFs: a function entry that a
`-pg -mfentry -mnop-mcount -mrecord-mcount` or `-fpatchable-function-entry=5`
build leaves as a 5-byte nop, recorded in __mcount_loc or
__patchable_function_entries, is probed there as KPROBE_FLAG_FTRACE does
(`check`: ftrace, `list`: [FTRACE]), whatever --no-optimize says; the rest of the
function is untouched and the tables are kept.  A real `call __fentry__` (plain
`-pg -mfentry`) stays an ordinary instruction, relocated into an optimized
detour: the program's own profiling still runs."""
from __future__ import annotations

import pytest
from elftools.elf.elffile import ELFFile

from conftest import cc, check_lines, function, instrument, kprewrite, meta, probe_spec, profile, read_at, run, symbols, write_spec

ARCHES = ["x86_64"]      # x86-64 only: x86-64's ftrace sites (-mfentry, -mnop-mcount, 5-byte patchable entries)

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
volatile int sink;
__attribute__((noinline)) int work(int x) { sink += x; return x * 3 + 1; }
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 5, t = 0;
    for (int i = 0; i < n; i++) t += work(i);
    printf("t=%d sink=%d\n", t, sink);
    return 0;
}
"""

HANDLERS = r"""
#include <kprewrite/kprobes.h>
int pre(struct kprobe *p, struct pt_regs *regs)
{
    if (p->offset == 0)
        pr_info("hit %s arg=%ld\n", p->symbol_name, (long)regs->di);
    return 0;
}
"""

# -mnop-mcount is refused with -fPIC/-fPIE, so that build is a non-PIE executable;
# the patchable-entry one is a PIE (its table's values in R_X86_64_RELATIVE relocations).
BUILDS = {
    "mnop_mcount": ("-O1", "-fno-pie", "-no-pie", "-pg", "-mfentry", "-mnop-mcount", "-mrecord-mcount"),
    "patchable5": ("-O1", "-fpatchable-function-entry=5"),
    "fentry_call": ("-O1", "-fno-pie", "-no-pie", "-pg", "-mfentry", "-mrecord-mcount"),
}
TABLE = {"mnop_mcount": "__mcount_loc", "patchable5": "__patchable_function_entries", "fentry_call": "__mcount_loc"}
PROBES = [("work", 0), ("main", 0), ("work", 5)]
N = 7


def _spec(tmp):
    return write_spec(tmp, probe_spec("kprobe", PROBES, pre_handler="pre"), HANDLERS)


def _build(tmp, build):
    prog = cc(tmp, build, PROGRAM, *BUILDS[build])
    spec = _spec(tmp)
    out = instrument(prog, spec, tmp / f"{build}.kp")
    return prog, spec, out


def _table(path, name) -> bytes:
    with open(path, "rb") as f:
        sec = ELFFile(f).get_section_by_name(name)
        assert sec is not None, f"{path}: no {name}"
        return sec.data()


def _gmon(tmp, name) -> dict:
    """-pg programs write gmon.out at exit: under tmp, not in the tests' directory."""
    return {"GMON_OUT_PREFIX": str(tmp / name)}


@pytest.mark.parametrize("build", ["mnop_mcount", "patchable5"])
def test_check_says_ftrace(once, build):
    """The entries are ftrace sites; a probe right after the site (offset 5) is an
    ordinary optimized probe; with --no-optimize the entries are still ftrace."""
    prog, spec, _ = once(_build, build)
    start, _ = function(prog, "work")
    assert read_at(prog, start, 5) in (b"\x0f\x1f\x44\x00\x00", b"\x90" * 5)
    assert check_lines(prog, spec) == ["work+0x0  k  ftrace", "main+0x0  k  ftrace", "work+0x5  k  optimized"]
    lines = check_lines(prog, spec, "--no-optimize")
    assert lines[:2] == ["work+0x0  k  ftrace", "main+0x0  k  ftrace"], lines
    assert lines[2].startswith("work+0x5  k  int3  kprobes_optimization"), lines


def test_real_fentry_call_stays_optimized(once):
    """Plain -pg -mfentry: the entry is a real `call __fentry__`, recorded in
    __mcount_loc but not a nop, so it is relocated (optimized), not skipped."""
    prog, spec, _ = once(_build, "fentry_call")
    start, _ = function(prog, "work")
    assert read_at(prog, start, 1) == b"\xe8"
    assert check_lines(prog, spec) == ["work+0x0  k  optimized", "main+0x0  k  optimized", "work+0x5  k  optimized"]


@pytest.mark.parametrize("build", ["mnop_mcount", "patchable5", "fentry_call"])
def test_rewritten_program_runs(once, tmp_path, build, runner):
    prog, _, out = once(_build, build)
    ftrace = build != "fentry_call"
    listing = kprewrite("list", out).stdout.splitlines()
    flag = "[FTRACE]" if ftrace else "[OPTIMIZED]"
    assert [l.split(None, 2)[2] for l in listing] == [f"work+0x0 {flag}", f"main+0x0 {flag}",
                                                      "work+0x5 [OPTIMIZED]"], listing
    # Untouched: the table, and main past its first five bytes (only the site holds a jump,
    # and a direct call of a probed function names its detour: planner.retarget.retarget_branches()).
    assert _table(out, TABLE[build]) == _table(prog, TABLE[build])
    start, end = function(prog, "main")
    after, before = bytearray(read_at(out, start + 5, end - start - 5)), bytearray(read_at(prog, start + 5, end - start - 5))
    for src, size, target in meta(out).get("branches", []):
        if start + 5 <= src < end:
            assert target == symbols(prog)["work"]
            after[src - start - 5:src - start - 5 + size] = before[src - start - 5:src - start - 5 + size]
    assert after == before
    if ftrace:
        assert read_at(out, start, 1) == b"\xe9"
    expect = run(prog, N, runner=runner, env=_gmon(tmp_path, "orig"))
    got = run(out, N, runner=runner, env={"KPREWRITE_PROFILE": "-", **_gmon(tmp_path, "kp")})
    assert got.returncode == 0, got.stderr
    assert got.stdout == expect.stdout == f"t={sum(3 * i + 1 for i in range(N))} sink={sum(range(N))}\n"
    assert profile(got.stderr) == {"p_work_0": (N, 0), "p_main_0": (1, 0), "p_work_5": (N, 0)}
    hits = [l for l in got.stderr.splitlines() if l.startswith("hit ")]
    assert hits == ["hit main arg=2"] + [f"hit work arg={i}" for i in range(N)], got.stderr
    if build != "patchable5":      # -pg: the program's profiling still writes its gmon.out
        assert len(list(tmp_path.glob("kp.*"))) == 1 and len(list(tmp_path.glob("orig.*"))) == 1


@pytest.mark.parametrize("flags,entry,inside", [
    # endbr64 first: the site is after it (arch_adjust_kprobe_addr()), the entry
    # recorded being the function's start; the site's inside is refused.
    (("-fcf-protection", "-fpatchable-function-entry=5"), "work+0x4  k  ftrace",
     "work+0x5  k  refused  blacklist at {0:#x}: {0:#x} is blacklisted: inside an ftrace site (work+0x4)"),
    # Two nops before the symbol, five at the entry: the five are the site.
    (("-fpatchable-function-entry=7,2",), "work+0x0  k  ftrace", "work+0x5  k  optimized"),
    # Four or six one-byte nops: no 5-byte site, ordinary code (optimized).
    (("-fpatchable-function-entry=4",), "work+0x0  k  optimized", None),
    (("-fpatchable-function-entry=6",), "work+0x0  k  optimized", "work+0x5  k  optimized"),
])
def test_patchable_entry_variants(tmp_path, flags, entry, inside):
    prog = cc(tmp_path, "prog", PROGRAM, "-O1", *flags)
    start, _ = function(prog, "work")
    probes = [("work", 0)] + ([("work", 5)] if inside else [])
    spec = write_spec(tmp_path, probe_spec("kprobe", probes, pre_handler="pre"), HANDLERS)
    r = kprewrite("check", prog, "--spec", spec, check=False)
    want = [entry] + ([inside.format(start + 5)] if inside else [])
    assert r.stdout.splitlines() == want, r.stdout + r.stderr
    if inside and "inside" in inside:
        assert f"{start + 5:#x}-{start + 9:#x}  work+0x4  inside an ftrace site" in kprewrite("blacklist", prog).stdout
