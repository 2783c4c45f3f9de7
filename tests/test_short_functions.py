"""Functions shorter than the 5-byte jump borrow the alignment padding after
them (optprobe._borrow_padding()): nop or int3 bytes that no symbol,
FDE, relocation or jump names.  One function falls through its padding into the
next, so the padding's copy runs; one has padding a jump lands in, and one has
none: those two cannot borrow (func_size), and take a short jump to a 5-byte
jump in dead padding nearby instead (planner.short_jumps.short_jumps()), never into the
padding the jump lands in."""
from __future__ import annotations

import pytest

from conftest import cc, check_lines, instrument, meta, profile, run, symbols, write_spec

ARCHES = ["x86_64"]      # x86-64 only: x86-64's 5-byte jump borrowing padding

PROGRAM = r"""
__asm__(
".text\n"
/* 3 bytes, then nop padding. */
".p2align 4\n.globl tiny_nop\n.type tiny_nop,@function\ntiny_nop:\n"
"  lea 1(%rdi),%eax\n"
"  ret\n"
".size tiny_nop,.-tiny_nop\n"
/* 4 bytes, then int3 padding after the ret. */
".p2align 4,0xcc\n.globl tiny_int3\n.type tiny_int3,@function\ntiny_int3:\n"
"  lea (%rdi,%rdi,2),%eax\n"
"  ret\n"
".size tiny_int3,.-tiny_int3\n"
".p2align 4,0xcc\n"
/* 2 bytes that fall through their padding into the next function. */
".globl falls\n.type falls,@function\nfalls:\n"
"  mov %edi,%eax\n"
".size falls,.-falls\n"
".p2align 3\n"
".globl after\n.type after,@function\nafter:\n"
"  add $5,%eax\n"
"  ret\n"
".size after,.-after\n"
/* Padding a jump lands in: it is code, not padding. */
".p2align 4\n.globl pad_target\n.type pad_target,@function\npad_target:\n"
"  test %edi,%edi\n"
"  ret\n"
".size pad_target,.-pad_target\n"
"1: nop\n  nop\n  nop\n  nop\n  nop\n  nop\n"
"  mov $7,%eax\n  ret\n"
".globl jumps_in\n.type jumps_in,@function\njumps_in:\n"
"  jmp 1b\n"
".size jumps_in,.-jumps_in\n"
/* No padding: the next function starts right after it. */
".p2align 4\n.globl no_pad\n.type no_pad,@function\nno_pad:\n"
"  xor %eax,%eax\n"
"  ret\n"
".size no_pad,.-no_pad\n"
".globl next_fn\n.type next_fn,@function\nnext_fn:\n"
"  mov $9,%eax\n"
"  ret\n"
".size next_fn,.-next_fn\n"
);
#include <stdio.h>
#include <stdlib.h>
int tiny_nop(int), tiny_int3(int), falls(int), pad_target(int), jumps_in(void), no_pad(void), next_fn(void);
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 3;
    long t = 0;
    for (int i = 0; i < n; i++)
        t += tiny_nop(i) * 3 + tiny_int3(i) * 5 + falls(i) * 7 + pad_target(i) + jumps_in() * 11 + no_pad() + next_fn();
    printf("t=%ld\n", t);
    return 0;
}
"""

FUNCS = ["tiny_nop", "tiny_int3", "falls", "pad_target", "no_pad"]


def _build(tmp, pie):
    prog = cc(tmp, "short", PROGRAM, "-O2", *(["-fpie", "-pie"] if pie else ["-fno-pie", "-no-pie"]))
    spec = write_spec(tmp, "".join(f'[[kprobe]]\nsymbol_name = "{f}"\n' for f in FUNCS))
    return prog, check_lines(prog, spec), instrument(prog, spec, tmp / "short.kp")


@pytest.mark.parametrize("pie", [True, False], ids=["pie", "nopie"])
def test_short_functions_borrow_padding(once, pie, runner):
    prog, check, out = once(_build, pie)
    d = dict(zip(FUNCS, check))
    for f in ["tiny_nop", "tiny_int3", "falls"]:
        assert d[f].split("  ")[2] == "optimized", d[f]
    # No padding to borrow: a short jump to a slot in dead padding (after a ret).
    slots = {p["symbol"]: p.get("jump_slot") for p in meta(out)["probes"]}
    s = symbols(prog)
    for f in ["pad_target", "no_pad"]:
        assert d[f].split("  ")[2] == "optimized", d[f]
        assert slots[f] and abs(slots[f] - (s[f] + 2)) <= 127, slots
    # Not in the padding `jumps_in` lands in, nor in anything reached.
    assert not s["pad_target"] < slots["pad_target"] < s["jumps_in"], slots
    assert not s["pad_target"] < slots["no_pad"] < s["jumps_in"], slots
    want = run(prog, 9, runner=runner)
    assert want.returncode == 0
    got = run(out, 9, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert got.returncode == 0 and got.stdout == want.stdout, got.stdout + got.stderr[-2000:]
    assert {k: v[0] for k, v in profile(got.stderr).items()} == {f"p_{f}_0": 9 for f in FUNCS}
    # The padding the jump took: the jmp's last bytes lie past the function's end.
    assert s["after"] - s["falls"] >= 5
