"""End to end: every kind of x86-64 input, rewritten and run natively and under QEMU;
the same for aarch64 under qemu-aarch64 (KPREWRITE_TEST_ARCH=aarch64), with
-mbranch-protection where x86-64 has -fcf-protection."""
from __future__ import annotations

import hashlib
import subprocess

import pytest

from conftest import ALL_ARCHES, ARCH, CROSS, FACTS, TRIPLES, cc, instrument, kprewrite, profile, run, symbols, write_spec

ARCHES = ALL_ARCHES
# The control-flow protection flag of the arch (its landing pads at function entries).
CF = FACTS.CF_PROTECTION
STRIP = f"{TRIPLES[ARCH]}-strip" if CROSS else "strip"
LOCAL = "qemu" if CROSS else "native"       # the runner of the tests that run once

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) long work(long x) { return x * 3 + 1; }
__attribute__((noinline)) long other(long x) { return x ^ 0x55; }
int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 10, sum = 0;
    for (long i = 0; i < n; i++) sum += work(i) + other(i);
    printf("sum=%ld\n", sum);
    return (int)(sum & 0x3f);
}
"""

HANDLERS = r"""
#include <kprewrite/kprobes.h>
static long calls;
int on_work(struct kprobe *p, struct pt_regs *regs)
{
    if (regs_get_kernel_argument(regs, 0) == 3)
        pr_info("work(%ld) ip=%lx addr=%p\n", (long)regs_get_kernel_argument(regs, 0),
                instruction_pointer(regs), p->addr);
    calls++;
    return 0;
}
"""

SPEC = """
handlers = ["handlers.c"]
[[kprobe]]
symbol_name = "work"
pre_handler = "on_work"
[[kprobe]]
symbol_name = "other"
name = "other_entry"
"""

KINDS = {
    "pie": ["-fPIE", "-pie"],
    "nopie": ["-fno-pie", "-no-pie"],
    "static": ["-static"],
    "static-pie": ["-static-pie", "-fPIE"],
}


def expected(n):
    s = sum(i * 3 + 1 + (i ^ 0x55) for i in range(n))
    return s, s & 0x3F


def _kind(tmp, kind, opt, cf):
    flags = [opt, *KINDS[kind]] + ([cf] if cf else [])
    prog = cc(tmp, "prog", PROGRAM, *flags)
    return instrument(prog, write_spec(tmp, SPEC, HANDLERS))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("opt", ["-O0", "-O2"])
@pytest.mark.parametrize("cf", ["", CF])
def test_kinds(once, kind, opt, cf, runner):
    out = once(_kind, kind, opt, cf)
    s, rc = expected(25)
    r = run(out, 25, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == rc, r.stderr
    assert r.stdout == f"sum={s}\n"
    assert "work(3) ip=" in r.stderr
    prof = profile(r.stderr)
    assert prof["p_work_0"] == (25, 0)
    assert prof["other_entry"] == (25, 0)
    # Probes disarmed: the program runs as before and no handler prints.
    r = run(out, 25, runner=runner, env={"KPREWRITE_ENABLED": "0", "KPREWRITE_PROFILE": "-"})
    assert r.returncode == rc and "work(3)" not in r.stderr
    assert profile(r.stderr)["p_work_0"] == (0, 0)


@pytest.mark.skipif(ARCH != "x86_64", reason="ENDBR64 (aarch64's bti c: tests/test_aarch64_bti.py)")
def test_cf_protection_entry_lands_after_endbr(tmp_path):
    prog = cc(tmp_path, "prog", PROGRAM, "-O2", "-fcf-protection")
    spec = write_spec(tmp_path, SPEC, HANDLERS)
    out = instrument(prog, spec)
    listing = kprewrite("list", out).stdout.splitlines()
    assert any(" k  work+0x4 [OPTIMIZED]" in l for l in listing), listing
    r = run(out, 4)
    assert r.stdout == f"sum={expected(4)[0]}\n"
    # The ENDBR stays in place for indirect calls.
    with open(out, "rb") as f:
        data = f.read()
    assert b"\xf3\x0f\x1e\xfa\xe9" in data


def _stripped(tmp, opt):
    prog = cc(tmp, "prog", PROGRAM, opt)
    addr = symbols(prog)["work"]
    stripped = tmp / "stripped"
    subprocess.run([STRIP, "-o", str(stripped), str(prog)], check=True)
    spec = write_spec(tmp, f'handlers = ["handlers.c"]\n[[kprobe]]\naddr = {addr:#x}\npre_handler = "on_work"\n', HANDLERS)
    return instrument(stripped, spec)


@pytest.mark.parametrize("opt", ["-O0", "-O2"])
def test_stripped_binary_by_address(once, opt, runner):
    out = once(_stripped, opt)
    r = run(out, 5, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.stdout == f"sum={expected(5)[0]}\n"
    assert "work(3) ip=" in r.stderr
    assert list(profile(r.stderr).values()) == [(5, 0)]


LIB = r"""
__attribute__((noinline)) long lib_work(long x) { return x + 100; }
long lib_api(long x) { return lib_work(x) * 2; }
"""
LIB_MAIN = r"""
#include <stdio.h>
long lib_api(long);
int main(void) { long s = 0; for (int i = 0; i < 7; i++) s += lib_api(i); printf("s=%ld\n", s); return 0; }
"""


def _shared_object(tmp, opt):
    lib = cc(tmp, "libw.so", LIB, opt, "-shared", "-fPIC")
    prog = cc(tmp, "main", LIB_MAIN, opt, f"-L{tmp}", "-lw")
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\n[[kprobe]]\nsymbol_name = "lib_work"\npre_handler = "h"\n',
                      '#include <kprewrite/kprobes.h>\nint h(struct kprobe *p, struct pt_regs *r) { pr_info("lib_work(%lu)\\n", regs_get_kernel_argument(r, 0)); return 0; }\n')
    outdir = tmp / "out"
    outdir.mkdir()
    instrument(lib, spec, outdir / "libw.so")
    return prog, outdir


@pytest.mark.parametrize("opt", ["-O0", "-O2"])
def test_shared_object(once, opt, runner):
    prog, outdir = once(_shared_object, opt)
    r = run(prog, runner=runner, libdir=outdir, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"s={sum((i + 100) * 2 for i in range(7))}\n"
    assert [l for l in r.stderr.splitlines() if l.startswith("lib_work(")] == [f"lib_work({i})" for i in range(7)]
    assert profile(r.stderr) == {"p_lib_work_0": (7, 0)}


def test_deterministic_and_input_untouched(tmp_path):
    prog = cc(tmp_path, "prog", PROGRAM, "-O2")
    before = hashlib.sha256(prog.read_bytes()).hexdigest()
    spec = write_spec(tmp_path, SPEC, HANDLERS)
    a = instrument(prog, spec, tmp_path / "a")
    b = instrument(prog, spec, tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()
    assert hashlib.sha256(prog.read_bytes()).hexdigest() == before
    assert (a.stat().st_mode & 0o777) == (prog.stat().st_mode & 0o777)


def test_check_and_list(tmp_path):
    prog = cc(tmp_path, "prog", PROGRAM, "-O2")
    spec = write_spec(tmp_path, SPEC + '[[kprobe]]\nsymbol_name = "work"\ndisabled = true\nname = "work_off"\n', HANDLERS)
    r = kprewrite("check", prog, "--spec", spec)
    assert r.stdout.splitlines() == ["work+0x0  k  optimized", "other+0x0  k  optimized", "work+0x0  k  optimized"]
    out = instrument(prog, spec)
    lines = kprewrite("list", out).stdout.splitlines()
    assert len(lines) == 3
    assert lines[0].endswith("  k  work+0x0 [OPTIMIZED]")
    assert lines[2].endswith("  k  work+0x0 [DISABLED] [OPTIMIZED]")
    addr = symbols(prog)["work"]
    assert int(lines[0].split()[0], 16) == addr
    # The disabled probe aggregates with the enabled one and stays silent.
    r = run(out, 6, runner=LOCAL, env={"KPREWRITE_PROFILE": "-"})
    prof = profile(r.stderr)
    assert prof["p_work_0"] == (6, 0) and prof["other_entry"] == (6, 0) and prof["work_off"] == (0, 0)
