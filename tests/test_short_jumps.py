"""A short jump to a 5-byte jump in dead padding (planner.short_jumps.short_jumps(),
optprobe.short_jump_slot()): E9Patch's tactic for a probe whose region cannot
reach 5 bytes.  The program is glibc's memmove/mempcpy pattern: `move` is
entered 3 bytes in by `pcopy`'s tail jump, so its entry's 5-byte region holds a
jump target.  Nearby padding of three kinds surrounds it, and only one may hold
the slot:

* `falls` runs into the nop padding after it (no exit before it): a slot there
  would be executed;
* `landing`'s padding holds a label `tail` jumps to: a slot there would be
  jumped into;
* `pcopy`'s padding follows its unconditional jmp and nothing names it: dead.

Each wrong choice changes the output or crashes; hit counts must equal the
same probes as breakpoints (--no-optimize), natively and under QEMU.  `far`
has a jump target 3 bytes in and no dead padding within a short jump's reach:
the region from that target on is evicted (planner.short_jumps.evict_neighbour()), and
the slot goes in its dead second half."""
from __future__ import annotations

import pytest

from conftest import cc, meta, oracle_runs, profile, symbols, with_oracle

ARCHES = ["x86_64"]      # x86-64 only: x86-64's 2-byte short jump to a 5-byte jump

PROGRAM = r"""
__asm__(
".text\n"
/* Falls into its padding (its caller reads %eax after the next function). */
".p2align 6\n.globl falls\n.type falls,@function\nfalls:\n"
"  lea 3(%rdi),%eax\n"
".size falls,.-falls\n"
"  .nops 24\n"
".globl falls_next\n.type falls_next,@function\nfalls_next:\n"
"  add $100,%eax\n"
"  ret\n"
".size falls_next,.-falls_next\n"
/* Padding a jump lands in. */
".globl landing\n.type landing,@function\nlanding:\n"
"  lea 7(%rdi),%eax\n"
"  ret\n"
".size landing,.-landing\n"
"2: .nops 12\n"
"  add $1000,%eax\n"
"  ret\n"
".globl tail\n.type tail,@function\ntail:\n"
"  mov %edi,%eax\n"
"  jmp 2b\n"
".size tail,.-tail\n"
/* mempcpy: returns dst + n by entering move after its first instruction. */
".globl pcopy\n.type pcopy,@function\npcopy:\n"
"  mov %rdi,%rax\n"
"  add %rdx,%rax\n"
"  jmp 1f\n"
".size pcopy,.-pcopy\n"
"  .nops 16\n"
/* memmove: returns dst; a byte loop stands for the copy. */
".globl move\n.type move,@function\nmove:\n"
"  mov %rdi,%rax\n"
"1: test %rdx,%rdx\n"
"  je 3f\n"
"  xor %ecx,%ecx\n"
"4: movzbl (%rsi,%rcx),%r8d\n"
"  mov %r8b,(%rdi,%rcx)\n"
"  inc %rcx\n"
"  cmp %rdx,%rcx\n"
"  jne 4b\n"
"3: ret\n"
".size move,.-move\n"
/* A jump target 3 bytes in and no dead padding within reach (200 bytes of
   code each side, no exit before the padding that is there). */
".p2align 4\n.globl far_before\n.type far_before,@function\nfar_before:\n"
"  .rept 50\n  add $1,%eax\n  .endr\n"
"  mov %edi,%eax\n"
"  jmp 5f\n"
".size far_before,.-far_before\n"
".globl far\n.type far,@function\nfar:\n"
"  lea 2(%rdi),%eax\n"
"5: add %eax,%eax\n"
"  .rept 50\n  add $1,%eax\n  .endr\n"
"  ret\n"
".size far,.-far\n"
);
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int falls(int), landing(int), tail(int), far(int), far_before(int);
char *pcopy(char *, const char *, unsigned long), *move(char *, const char *, unsigned long);
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 3;
    long t = 0;
    char buf[64], src[64];
    for (int i = 0; i < 64; i++) src[i] = 'a' + i % 26;
    for (int i = 0; i < n; i++) {
        memset(buf, 0, sizeof buf);
        char *end = pcopy(buf, src, 10 + i % 7);
        char *m = move(buf + 20, src + 3, 5 + i % 5);
        t += (end - buf) * 3 + (m - buf) + buf[i % 30];
        t += falls(i) * 5 + landing(i) * 7 + tail(i) * 11 + far(i) * 13 + far_before(i);
    }
    printf("t=%ld buf=%.30s\n", t, buf);
    return 0;
}
"""

FUNCS = ["falls", "landing", "tail", "pcopy", "move", "far_before", "far"]
BUILDS = {"pie": ["-O2", "-fpie", "-pie"], "nopie": ["-O2", "-fno-pie", "-no-pie"],
          "static": ["-O2", "-static"]}


def _build(tmp, build):
    prog = cc(tmp, f"short_{build}", PROGRAM, *BUILDS[build], skip_without_static=build == "static")
    return (prog, *with_oracle(tmp, prog, FUNCS))


@pytest.mark.parametrize("build", list(BUILDS))
def test_short_jump_to_dead_padding(once, build, runner):
    prog, check, opt, oracle = once(_build, build)
    d = dict(zip(FUNCS, check))
    s = symbols(prog)
    slots = {p["symbol"]: p.get("jump_slot") for p in meta(opt)["probes"]}
    # move's region stops at the label 3 bytes in: a short jump to pcopy's padding,
    # the only dead padding (after an unconditional jmp) within reach.
    assert d["move"].split("  ")[2] == "optimized", d["move"]
    assert s["pcopy"] < slots["move"] < s["move"] and slots["move"] + 5 <= s["move"], (slots, s)
    # No slot in the padding `falls` runs into, nor in the one `tail` jumps into.
    for f, at in slots.items():
        assert at is None or not (s["falls"] <= at + 4 and at < s["falls_next"]), (f, at, s)
        assert at is None or not (s["landing"] + 4 <= at + 4 and at < s["tail"]), (f, at, s)
    # far: nothing dead within reach, so its neighbour from the label on is evicted
    # (tests/test_eviction.py): the jump there still leads to that region's copy.
    assert d["far"].split("  ")[2] == "optimized", d["far"]
    ev = next(p for p in meta(opt)["probes"] if p["symbol"] == "far").get("evicted")
    assert ev is not None and ev[0] == s["far"] + 3 and slots["far"] == ev[0] + 5, (ev, slots["far"], s["far"])
    want, got, ref = oracle_runs(prog, opt, oracle, runner, 40)
    hits = profile(got.stderr)
    assert hits == profile(ref.stderr) and hits["p_move_0"][0] == 40 and hits["p_pcopy_0"][0] == 40 \
        and hits["p_far_0"][0] == 40
