"""The AArch64 back end's safety rules proven as tests/test_safety_rules.py proves
x86-64's: for each rule of rewriter/safety.py with `arch="aarch64"`, a small
program cross-built with aarch64-linux-gnu-gcc that, rewritten with the rule on,
prints under qemu-aarch64 what the original prints, and rewritten with the rule
switched off (KPREWRITE_UNSAFE_OFF=<rule>) crashes, hangs or prints something
else.  tests/test_safety_rules.py's registry test checks that every such rule
names a test and a program here."""
from __future__ import annotations

import subprocess

import pytest

from conftest import KPREWRITE, TREE_ENV, cc, check_lines, instrument, probe_spec, qemu_command, write_spec
from rewriter import safety
from test_aarch64_bti import HANDLERS as BTI_HANDLERS, PROGRAM as BTI_PROGRAM, PROTECTION

ARCHES = ["aarch64"]
HANG = 15       # seconds a rule-off run may take before it counts as hung

# An ldxr ... stxr loop: a probe between them (inc+4) is inside the exclusive sequence.
# A breakpoint there traps, and the exception return clears the exclusive monitor
# (on hardware, and in qemu-aarch64's cpu loop): the stxr fails, the loop retries
# the ldxr, traps again, forever.
EXCLUSIVE = r"""
#include <stdio.h>
long counter;
void inc(long *p);
__asm__(".text\n.globl inc\n.type inc,%function\ninc:\n"
        "1: ldxr x1, [x0]\n add x1, x1, #1\n stxr w2, x1, [x0]\n cbnz w2, 1b\n ret\n.size inc, .-inc\n");
int main(void)
{
    for (int i = 0; i < 100; i++)
        inc(&counter);
    printf("counter=%ld\n", counter);
    return 0;
}
"""

# get() starts with an adrp: copied to the detour unchanged, it computes the detour's
# page, not g's, and main reads another word.
PC_RELATIVE = r"""
#include <stdio.h>
long g = 42;
long *get(void);
__asm__(".text\n.globl get\n.type get,%function\nget:\n"
        " adrp x0, g\n add x0, x0, :lo12:g\n ret\n.size get, .-get\n");
int main(void)
{
    long s = 0;
    for (int i = 0; i < 3; i++)
        s += *get();
    printf("s=%ld\n", s);
    return 0;
}
"""

# cramped saves x30 in its frame record and reads it back from the slot into seen_ra.
# far_fn lies 256 MiB above it, and the new code after far_fn (test_aarch64_reach.py's layout), so
# cramped's ret, out of a `B`'s reach of a return hook, is hooked by a brk there
# (the return address stays where bl put it), where the x30 trampoline, swapped at
# entry, would be what cramped reads: ra_ok=0.
TRAMPOLINE_UNSAFE = r"""
#include <stdio.h>
__asm__(".text\n.globl cramped\n.type cramped,%function\ncramped:\n"
        " .cfi_startproc\n"
        " stp x29, x30, [sp, #-16]!\n .cfi_def_cfa_offset 16\n .cfi_offset 29, -16\n .cfi_offset 30, -8\n"
        " mov x29, sp\n"
        " ldr x1, [x29, #8]\n"
        " adrp x2, seen_ra\n str x1, [x2, :lo12:seen_ra]\n"
        " add x0, x0, #7\n"
        " ldp x29, x30, [sp], #16\n .cfi_restore 30\n .cfi_restore 29\n .cfi_def_cfa_offset 0\n"
        " ret\n .cfi_endproc\n.size cramped, .-cramped\n");
long cramped(long);
void *seen_ra;
__attribute__((noinline, used, section(".fartext"))) long far_fn(long a) { return a + 1; }
int main(void)
{
    long s = 0;
    int ra_ok = 1;
    for (long i = 0; i < 3; i++) {
        s += cramped(i);
        ra_ok &= (char *)seen_ra > (char *)main && (char *)seen_ra < (char *)main + 400;
    }
    printf("s=%ld ra_ok=%d\n", s, ra_ok);
    return 0;
}
"""

# x86-64's ENTRY_FRAME (tests/test_safety_rules.py) for AArch64: work, a leaf, keeps x19 in a
# 16-byte frame and branches to workpart with it live; workpart has unwind information and no
# `.cold` name (a stripped hot/cold split), and only its FDE, CFA = sp+16 (x30 unsaved) at its
# first byte, says it is entered mid-frame.  A kretprobe taking it as an entry (CFA = sp+0 is an
# entry's: bl pushes nothing) swaps x30 there, and at work's ret the trampoline finds the
# instance's frame 16 bytes off: "lost the return address", SIGILL.
ENTRY_FRAME = r"""
__asm__(
".text\n"
".globl work\n.type work,%function\nwork:\n"
"  .cfi_startproc\n"
"  str x19, [sp, #-16]!\n"
"  .cfi_def_cfa_offset 16\n"
"  .cfi_offset 19, -16\n"
"  mov x19, x0\n"
"  tbnz x0, #63, workpart\n"
"1: add x0, x19, #1\n"
"  ldr x19, [sp], #16\n"
"  .cfi_restore 19\n"
"  .cfi_def_cfa_offset 0\n"
"  ret\n"
"  .cfi_endproc\n"
".size work,.-work\n"
".type workpart,%function\nworkpart:\n"
"  .cfi_startproc\n"
"  .cfi_def_cfa_offset 16\n"
"  .cfi_offset 19, -16\n"
"  neg x19, x19\n"
"  b 1b\n"
"  .cfi_endproc\n"
".size workpart,.-workpart\n");
#include <stdio.h>
long work(long);
int main(void)
{
    long s = 0;
    for (long i = 1; i <= 3; i++)
        s = s * 10 + work(-i);
    printf("s=%ld\n", s);
    return 0;
}
"""

# rule -> (source, gcc flags, spec, handlers, run under -cpu max (BTI enforced))
PROGRAMS = {
    # A glob: with the rule on the probe is refused and skipped, not an error.
    "exclusive_monitor": (EXCLUSIVE, ["-O2"], "optimize = false\n" + probe_spec("kprobe", [("in?", 4)], handlers=False),
                          None, False),
    "pc_relative": (PC_RELATIVE, ["-O2"], probe_spec("kprobe", ["get"], handlers=False), None, False),
    "trampoline_unsafe": (TRAMPOLINE_UNSAFE, ["-O2", "-no-pie", "-Wl,--section-start=.fartext=0x10000000"],
                          probe_spec("kretprobe", ["cramped"], handlers=False), None, False),
    # A rule of every back end (`where` is <arch>.retprobe), proven here for AArch64's.
    "entry_frame": (ENTRY_FRAME, ["-O2"], probe_spec("kretprobe", ["workpar?"], handlers=False, maxactive=20),
                    None, False),
    # mid starts with paciasp, the landing pad of main's call through fp.
    "landing_pad": (BTI_PROGRAM, ["-O2", "-static", "-nostdlib", *PROTECTION["bti+pac"]],
                    probe_spec("kprobe", ["mid"], pre_handler="pre"), BTI_HANDLERS, True),
}


def _run(binary, cpu_max: bool) -> tuple:
    """(exit status, standard output), or ("hung",)."""
    cmd = [*qemu_command(), *(["-cpu", "max"] if cpu_max else []), str(binary)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG)
    except subprocess.TimeoutExpired:
        return ("hung",)
    return (r.returncode, r.stdout)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """built(rule) -> (original, rewrite with the rule on, with it off, check lines on, off)."""
    cache = {}

    def get(rule):
        if rule not in cache:
            src, flags, spec_text, handlers, _ = PROGRAMS[rule]
            tmp = tmp_path_factory.mktemp(rule)
            prog = cc(tmp, rule, src, *flags)
            spec = write_spec(tmp, spec_text, handlers)
            on = instrument(prog, spec, tmp / f"{rule}.on")
            env = {**TREE_ENV, safety.OFF_VAR: rule}
            off = tmp / f"{rule}.off"
            r = subprocess.run([*KPREWRITE, "instrument", prog, "--spec", spec, "-o", off], capture_output=True,
                               text=True, env=env)
            assert r.returncode == 0, r.stderr
            r = subprocess.run([*KPREWRITE, "check", prog, "--spec", spec], capture_output=True, text=True, env=env)
            cache[rule] = (prog, on, off, check_lines(prog, spec), r.stdout)
        return cache[rule]
    return get


def _prove(built, rule: str) -> tuple:
    prog, on, off, check_on, check_off = built(rule)
    cpu_max = PROGRAMS[rule][4]
    want = _run(prog, cpu_max)
    assert want[0] == 0, want
    assert _run(on, cpu_max) == want, check_on
    assert _run(off, cpu_max) != want, f"{rule} switched off, the program still runs right:\n" \
                                       f"on:  {check_on}\noff: {check_off}"
    return check_on, check_off


def test_exclusive_monitor(built):
    on, off = _prove(built, "exclusive_monitor")
    assert on[0].startswith("inc+0x4  k  refused  can_probe at "), on     # skipped: inside the sequence
    assert off.startswith("inc+0x4  k  int3"), off


def test_pc_relative(built):
    on, off = _prove(built, "pc_relative")
    assert on == ["get+0x0  k  optimized"], on


def test_landing_pad(built):
    on, off = _prove(built, "landing_pad")
    assert on[0].startswith("mid+0x0  k  int3  landing_pad at "), on
    assert off.startswith("mid+0x0  k  optimized"), off


def test_entry_frame(built):
    """aarch64.retprobe.entry_frame_refusal(): workpart's CFA is sp+16 (the register is sp, as
    at an entry, but not its offset): refused, not placed."""
    on, off = _prove(built, "entry_frame")
    assert on[0].startswith("workpart+0x0  r  refused  entry_frame at ") and "sp+16" in on[0], on
    assert off.startswith("workpart+0x0  r  optimized"), off


def test_trampoline_unsafe(built):
    on, off = _prove(built, "trampoline_unsafe")
    kret = next(l for l in on if l.startswith("cramped+0x0  r  "))
    assert "returns: 0x" in kret and "(int3)" in kret and "no trampoline: trampoline_unsafe at " in kret \
        and "ldr x1, [x29, #8]" in kret and "addresses x30's slot" in kret, on
    assert "cramped+0x0  r  " in off and "returns: trampoline" in off, off


# GCC's own code for __builtin_return_address(0) in a leaf: stp x29, x30 (a frame
# record), xpaclri, then `str x30, [x1, #:lo12:seen]` while x30 still holds the
# return address.  Out of reach as cramped is: a brk return hook, not the trampoline.
LEAF = r"""
#include <stdio.h>
void *seen;
__attribute__((noinline)) long leaf(long x) { seen = __builtin_return_address(0); return x + 1; }
__attribute__((noinline, used, section(".fartext"))) long far_fn(long a) { return a + 1; }
int main(void)
{
    long s = 0;
    int ra_ok = 1;
    for (long i = 0; i < 3; i++) {
        s += leaf(i);
        ra_ok &= (char *)seen > (char *)main && (char *)seen < (char *)main + 400;
    }
    printf("s=%ld ra_ok=%d\n", s, ra_ok);
    return 0;
}
"""


def test_trampoline_unsafe_reads_x30(tmp_path):
    prog = cc(tmp_path, "leaf", LEAF, "-O2", "-no-pie", "-Wl,--section-start=.fartext=0x10000000")
    spec = write_spec(tmp_path, probe_spec("kretprobe", ["leaf"], handlers=False))
    line = check_lines(prog, spec)[0]
    assert "(int3)" in line and "no trampoline: trampoline_unsafe at " in line and "reads x30 while it holds the " \
        "return address" in line, line
    want = _run(prog, False)
    assert want == (0, "s=6 ra_ok=1\n"), want
    assert _run(instrument(prog, spec, tmp_path / "leaf.on"), False) == want
    off = tmp_path / "leaf.off"
    r = subprocess.run([*KPREWRITE, "instrument", prog, "--spec", spec, "-o", off], capture_output=True, text=True,
                       env={**TREE_ENV, safety.OFF_VAR: "trampoline_unsafe"})
    assert r.returncode == 0, r.stderr
    assert _run(off, False) == (0, "s=6 ra_ok=0\n")
