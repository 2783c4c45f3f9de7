"""Neighbour eviction (planner.short_jumps.evict_neighbour(), optprobe.can_evict()):
E9Patch's T3 for a probe whose region cannot reach 5 bytes and which has no
dead padding within a short jump's reach.  A neighbouring region N is moved to
a detour of its own (its start jumps there; its copy runs and jumps back to its
end), and the probe's 5-byte jump goes in N's second 5 bytes, dead once nothing
but N's start leads into N.

The program keeps every other place out of reach or unusable: its code is
surrounded by runs of calls (no region of 10 bytes holds a call only last) and
holds no padding at all.  `bump` and `nb` have CFI, so direct branches to
`bump` are retargeted to its detour (planner.retarget.retarget_branches()), except the
one inside the evicted region.

* `tgt` is entered 3 bytes in by `tgt_in`; `nb`, right after it and called by
  main, can be evicted: its region ends with a call of the probed `bump`, whose
  rel32 a retargeting pass must leave alone (N's bytes are patched).  Every
  hit of `tgt` and `bump` must match the same probes as breakpoints, and `nb`'s
  copy must compute what `nb` does (the output).
* `tgt2`'s only neighbour that passes the other checks, `nb2`, has a jump target
  (from `nb2_in`) exactly where the probe's jump would go: evicting it would
  send `nb2_in`'s callers through `tgt2`'s probe and body.  It stays an int3
  probe with the kernel's reason.
* `tgt3`'s only candidate, `nb3`, is a loop: it stays an int3 probe, since an
  evicted loop body would take two jumps on every iteration."""
from __future__ import annotations

import pytest

from conftest import cc, instrument, meta, oracle_runs, profile, symbols, with_oracle

ARCHES = ["x86_64"]      # x86-64 only: x86-64 assembly (neighbour eviction for 5-byte jumps)

CALLS = "  .rept 34\n  call nop_fn\n  .endr\n  ret\n"

PROGRAM = r"""
__asm__(
".text\n"
".p2align 6\n"
".globl filler_a\n.type filler_a,@function\nfiller_a:\n@CALLS@.size filler_a,.-filler_a\n"
".globl nop_fn\n.type nop_fn,@function\nnop_fn:\n  ret\n.size nop_fn,.-nop_fn\n"
".globl bump\n.type bump,@function\nbump:\n  .cfi_startproc\n"
"  mov %edi,%eax\n  add $1,%eax\n  add $2,%eax\n  ret\n  .cfi_endproc\n"
".size bump,.-bump\n"
".globl tgt_in\n.type tgt_in,@function\ntgt_in:\n"
"  mov %edi,%eax\n  jmp 5f\n"
".size tgt_in,.-tgt_in\n"
/* The probe: a jump target 3 bytes in. */
".globl tgt\n.type tgt,@function\ntgt:\n"
"  lea 2(%rdi),%eax\n"
"5: add %eax,%eax\n  add $3,%eax\n  ret\n"
".size tgt,.-tgt\n"
/* The neighbour to evict: [nb, nb + 11), a call last. */
".globl nb\n.type nb,@function\nnb:\n  .cfi_startproc\n"
"  push %rbx\n  .cfi_adjust_cfa_offset 8\n  .cfi_offset %rbx,-16\n"
"  mov %edi,%ebx\n  imul $7,%edi,%edi\n  call bump\n"
"  add %ebx,%eax\n  pop %rbx\n  .cfi_adjust_cfa_offset -8\n  .cfi_restore %rbx\n  ret\n  .cfi_endproc\n"
".size nb,.-nb\n"
".globl filler_b\n.type filler_b,@function\nfiller_b:\n@CALLS@.size filler_b,.-filler_b\n"
".globl filler_c\n.type filler_c,@function\nfiller_c:\n@CALLS@.size filler_c,.-filler_c\n"
/* The second probe: a jump target 3 bytes in, and its neighbour nb2 has a jump
   target at nb2 + 5, where the evicted region's second jump would go. */
".globl nb2_in\n.type nb2_in,@function\nnb2_in:\n"
"  mov %edi,%eax\n  jmp 6f\n"
".size nb2_in,.-nb2_in\n"
".globl tgt2_in\n.type tgt2_in,@function\ntgt2_in:\n"
"  mov %edi,%eax\n  jmp 7f\n"
".size tgt2_in,.-tgt2_in\n"
".globl tgt2\n.type tgt2,@function\ntgt2:\n"
"  lea 4(%rdi),%eax\n"
"7: add %eax,%eax\n  add $5,%eax\n  ret\n"
".size tgt2,.-tgt2\n"
".globl nb2\n.type nb2,@function\nnb2:\n"
"  mov %edi,%eax\n  imul $5,%eax,%eax\n"
"6: add $9,%eax\n  xor $0x3c,%eax\n  add %edi,%eax\n  ret\n"
".size nb2,.-nb2\n"
".globl filler_d\n.type filler_d,@function\nfiller_d:\n@CALLS@.size filler_d,.-filler_d\n"
/* The third probe: its only neighbour, nb3, is a loop: evicted, every iteration
   would take two jumps for no probe (planner.short_jumps.in_loop()). */
".globl tgt3_in\n.type tgt3_in,@function\ntgt3_in:\n"
"  mov %edi,%eax\n  jmp 8f\n"
".size tgt3_in,.-tgt3_in\n"
".globl tgt3\n.type tgt3,@function\ntgt3:\n"
"  lea 6(%rdi),%eax\n"
"8: add %eax,%eax\n  add $7,%eax\n  ret\n"
".size tgt3,.-tgt3\n"
".globl nb3\n.type nb3,@function\nnb3:\n"
"  mov %edi,%eax\n"
"9: add $3,%eax\n  imul $3,%eax,%eax\n  and $0xffff,%eax\n  sub $1,%edi\n  jg 9b\n  ret\n"
".size nb3,.-nb3\n"
".globl filler_e\n.type filler_e,@function\nfiller_e:\n@CALLS@.size filler_e,.-filler_e\n"
);
#include <stdio.h>
#include <stdlib.h>
int bump(int), tgt(int), tgt_in(int), nb(int), tgt2(int), tgt2_in(int), nb2(int), nb2_in(int);
int tgt3(int), tgt3_in(int), nb3(int);
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 3;
    long t = 0;
    for (int i = 0; i < n; i++) {
        t = t * 3 + tgt(i) + 5 * tgt_in(i) + 7 * nb(i) + 11 * bump(i);
        t = t * 5 + tgt2(i) + 13 * tgt2_in(i) + 17 * nb2(i) + 19 * nb2_in(i);
        t = t * 7 + tgt3(i) + 23 * tgt3_in(i) + 29 * nb3(i % 9);
        t %= 1000000007;
    }
    printf("t=%ld\n", t);
    return 0;
}
""".replace("@CALLS@", CALLS.replace("\n", "\\n"))

PROBED = ["tgt", "bump", "tgt2", "tgt3"]
BUILDS = {"pie": ["-O2", "-fpie", "-pie"], "nopie": ["-O2", "-fno-pie", "-no-pie"]}


def _build(tmp, build):
    prog = cc(tmp, f"evict_{build}", PROGRAM, *BUILDS[build])
    return (prog, *with_oracle(tmp, prog, PROBED))


@pytest.mark.parametrize("build", list(BUILDS))
def test_evicted_neighbour(once, build, runner):
    prog, check, opt, oracle = once(_build, build)
    d = dict(zip(PROBED, check))
    s = symbols(prog)
    probes = {p["symbol"]: p for p in meta(opt)["probes"]}
    # tgt: a short jump to the second half of nb, moved to a detour of its own.
    assert d["tgt"].split("  ")[2] == "optimized", d["tgt"]
    ev = probes["tgt"].get("evicted")
    assert ev is not None and ev[:2] == [s["nb"], s["nb"] + 11], (probes["tgt"], s["nb"])
    assert probes["tgt"]["jump_slot"] == s["nb"] + 5
    # nb's call of bump (at nb + 6, inside the evicted region) keeps naming bump.
    branches = meta(opt).get("branches") or []
    assert any(t == s["bump"] for _, _, t in branches), branches      # main's call is retargeted
    assert not any(ev[0] <= src < ev[1] for src, _, _ in branches), branches
    # tgt2: its only candidate has a jump target where the jump would go.
    assert "int3" in d["tgt2"] and "jump_into_region" in d["tgt2"], d["tgt2"]
    assert "evicted" not in probes["tgt2"] and "jump_slot" not in probes["tgt2"], probes["tgt2"]
    # tgt3: its only candidate lies on a loop.
    assert "int3" in d["tgt3"] and "evicted" not in probes["tgt3"], (d["tgt3"], probes["tgt3"])
    want, got, ref = oracle_runs(prog, opt, oracle, runner, 40)
    hits = profile(got.stderr)
    assert hits == profile(ref.stderr), (hits, profile(ref.stderr))
    assert hits["p_tgt_0"][0] == 40 and hits["p_tgt2_0"][0] == 40 and hits["p_bump_0"][0] == 80, hits
    assert hits["p_tgt3_0"][0] == 40, hits


def test_eviction_is_deterministic(once):
    prog, _, opt, _ = once(_build, "pie")
    again = instrument(prog, opt.parent / "probes.toml", opt.parent / "again")
    assert again.read_bytes() == opt.read_bytes()
