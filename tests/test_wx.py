"""No page of any output is both writable and executable: every
PT_LOAD of a rewritten PIE, non-PIE, static executable and shared object, with
optimized kprobes, kretprobes, INT3 probes and trace events, is W or X, never
both, and PT_GNU_STACK stays non-executable; a running rewritten program (its
probes having fired) has no rwx mapping.  A kernel image: the segments kprewrite
adds are not W+X.  The kernel's own vmlinux has an RWE segment (init and bss),
which the kernel maps by section itself; what a booted rewritten kernel maps is
checked by CONFIG_DEBUG_WX at every boot of the kernel tests
(tests/kernel/kernel_env.py, WX_PASSED)."""
from __future__ import annotations

import os
import subprocess

import pytest
from elftools.elf.elffile import ELFFile

from conftest import ALL_ARCHES, ARCH, CROSS, FACTS, cc, instrument, run, write_spec

ARCHES = ALL_ARCHES
LOCAL = "qemu" if CROSS else "native"      # the runner of the tests that run once

PF_X, PF_W = 1, 2

PROGRAM = r"""
#include <stdio.h>
#include <string.h>
__attribute__((noinline)) long work(long x) { __asm__ volatile("" ::: "memory"); return x * 3; }
__attribute__((noinline)) long other(long x) { __asm__ volatile("" ::: "memory"); return x + 1; }
int main(void)
{
    long s = 0;
    for (long i = 0; i < 3; i++)
        s += work(i) + other(i);
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    while (f && fgets(line, sizeof(line), f))
        if (strstr(line, " rwx") || strstr(line, " -wx"))
            printf("wx: %s", line);
    printf("s=%ld\n", s);
    return 0;
}
"""

LIB = r"""
__attribute__((noinline)) long work(long x) { __asm__ volatile("" ::: "memory"); return x * 3; }
__attribute__((noinline)) long other(long x) { __asm__ volatile("" ::: "memory"); return x + 1; }
"""

HANDLERS = r"""
#include <linux/kprobes.h>
static unsigned long n;
int pre(struct kprobe *p, struct pt_regs *regs) { (void)p; (void)regs; n++; return 0; }
int ret(struct kretprobe_instance *ri, struct pt_regs *regs) { (void)ri; (void)regs; n++; return 0; }
"""

SPEC = """handlers = ["handlers.c"]
events = ["p:w work x=ARG0:s64", "r:rw work $retval", "p:o other ARG0"]
[[kprobe]]
symbol_name = "work"
pre_handler = "pre"
[[kretprobe]]
symbol_name = "other"
handler = "ret"
""".replace("ARG0", FACTS.ARG_REGS[0])

KINDS = {
    "pie": (PROGRAM, ["-O2", "-fPIE", "-pie"]),
    "nopie": (PROGRAM, ["-O2", "-fno-pie", "-no-pie"]),
    "static": (PROGRAM, ["-O2", "-static"]),
    "shared": (LIB, ["-O2", "-fPIC", "-shared"]),
}


def wx_segments(path) -> list[str]:
    bad = []
    with open(path, "rb") as f:
        for i, ph in enumerate(ELFFile(f).iter_segments()):
            flags = ph["p_flags"]
            if ph["p_type"] == "PT_LOAD" and flags & PF_W and flags & PF_X:
                bad.append(f"PT_LOAD #{i} at {ph['p_vaddr']:#x} is W+X")
            if ph["p_type"] == "PT_GNU_STACK" and flags & PF_X:
                bad.append("PT_GNU_STACK is executable")
    return bad


@pytest.mark.parametrize("int3", [False, True], ids=["optimized", "int3"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_no_wx_segment(tmp_path, kind, int3):
    source, flags = KINDS[kind]
    binary = cc(tmp_path, "lib.so" if kind == "shared" else "prog", source, *flags,
                skip_without_static=kind == "static")
    assert wx_segments(binary) == []                      # the input has none
    out = instrument(binary, write_spec(tmp_path, SPEC, HANDLERS), tmp_path / (binary.name + ".kp"),
                     *(["--no-optimize"] if int3 else []))
    assert wx_segments(out) == []
    if kind != "shared":
        r = run(out, runner=LOCAL)
        assert r.returncode == 0 and r.stdout.endswith("s=15\n"), r.stderr
        assert "wx:" not in r.stdout, r.stdout               # no rwx mapping at run time
        assert r.stderr.count(" w: (work+0x0/") == 3, r.stderr  # the probes fired


@pytest.mark.kernel
@pytest.mark.skipif(ARCH != "x86_64", reason="the x86-64 kernel's vmlinux")
def test_kernel_adds_no_wx_segment(tmp_path):
    """vmlinux rewritten (from the cache only: skipped if no kernel test fetched it)."""
    import glob
    from conftest import kprewrite
    cached = sorted(glob.glob(os.path.expanduser("~/.cache/kprewrite/kernel/linux-image-*/vmlinux")))
    if not cached:
        pytest.skip("no cached kernel (~/.cache/kprewrite/kernel)")
    vmlinux = cached[-1]
    spec = write_spec(tmp_path, 'events = ["p:clone kernel_clone", "r:clone_ret kernel_clone $retval"]\n'
                                '[[kprobe]]\nsymbol_name = "do_sys_openat2"\n')
    out = tmp_path / "vmlinux.kp"
    kprewrite("instrument", vmlinux, "--spec", spec, "-o", out)

    def loads(path):
        with open(path, "rb") as f:
            return [(ph["p_vaddr"], ph["p_memsz"], ph["p_flags"]) for ph in ELFFile(f).iter_segments()
                    if ph["p_type"] == "PT_LOAD"]
    before = set(loads(vmlinux))
    after = loads(out)
    added = [s for s in after if s not in before]
    wx = [f"{v:#x}+{n:#x}" for v, n, fl in after if fl & PF_W and fl & PF_X]
    wx_before = [f"{v:#x}+{n:#x}" for v, n, fl in before if fl & PF_W and fl & PF_X]
    assert not [s for s in added if s[2] & PF_W and s[2] & PF_X], (added, wx)
    assert len(wx) <= len(wx_before), (wx, wx_before)
