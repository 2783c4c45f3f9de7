"""Kretprobes on every function at their floor.

A stripped library's hot/cold split functions: the cold blocks have FDEs of
their own that start mid-frame (CFA %rsp+N, N > 8) and no `.cold` name; a
kretprobe there is refused by its CFA rule (entry_frame), and the hot part's
exits include its cold block's, as for a named `.cold` part.  Exits no jump
fits take the entry's region or the trampoline, a breakpoint only where the
trampoline is unsafe."""
from __future__ import annotations

import json
import re
import subprocess

from elftools.elf.elffile import ELFFile

from conftest import CC, cc, check_lines, instrument, kprewrite, meta, oracle_runs, profile, run, symbols, write_spec

ARCHES = ["x86_64"]      # x86-64 only: x86-64 assembly (exits with and without a 5-byte region)

LIB = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
__attribute__((noinline, cold)) void lib_warn(const char *what, long v) { fprintf(stderr, "warn %s %ld\n", what, v); }
long lib_sum(const int *a, int n) {
    long s = 0;
    for (int i = 0; i < n; i++) {
        if (__builtin_expect(a[i] < 0, 0)) {
            lib_warn("negative", a[i]);
            s -= a[i] * 2;
            continue;
        }
        s += a[i];
    }
    return s;
}
char *lib_join(const char *x, const char *y) {
    size_t n = strlen(x), m = strlen(y);
    char *r = malloc(n + m + 2);
    if (__builtin_expect(r == NULL, 0)) {
        lib_warn("oom", (long)(n + m));
        abort();
    }
    memcpy(r, x, n); r[n] = '/'; memcpy(r + n + 1, y, m + 1);
    return r;
}
int lib_classify(int v) {
    if (__builtin_expect(v > 1000000, 0)) {
        lib_warn("huge", v);
        return v % 7 + lib_classify(v / 1000);
    }
    return v & 3;
}
"""

MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
long lib_sum(const int *a, int n); char *lib_join(const char *x, const char *y); int lib_classify(int v);
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 100;
    int *a = malloc(n * sizeof *a);
    for (int i = 0; i < n; i++) a[i] = (i % 37 == 5) ? -i : i;
    long t = lib_sum(a, n);
    for (int i = 0; i < n; i++) t += lib_classify(i * 40503);
    char *j = lib_join("abc", "defg");
    printf("t=%ld j=%s\n", t, j);
    free(j); free(a);
    return 0;
}
"""


def _build_split(tmp):
    (tmp / "lib.c").write_text(LIB)
    lib = tmp / "libhc.so"
    subprocess.run([CC, "-O2", "-fPIC", "-shared", "-freorder-blocks-and-partition", str(tmp / "lib.c"),
                    "-o", str(lib)], check=True)
    subprocess.run(["strip", str(lib)], check=True)
    prog = cc(tmp, "main", MAIN, "-O2", f"-L{tmp}", "-lhc")
    # maxactive: instances and hooked exits (without it, nothing to run at the returns: light)
    spec = write_spec(tmp, '[[kretprobe]]\nsymbol_name = "*"\nmaxactive = 20\n')
    outs = {}
    for name, extra in (("opt", ()), ("int3", ("--no-optimize",))):
        (tmp / name).mkdir()
        outs[name] = instrument(lib, spec, tmp / name / "libhc.so", *extra)
    return prog, lib, check_lines(lib, spec), outs


def test_stripped_cold_parts_refused_by_their_cfa_rule(once, runner):
    prog, lib, check, outs = once(_build_split)
    cold = [l for l in check if re.match(r"sub_[0-9a-f]+\+0x0  r  refused  entry_frame at ", l)]
    # Three cold blocks (one per function with an unlikely path), each refused by its CFA rule.
    assert len(cold) == 3, "\n".join(check)
    assert all("is %rsp+" in l and "not %rsp+8" in l for l in cold), cold
    # The hot parts follow their cold blocks as .cold parts: every exit hooked, no trampoline.
    for f in ("lib_sum", "lib_join", "lib_classify"):
        line = next(l for l in check if l.startswith(f + "+0x0"))
        assert "  optimized  returns: 0x" in line and "trampoline" not in line and "int3" not in line, line
    want = run(prog, 200, runner=runner, libdir=lib.parent)
    assert want.returncode == 0 and "warn huge" in want.stderr, want.stderr
    counts = {}
    for name, out in outs.items():
        got = run(prog, 200, runner=runner, libdir=out.parent, env={"KPREWRITE_PROFILE": "-"})
        assert got.returncode == 0 and got.stdout == want.stdout, got.stdout + got.stderr[-2000:]
        counts[name] = profile(got.stderr)
    assert counts["opt"] == counts["int3"] and counts["opt"]["r_lib_classify_0"][0] >= 200, counts


# --- No breakpoint where something cheaper is correct -------------------------------------
#
# Exits that no region of their own can take: a `ret` reached only through a
# shared epilogue (`pop %rbx; ret`, the pop a jump target), a `ret` three jumps
# land on, both with code right after them (no padding): the trampoline; the same
# with no CFI (where the return address lives is unknown): the breakpoint; a
# region that takes a `js` before the `ret`; and a 6-byte function at the end of
# .text whose entry region grows to take its `ret`.
# The oracle: breakpoint kprobes (--no-optimize) on each function's `ret`, whose
# handler reads %rax there.

FLOOR = r"""
__asm__(
".text\n"
".globl shared_epi\n.type shared_epi,@function\nshared_epi:\n"
"  .cfi_startproc\n"
"  push %rbx\n"
"  .cfi_def_cfa_offset 16\n"
"  .cfi_offset %rbx, -16\n"
"  mov %edi,%ebx\n"
"  test %edi,%edi\n"
"  js 1f\n"
"  call helper\n"
"  add %ebx,%eax\n"
"  jmp 2f\n"
"1:lea 7(%rdi),%eax\n"
"  jmp 2f\n"
"2:pop %rbx\n"
"  .cfi_def_cfa_offset 8\n"
"  ret\n"
"  .cfi_endproc\n"
".size shared_epi,.-shared_epi\n"
/* The same with no CFI: where its return address lives is unknown, so no trampoline. */
".globl no_cfi\n.type no_cfi,@function\nno_cfi:\n"
"  mov %edi,%eax\n"
"  cmp $10,%edi\n"
"  jl 4f\n"
"  sub $3,%eax\n"
"  cmp $20,%edi\n"
"  jl 4f\n"
"  add %eax,%eax\n"
"  test $1,%edi\n"
"  jne 4f\n"
"  add $5,%eax\n"
"4:ret\n"
".size no_cfi,.-no_cfi\n"
".globl three_way\n.type three_way,@function\nthree_way:\n"
"  .cfi_startproc\n"
"  mov %edi,%eax\n"
"  cmp $10,%edi\n"
"  jl 3f\n"
"  sub $3,%eax\n"
"  cmp $20,%edi\n"
"  jl 3f\n"
"  add %eax,%eax\n"
"  test $1,%edi\n"
"  jne 3f\n"
"  add $5,%eax\n"
"3:ret\n"
"  .cfi_endproc\n"
".size three_way,.-three_way\n"
/* Code right after three_way's ret: no padding to borrow. */
".globl filler\n.type filler,@function\nfiller:\n"
"  xor %eax,%eax\n"
"  ret\n"
".size filler,.-filler\n"
/* A region that takes a conditional jump before the ret (re-encoded in the detour). */
".globl jcc_ret\n.type jcc_ret,@function\njcc_ret:\n"
"  .cfi_startproc\n"
"  mov %edi,%eax\n"
"  test %edi,%edi\n"
"  js 5f\n"
"  ret\n"
"5:lea 3(%rdi,%rdi,2),%eax\n"
"  ret\n"
"  .cfi_endproc\n"
".size jcc_ret,.-jcc_ret\n"
/* `std`: no jump into this function (its detours do not keep DF), the entry is a
 * breakpoint (its kretprobe keeps the instance); its exit is a tail call to tiny6. */
".globl heavy_tail\n.type heavy_tail,@function\nheavy_tail:\n"
"  .cfi_startproc\n"
"  std\n"
"  cld\n"
"  lea 1(%rdi),%eax\n"
"  mov %eax,%edi\n"
"  jmp tiny6\n"
"  .cfi_endproc\n"
".size heavy_tail,.-heavy_tail\n"
/* A tail call into heavy_tail, from the same return-address slot. */
".globl light_tail\n.type light_tail,@function\nlight_tail:\n"
"  .cfi_startproc\n"
"  add $1,%edi\n"
"  jmp heavy_tail\n"
"  .cfi_endproc\n"
".size light_tail,.-light_tail\n"
/* Last in .text: a section of its own, after this file's .text (helper()) and libc's crt code. */
".pushsection .text.zzz_last,\"ax\",@progbits\n"
".globl tiny6\n.type tiny6,@function\ntiny6:\n"
"  .cfi_startproc\n"
"  lea 0x1(%rdi,%rdi,1),%rax\n"
"  ret\n"
"  .cfi_endproc\n"
".size tiny6,.-tiny6\n"
".popsection\n"
);
#include <stdio.h>
#include <stdlib.h>
int shared_epi(int), three_way(int), no_cfi(int), jcc_ret(int);
long tiny6(long), light_tail(long);
__attribute__((noinline)) int helper(int x) { __asm__ volatile(""); return x * 2; }
/* Recursion deeper than the default maxactive (10): the instance pool runs dry. */
__attribute__((noinline)) int deep(int n) {
    if (n <= 0) return 1;
    int r = deep(n - 1);    /* no accumulator: gcc cannot turn it into a loop */
    return r ^ (r >> 1) ^ n;
}
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 30;
    long t = 0;
    for (int i = -5; i < n; i++)
        t = t * 3 + shared_epi(i) + three_way(i) + tiny6(i) + no_cfi(i + 1) + jcc_ret(i - 7) + deep(i & 15)
            + light_tail(i);
    printf("t=%ld\n", t);
    return 0;
}
"""

FLOOR_FUNCS = ["shared_epi", "three_way", "no_cfi", "jcc_ret", "tiny6"]

RET_HANDLER = r"""
#include <kprewrite/kprobes.h>
int on_return(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	pr_info("R %s %ld\n", ri->rp->kp.symbol_name, (long)regs_return_value(regs));
	return 0;
}
int at_ret(struct kprobe *p, struct pt_regs *regs)
{
	pr_info("R %s %ld\n", p->symbol_name, (long)regs->ax);
	return 0;
}
"""


def _build_floor(tmp):
    from conftest import insns, probe_spec
    prog = cc(tmp, "floor", FLOOR, "-O2", "-Wl,-z,norelro")
    kret = write_spec(tmp, probe_spec("kretprobe", FLOOR_FUNCS, handler="on_return"), RET_HANDLER, "kret.toml")
    rets = [(f, off) for f in FLOOR_FUNCS for off, i in insns(prog, f) if i.mnemonic == "ret"]
    oracle = write_spec(tmp, probe_spec("kprobe", rets, pre_handler="at_ret"), RET_HANDLER, "oracle.toml")
    return (prog, rets, check_lines(prog, kret), instrument(prog, kret, tmp / "kret"),
            instrument(prog, oracle, tmp / "oracle", "--no-optimize"))


def _returns(stderr: str):
    from collections import Counter
    return Counter(l for l in stderr.splitlines() if l.startswith("R "))


def test_exits_without_a_region_take_no_breakpoint(once, runner):
    prog, rets, check, kret, oracle = once(_build_floor)
    lines = {l.split("+")[0]: l for l in check}
    assert len(rets) == 6, rets
    # The 6-byte function ends .text; its entry's region takes the ret.
    text = next(x for x in ELFFile(open(prog, "rb")).iter_sections() if x.name == ".text")
    assert symbols(prog)["tiny6"] + 6 == text["sh_addr"] + text["sh_size"]
    assert "returns: 0x" in lines["tiny6"] and "int3" not in lines["tiny6"] \
        and "trampoline" not in lines["tiny6"], lines["tiny6"]
    # `test; js; ret`: the js goes with the region, re-encoded.
    assert re.search(r"returns: 0x[0-9a-f]+ ret, 0x[0-9a-f]+ ret$", lines["jcc_ret"]), lines["jcc_ret"]
    # No region fits shared_epi's ret (its pop is a jump target, and the jump's own region
    # would take a call): the trampoline (no call out that an exception could unwind through
    # here), with the checks that refused the regions, not a breakpoint.
    assert "returns: trampoline  jump_into_region at " in lines["shared_epi"] \
        and "; the jumps there not hooked: can_boost at " in lines["shared_epi"] \
        and "int3" not in lines["shared_epi"], lines["shared_epi"]
    # A ret three jumps land on: the first takes a region that starts at it (one that ends
    # with it would overlap the entry's), the second one that ends with it, the third lies
    # in the ret's own region (its copy goes to the hook); with CFI or without.  Where no such jump can be hooked and the
    # trampoline is unsafe, a breakpoint: test_jumps_landing_on_a_ret_are_hooked_as_exits.
    for f in ("three_way", "no_cfi"):
        assert re.search(r"returns: 0x[0-9a-f]+ ret \(and the jumps at 0x[0-9a-f]+, 0x[0-9a-f]+\)$", lines[f]), lines[f]
    want, got, ref = oracle_runs(prog, kret, oracle, runner, 40)
    mine, theirs = _returns(got.stderr), _returns(ref.stderr)
    # tiny6 is also tail-called from heavy_tail (through light_tail): 45 more returns.
    assert sum(mine.values()) == 6 * 45 and mine == theirs, (mine - theirs, theirs - mine)
    hits = {k: v[0] for k, v in profile(got.stderr).items()}
    assert hits == {f"r_{f}_0": 90 if f == "tiny6" else 45 for f in FLOOR_FUNCS}, hits


# --- Light kretprobes: nothing to run at the returns --------------------------------------
#
# With no handler, entry_handler, data_size, fetch or maxactive (and no handler in the
# image), a kretprobe's entry only counts the hit and nothing runs at its exits: no
# instance, no hook, no trampoline, no breakpoint -- whatever form its exits would have
# needed (a shared epilogue, a ret three jumps land on, a 6-byte function ending .text,
# a function without CFI).  The oracle is the same spec as breakpoints (--no-optimize:
# pre_handler_kretprobe() at a breakpoint entry, instances, breakpoint return hooks):
# the hits are equal, and so is nmissed where the pool never runs dry.  Where it does
# (deep(), 16 frames deep against the default maxactive of 10), the instance form counts
# the calls it could not give an instance; a light kretprobe needs none and misses none.
# A kretprobe whose entry is a breakpoint (heavy_tail: `std`) keeps its instance in the
# same image: a light function tail-calls it, and its tail call into the light tiny6
# (whose returns are not hooked) swaps the return address for the trampoline.

LIGHT_FUNCS = FLOOR_FUNCS + ["helper", "deep", "light_tail"]


def _build_light(tmp):
    prog = cc(tmp, "floor", FLOOR, "-O2", "-Wl,-z,norelro")
    spec = write_spec(tmp, "".join(f'[[kretprobe]]\nsymbol_name = "{f}"\n' for f in LIGHT_FUNCS + ["heavy_tail"]),
                      name="light.toml")
    return (prog, check_lines(prog, spec), instrument(prog, spec, tmp / "light"),
            instrument(prog, spec, tmp / "int3", "--no-optimize"))


def test_light_kretprobes_count_as_the_breakpoint_oracle(once, runner):
    from conftest import meta
    prog, check, light, oracle = once(_build_light)
    lines = {l.split("+")[0]: l for l in check}
    for f in LIGHT_FUNCS:
        assert re.search(r"  r  optimized  returns: light \(0x[0-9a-f]+ (ret|tail)(, 0x[0-9a-f]+ \w+)* left as they are: "
                         r"no handler, no instance", lines[f]), lines[f]
    # A breakpoint entry keeps its instance and its hooked exit: the tail call into the light
    # tiny6, whose returns are not hooked, swaps the return address (the trampoline fires it).
    assert re.search(r"  r  int3  direction_flag at .*returns: 0x[0-9a-f]+ tail->0x[0-9a-f]+ \(trampoline\)",
                     lines["heavy_tail"]), lines["heavy_tail"]
    # No return hook of any kind: no breakpoint at no_cfi's ret, no trampoline, no return site.
    rows = {p["symbol"]: p for p in meta(light)["probes"]}
    assert all(rows[f]["light"] and rows[f]["returns"] == "light" and not rows[f]["return_sites"]
               and not rows[f]["int3_exits"] for f in LIGHT_FUNCS), rows
    want, got, ref = oracle_runs(prog, light, oracle, runner, 40)
    mine, theirs = profile(got.stderr), profile(ref.stderr)
    assert {k: v[0] for k, v in mine.items()} == {k: v[0] for k, v in theirs.items()}, (mine, theirs)
    # tiny6: 45 calls, and 45 tail calls from heavy_tail (light_tail -> heavy_tail -> tiny6).
    assert mine["r_shared_epi_0"][0] == mine["r_heavy_tail_0"][0] == mine["r_light_tail_0"][0] == 45, mine
    assert mine["r_tiny6_0"][0] == 90 and mine["r_deep_0"][0] == 378, mine
    assert all(v[1] == 0 for v in mine.values()), mine
    assert all(theirs[k][1] == 0 for k in theirs if k != "r_deep_0") and theirs["r_deep_0"][1] > 0, theirs
    # KPREWRITE_ENABLED=0: the light entries' slow path (no pre_handler, no instance) counts nothing.
    off = run(light, 40, runner=runner, env={"KPREWRITE_PROFILE": "-", "KPREWRITE_ENABLED": "0"})
    assert off.returncode == 0 and off.stdout == want.stdout, off.stderr[-2000:]
    assert profile(off.stderr) == {f"r_{f}_0": (0, 0) for f in LIGHT_FUNCS + ["heavy_tail"]}, off.stderr[-2000:]


# --- Branch exits: the jumps that land on a `ret` hooked as exits of their own ------------
#
# A `ret` that conditional jumps land on, with code right after it (no padding): its
# region holds the jumps' target.  Each jump, a `jcc` outside the region, gets a region
# of its own whose detour runs the jcc inverted (back to the code after it), then what
# it lands on, the return hook and the `ret`; a `jcc` inside the exit's region goes to
# its copy in the detour.  jcc_on_ret calls out in an image that unwinds exceptions (an
# LSDA, from a C cleanup under -fexceptions): the trampoline is unsafe there, so before
# branch exits its `ret` took a breakpoint.  jcc_on_block's jg lands two instructions
# before its ret (`xor; ret`), so its detour runs the xor too.  jcc_at_entry's je lies in
# the entry's region: the entry detour's copy takes the hook.  jmp_on_ret: an
# unconditional jmp.  no_cfi_rcx: a jrcxz lands on the ret, which cannot be hooked so
# (no plain jcc): a breakpoint, the check named.
# The oracle: breakpoint kprobes (--no-optimize) on each `ret`, reading %rax.

BRANCH = r"""
__asm__(
".text\n"
".globl jcc_on_ret\n.type jcc_on_ret,@function\njcc_on_ret:\n"
"  .cfi_startproc\n"
"  push %rbx\n"
"  .cfi_def_cfa_offset 16\n"
"  .cfi_offset %rbx, -16\n"
"  mov %edi,%ebx\n"
"  call helper\n"
"  add %ebx,%eax\n"
"  pop %rbx\n"
"  .cfi_def_cfa_offset 8\n"
"  cmp $100,%eax\n"
"  jg 1f\n"
"  sub $7,%eax\n"
"  test $1,%al\n"
"  je 1f\n"
"  add $5,%eax\n"
"1:ret\n"
"  .cfi_endproc\n"
".size jcc_on_ret,.-jcc_on_ret\n"
".globl jcc_on_block\n.type jcc_on_block,@function\njcc_on_block:\n"
"  .cfi_startproc\n"
"  mov %edi,%eax\n"
"  imul $3,%eax,%eax\n"
"  cmp $50,%eax\n"
"  jg 2f\n"
"  add $1,%eax\n"
"  cmp $20,%eax\n"
"  jl 3f\n"
"  lea 9(%rax),%eax\n"
"2:xor $0x55,%eax\n"
"3:ret\n"
"  .cfi_endproc\n"
".size jcc_on_block,.-jcc_on_block\n"
/* The je lies in the entry's region: the entry detour's copy of it takes the hook. */
".globl jcc_at_entry\n.type jcc_at_entry,@function\njcc_at_entry:\n"
"  .cfi_startproc\n"
"  xor %eax,%eax\n"
"  test %edi,%edi\n"
"  je 7f\n"
"  lea 3(%rdi),%eax\n"
"  imul %edi,%eax\n"
"7:ret\n"
"  .cfi_endproc\n"
".size jcc_at_entry,.-jcc_at_entry\n"
/* An unconditional jmp lands on the ret: its detour runs the hook and the ret. */
".globl jmp_on_ret\n.type jmp_on_ret,@function\njmp_on_ret:\n"
"  .cfi_startproc\n"
"  mov %edi,%eax\n"
"  add $4,%eax\n"
"  test $1,%edi\n"
"  jne 9f\n"
"  shl $1,%eax\n"
"  jmp 8f\n"
"9:sub $1,%eax\n"
"  imul %eax,%eax\n"
"8:ret\n"
"  .cfi_endproc\n"
".size jmp_on_ret,.-jmp_on_ret\n"
/* No CFI (the trampoline unsafe), and a jrcxz lands on the ret: no jump of its own
 * to hook it by, so a breakpoint, the check that refused it named. */
".globl no_cfi_rcx\n.type no_cfi_rcx,@function\nno_cfi_rcx:\n"
"  mov %edi,%eax\n"
"  mov %edi,%ecx\n"
"  and $3,%ecx\n"
"  jrcxz 8f\n"
"  add %ecx,%eax\n"
"8:ret\n"
".size no_cfi_rcx,.-no_cfi_rcx\n"
/* Code right after each ret: no padding to borrow. */
".globl after_block\n.type after_block,@function\nafter_block:\n"
"  xor %eax,%eax\n"
"  ret\n"
".size after_block,.-after_block\n"
);
#include <stdio.h>
#include <stdlib.h>
int jcc_on_ret(int), jcc_on_block(int), jcc_at_entry(int), jmp_on_ret(int), no_cfi_rcx(int);
volatile int released;
__attribute__((noinline)) int helper(int x) { __asm__ volatile(""); return x * 2; }
__attribute__((noinline)) void release(int *p) { released += *p; }
/* A cleanup under -fexceptions around a call that may throw (through a pointer): an LSDA,
 * so the image unwinds exceptions. */
int (*volatile call_helper)(int) = helper;
__attribute__((noinline)) int guarded(int x) { int __attribute__((cleanup(release))) g = x; return call_helper(g) + 1; }
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 60;
    long t = 0;
    for (int i = -30; i < n; i++)
        t = t * 3 + jcc_on_ret(i) + jcc_on_block(i) + jcc_at_entry(i % 4) + jmp_on_ret(i) + no_cfi_rcx(i)
            + guarded(i);
    printf("t=%ld released=%d\n", t, released);
    return 0;
}
"""

BRANCH_FUNCS = ["jcc_on_ret", "jcc_on_block", "jcc_at_entry", "jmp_on_ret", "no_cfi_rcx"]


def _build_branch(tmp):
    from conftest import insns, probe_spec
    prog = cc(tmp, "branch", BRANCH, "-O2", "-fexceptions")
    kret = write_spec(tmp, probe_spec("kretprobe", BRANCH_FUNCS, handler="on_return", maxactive=4),
                      RET_HANDLER, "kret.toml")
    rets = [(f, off) for f in BRANCH_FUNCS for off, i in insns(prog, f) if i.mnemonic == "ret"]
    oracle = write_spec(tmp, probe_spec("kprobe", rets, pre_handler="at_ret"), RET_HANDLER, "oracle.toml")
    return (prog, kret, check_lines(prog, kret), instrument(prog, kret, tmp / "kret"),
            instrument(prog, oracle, tmp / "oracle", "--no-optimize"))


def test_jumps_landing_on_a_ret_are_hooked_as_exits(once, runner):
    from conftest import insns
    prog, kret_spec, check, kret, oracle = once(_build_branch)
    syms = symbols(prog)
    # The shape, by disassembly: each function's one ret ends it with code right after it,
    # and conditional jumps land on it (jcc_on_block: on it and on the xor before it).
    shape = {}
    for f, after in zip(BRANCH_FUNCS, BRANCH_FUNCS[1:] + ["after_block"]):
        code = insns(prog, f)
        (off, ret), = [(o, i) for o, i in code if i.mnemonic == "ret"]
        assert ret.address + 1 == syms[after], f
        jumps = {i.mnemonic: int(i.op_str, 16) for _, i in code if i.mnemonic.startswith("j")}
        shape[f] = (ret.address, jumps)
    r, j = shape["jcc_on_ret"]
    assert j == {"jg": r, "je": r}, j
    r, j = shape["jcc_on_block"]
    assert j["jl"] == r and j["jg"] == r - 3, j
    r, j = shape["jcc_at_entry"]
    assert j == {"je": r} and j["je"] - 3 - 3 - 2 == _jump_at(prog, "jcc_at_entry", "je"), j
    r, j = shape["jmp_on_ret"]
    assert j["jmp"] == r and j["jne"] == r - 6, j
    r, j = shape["no_cfi_rcx"]
    assert j == {"jrcxz": r}, j
    # The image unwinds exceptions (a personality and an LSDA: augmentation zPLR), so the
    # trampoline would be unsafe for jcc_on_ret, which calls out.
    frames = subprocess.run(["readelf", "--debug-dump=frames", str(prog)], capture_output=True, text=True).stdout
    assert '"zPLR"' in frames, frames[:2000]
    # check: each ret hooked by a jump, with the jumps outside its region hooked as exits of
    # their own -- no breakpoint, no trampoline.
    lines = {l.split("+")[0]: l for l in check}
    r, j = shape["jcc_on_ret"]
    # (its je lies in the ret's own region: the detour's copy goes to the hook)
    assert lines["jcc_on_ret"].endswith(f"returns: {r:#x} ret (and the jumps at {_jump_at(prog, 'jcc_on_ret', 'jg'):#x})"), \
        lines["jcc_on_ret"]
    r, j = shape["jcc_on_block"]
    assert lines["jcc_on_block"].endswith(
        f"returns: {r:#x} ret (and the jumps at {_jump_at(prog, 'jcc_on_block', 'jg'):#x}, "
        f"{_jump_at(prog, 'jcc_on_block', 'jl'):#x})"), lines["jcc_on_block"]
    r, j = shape["jcc_at_entry"]
    assert lines["jcc_at_entry"].endswith(f"returns: {r:#x} ret (and the jumps at {j['je'] - 8:#x})"), \
        lines["jcc_at_entry"]
    r, j = shape["jmp_on_ret"]
    assert lines["jmp_on_ret"].endswith(f"returns: {r:#x} ret (and the jumps at {_jump_at(prog, 'jmp_on_ret', 'jmp'):#x})"), \
        lines["jmp_on_ret"]
    # The jrcxz: a breakpoint, the check that refused the jump named, with its address.
    r, j = shape["no_cfi_rcx"]
    src = _jump_at(prog, "no_cfi_rcx", "jrcxz")
    assert lines["no_cfi_rcx"].endswith(
        f"returns: {r:#x} ret (int3)  jump_into_region at {r:#x}: jump from {src:#x} lands at {r:#x}, inside the "
        f"return region; the jumps there not hooked: branch_exit at {src:#x}: the branch at {src:#x} to {r:#x} is "
        f"not a plain jmp or jcc of no_cfi_rcx; no trampoline: trampoline_unsafe at {syms['no_cfi_rcx']:#x}: no "
        f"CFA rule at {syms['no_cfi_rcx']:#x} says where the return address is, so whether the function reads it "
        "is unknown"), lines["no_cfi_rcx"]
    sites = {p["symbol"]: p["returns"]["sites"] for p in json.loads(
        kprewrite("check", prog, "--spec", kret_spec, "--format", "json").stdout)["probes"]}
    assert all(s["int3"] is (f == "no_cfi_rcx") and s["hook"] == "ret" for f, ss in sites.items() for s in ss), sites
    assert sites["jcc_on_block"][0]["branches"] == [hex(_jump_at(prog, "jcc_on_block", m)) for m in ("jg", "jl")]
    recs = {p["symbol"]: p for p in meta(kret)["probes"] if p["kind"] == "r"}
    assert all((p["int3_exits"] == []) is (f != "no_cfi_rcx") and p["returns"] == "optimized" for f, p in recs.items()), recs
    # Every return handler with the value the breakpoint at the ret reads, once a call.
    want, got, ref = oracle_runs(prog, kret, oracle, runner, 90)
    mine, theirs = _returns(got.stderr), _returns(ref.stderr)
    assert sum(mine.values()) == 5 * 120 and mine == theirs, (mine - theirs, theirs - mine)
    assert len({k for k in mine if k.startswith("R jcc_on_ret ")}) > 20, mine
    assert profile(got.stderr) == {f"r_{f}_0": (120, 0) for f in BRANCH_FUNCS}, profile(got.stderr)


def _jump_at(prog, func: str, mnemonic: str) -> int:
    from conftest import insns
    return next(i.address for _, i in insns(prog, func) if i.mnemonic == mnemonic)
