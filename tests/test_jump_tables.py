"""Indirect jumps read instead of refused (rewriter/arch/x86_64/jumptable.py).

The kernel refuses to jump-optimize any probe in a function with an indirect
jump.  kprewrite reads the jump tables and knows where stored code pointers
can land, so such functions are optimized, except where a table's entry lands
inside a probe's region.  The program below has a jump table (PIC and absolute),
a switch on a byte, tail calls through a table and through a function-pointer
array, and a computed-goto interpreter.  Each function is tiled with probes
whose regions cover it end to end (three phases, so each instruction boundary
is inside some region): if a table entry were missed, a switch would jump into
the middle of a 5-byte jmp and the program would crash or print something else.
Hit counts must equal those of the same probes as breakpoints (--no-optimize),
whose correctness does not depend on the jump analysis."""
from __future__ import annotations

import pytest

from conftest import cc, insns, instrument, kprewrite, profile, run, write_spec

ARCHES = ["x86_64"]      # x86-64 only: x86-64 jump tables (rewriter/arch/x86_64/jumptable.py)

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>

/* A jump table (PIC: lea/movslq/add; fixed address: jmp *T(,%rax,8)), bounded by cmp/ja. */
__attribute__((noinline)) int sw(int op, int x) {
    switch (op) {
    case 0: return x + 1;
    case 1: return x * 3;
    case 2: return x - 7;
    case 3: return x ^ 0x55;
    case 4: return x << 2;
    case 5: return x / 3;
    case 6: return -x;
    case 7: return x % 11;
    case 8: return x | 0x100;
    case 9: return x & 0xf0;
    default: return 0;
    }
}

/* A switch on a byte (bounded by movzbl after cmp/ja). */
__attribute__((noinline)) long sw_byte(unsigned char c, long x) {
    switch (c) {
    case 'a': x += 3; break;
    case 'b': x *= 5; break;
    case 'c': x -= 11; break;
    case 'd': x ^= 0x3c; break;
    case 'e': x = x * x; break;
    case 'f': x >>= 1; break;
    case 'g': x |= 0x1000; break;
    default: x = -x; break;
    }
    return x + c;
}

__attribute__((noinline)) int f0(int x) { return x * 7 + 1; }
__attribute__((noinline)) int f1(int x) { return x * 11 - 3; }
__attribute__((noinline)) int f2(int x) { return (x << 3) ^ 9; }
__attribute__((noinline)) int f3(int x) { return x / 5 + 2; }
__attribute__((noinline)) int f4(int x) { return x % 13; }

/* Tail calls through a jump table. */
__attribute__((noinline)) int tail_sw(int i, int x) {
    switch (i) {
    case 0: return f0(x);
    case 1: return f1(x);
    case 2: return f2(x);
    case 3: return f3(x);
    case 4: return f4(x);
    case 5: return f0(x + 1);
    default: return f1(x + 2);
    }
}

/* A tail call through a table of function pointers (bounded by and $3). */
int (*const handlers[4])(int) = {f0, f1, f2, f3};
__attribute__((noinline)) int tail_ptr(int i, int x) { return handlers[i & 3](x); }

/* Computed goto: a table of label addresses, unbounded.  A PIC image relocates
   each entry; a fixed-address one stores them as constants.  Either way the
   labels are known jump targets. */
__attribute__((noinline)) long interp(const unsigned char *code, long acc) {
    static void *const labels[] = {&&inc, &&dbl, &&dec, &&neg, &&halt};
    goto *labels[*code++];
inc: acc += 1; goto *labels[*code++];
dbl: acc *= 2; goto *labels[*code++];
dec: acc -= 3; goto *labels[*code++];
neg: acc = -acc; goto *labels[*code++];
halt: return acc;
}

/* A label address held in a register, stored on the stack and jumped through: a
   RIP-relative lea in a PIC image, an immediate (mov $label) in a fixed-address one. */
__attribute__((noinline)) long resume(long x, int k) {
    void *volatile next = (k & 1) ? &&odd : &&even;
    goto *next;
even: x += 2; x *= 3; return x ^ k;
odd: x -= 5; x <<= 2; return x + k;
}

/* A switch on a field: cmpl $N,(%rdi); ja; mov (%rdi),%eax (the bound is on memory). */
struct node { int kind; long v; };
__attribute__((noinline)) long sw_field(struct node *n) {
    switch (n->kind) {
    case 0: return n->v + 3;
    case 1: return n->v * 9;
    case 2: return n->v - 100;
    case 3: return n->v ^ 0x7777;
    case 4: return n->v << 3;
    case 5: return -n->v;
    case 6: return n->v / 7;
    default: return 1;
    }
}

/* A switch in a loop: the table's base is loaded once, before the loop. */
__attribute__((noinline)) long sw_loop(const unsigned char *ops, int n, long acc) {
    for (int i = 0; i < n; i++) {
        switch (ops[i] % 9) {
        case 0: acc += 5; break;
        case 1: acc *= 3; break;
        case 2: acc -= 17; break;
        case 3: acc ^= 0x5a; break;
        case 4: acc <<= 1; break;
        case 5: acc = -acc; break;
        case 6: acc /= 3; break;
        case 7: acc |= 0x40; break;
        default: acc += i; break;
        }
    }
    return acc;
}

/* A tail call through a pointer chosen by a conditional move. */
struct obj { int (*fn)(int); };
__attribute__((noinline)) int via_cmov(struct obj *o, int x) { int (*f)(int) = o->fn ? o->fn : f4; return f(x); }

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 3;
    long t = 0;
    static const unsigned char prog[] = {0, 1, 1, 2, 3, 0, 1, 2, 2, 3, 1, 4};
    for (int r = 0; r < n; r++) {
        for (int op = -1; op < 12; op++) t += sw(op, 1000 + op * r);
        for (int c = 'Z'; c < 'j'; c++) t += sw_byte((unsigned char)c, 77 + r);
        for (int i = -1; i < 8; i++) t += tail_sw(i, 50 + r);
        for (int i = 0; i < 8; i++) t += tail_ptr(i, 60 + r);
        t += interp(prog, r);
        for (int k = -1; k < 9; k++) { struct node nd = {k, 1000 + r}; t += sw_field(&nd); }
        t += sw_loop(prog, sizeof prog, r);
        t += resume(r, r) + resume(r, r + 1);
        struct obj o1 = {f2}, o2 = {0};
        t += via_cmov(&o1, r) + via_cmov(&o2, r);
        printf("round %d: %ld\n", r, t);
    }
    return 0;
}
"""

FUNCS = ["sw", "sw_byte", "tail_sw", "tail_ptr", "interp", "sw_field", "sw_loop", "via_cmov", "resume", "f0", "f1"]
# Labels unaligned: no padding before a case label or a computed-goto label, so
# the tiling regions run across them.
ALIGN = ["-falign-jumps=1", "-falign-labels=1", "-falign-loops=1"]
BUILDS = {"pie": ["-O2", "-fpie", "-pie", *ALIGN], "nopie": ["-O2", "-fno-pie", "-no-pie", *ALIGN]}


def _tiles(prog, phase: int) -> list[tuple[str, int]]:
    """(function, offset) of probes whose 5-byte regions tile each function,
    starting at its `phase`-th instruction: every boundary after the first of a
    region is inside it, so a table entry landing there must refuse the probe."""
    out = []
    for f in FUNCS:
        ins = insns(prog, f)
        bounds = [off for off, _ in ins]
        size = ins[-1][0] + ins[-1][1].size
        i = phase
        while i < len(bounds) and bounds[i] + 5 <= size:
            out.append((f, bounds[i]))
            i = next((j for j in range(i, len(bounds)) if bounds[j] >= bounds[i] + 5), len(bounds))
    return out


def _build(tmp, build):
    prog = cc(tmp, f"sw_{build}", PROGRAM, *BUILDS[build])
    outs = []
    for phase in range(3):
        spec = write_spec(tmp, "".join(f"[[kprobe]]\nsymbol_name = \"{f}\"\noffset = {o}\n"
                                       for f, o in _tiles(prog, phase)), name=f"p{phase}.toml")
        check = kprewrite("check", prog, "--spec", spec).stdout.splitlines()
        opt = instrument(prog, spec, tmp / f"opt{phase}")
        oracle = instrument(prog, spec, tmp / f"int3_{phase}", "--no-optimize")
        outs.append((check, opt, oracle))
    return prog, outs


@pytest.mark.parametrize("build", list(BUILDS))
def test_jump_tables_read(once, build, runner):
    prog, outs = once(_build, build)
    want = run(prog, 4, runner=runner)
    assert want.returncode == 0
    by_func: dict[str, list[str]] = {}
    for check, opt, oracle in outs:
        for line in check:
            by_func.setdefault(line.split("+")[0], []).append(line)
        got = run(opt, 4, runner=runner, env={"KPREWRITE_PROFILE": "-"})
        assert got.returncode == 0 and got.stdout == want.stdout, got.stderr[-2000:]
        ref = run(oracle, 4, runner=runner, env={"KPREWRITE_PROFILE": "-"})
        assert ref.returncode == 0 and ref.stdout == want.stdout, ref.stderr[-2000:]
        hits, ref_hits = profile(got.stderr), profile(ref.stderr)
        assert hits and hits == ref_hits
        assert sum(h for h, _ in hits.values()) > 500

    def decisions(f):
        return [l.split("  ")[2] for l in by_func[f]]
    # Functions with a bounded jump table, or a tail call through a pointer the
    # image relocates, are jump-optimized now; their entries too.
    for f in ["sw", "sw_byte", "tail_sw", "tail_ptr", "sw_field", "sw_loop", "via_cmov"]:
        assert decisions(f).count("optimized") >= (1 if f == "tail_ptr" else 3), by_func[f]
        assert not any("indirect_jump" in l for l in by_func[f]), by_func[f]
    # Some region would have covered a case label: the table's entry refused it,
    # or (probes sharing detours, planner.sites.share_regions()) ended the region before
    # it, the label's probe heading a region of its own.  Either way a jump table
    # read wrong leaves a label under a jump, which the runs above would crash on.
    for f in ["sw", "tail_sw", "sw_field", "sw_loop"]:
        # (A fixed-address table's entries are also constants in the image, which
        # fixed_code_pointers() names first.)
        assert all(" optimized" in l or "jump table entry of the jump at" in l or
                   (build == "nopie" and "code address stored at" in l) for l in by_func[f]), by_func[f]
    # Computed goto and label addresses: a PIC image relocates each table entry
    # and computes a label with a RIP-relative lea; a fixed-address image stores
    # them as constants, each found by fixed_code_pointers().  Either way each
    # label is a known jump target, so the jumps through them are read.
    for f in ["interp", "via_cmov", "resume"]:
        assert "optimized" in decisions(f), by_func[f]
        assert not any("indirect_jump" in l for l in by_func[f]), by_func[f]
    # (The tiles' regions end before each label, planner.sites.share_regions(): a label
    # missed would lie under a jump, and the runs above would crash.)


def _kret(tmp, build):
    from test_kretprobe import HANDLERS, KRET
    from conftest import probe_spec
    prog = cc(tmp, f"swr_{build}", PROGRAM, *BUILDS[build])
    funcs = ["sw", "sw_byte", "tail_sw", "tail_ptr", "via_cmov", "interp", "f0", "f1", "f2", "f3", "f4"]
    spec = write_spec(tmp, probe_spec("kretprobe", funcs, **KRET), HANDLERS)
    return prog, kprewrite("check", prog, "--spec", spec).stdout.splitlines(), instrument(prog, spec, tmp / "kret")


@pytest.mark.parametrize("build", list(BUILDS))
def test_kretprobe_on_jump_table_functions(once, build, runner):
    """A function whose jump tables stay inside it has its exits named and
    hooked (the trampoline only where a case lands on a ret that no region of
    its own fits: jump_into_region, never indirect_jump); every call gets its
    return handler with the return address of its caller."""
    prog, check, out = once(_kret, build)
    lines = {l.split("+")[0]: l for l in check}
    for f in ["sw", "sw_byte"]:
        assert "indirect_jump" not in lines[f] and (
            ("returns: 0x" in lines[f] and "trampoline" not in lines[f])
            or "returns: trampoline  jump_into_region at " in lines[f]), lines[f]
    assert "returns: 0x" in lines["sw_byte"] or "returns: 0x" in lines["sw"], (lines["sw"], lines["sw_byte"])
    assert "tail->" in lines["tail_sw"] and "(trampoline)" not in lines["tail_sw"] \
        and "indirect_jump" not in lines["tail_sw"], lines["tail_sw"]
    # A tail call through a table of function pointers, or through a pointer
    # loaded or computed (cmov): no target inside the function, so an exit like
    # a tail jmp whose callee's returns are not hooked (the slot swapped for the
    # trampoline at the jmp).  The computed gotos of interp land inside it: the
    # trampoline stays.
    for f in ["tail_ptr", "via_cmov"]:
        assert "tail->*pointer (pending or trampoline)" in lines[f] and "indirect_jump" not in lines[f], lines[f]
    assert "indirect_jump" in lines["interp"] and "trampoline" in lines["interp"], lines["interp"]
    want = run(prog, 3, runner=runner)
    got = run(out, 3, runner=runner)
    assert got.returncode == 0 and got.stdout == want.stdout, got.stderr[-2000:]
    ev = got.stderr.splitlines()
    assert not any("BAD-IP" in l for l in ev)
    for f, calls in [("sw", 13 * 3), ("sw_byte", 16 * 3), ("tail_sw", 9 * 3), ("tail_ptr", 8 * 3),
                     ("via_cmov", 2 * 3), ("interp", 3)]:
        assert sum(l.startswith(f"E {f} ") for l in ev) == calls
        assert sum(l.startswith(f"R {f} ") for l in ev) == calls, [l for l in ev if f in l][:20]


# A table base kept in a callee-saved register across the loop that dispatches
# through it (jumptable._reg_const: the backward walk cannot enumerate the loop
# head's predecessors); the same with the base clobbered on a path back to the
# loop (never taken at run time), which must keep the refusal; and an array
# element checked as `cmpl $N,(%rdi,%rdx,4)` then loaded through `lea 1(%rdx)`
# with a movsxd between the cmp and its ja (jumptable._lea_folded); an index
# bounded by `cmp $N,%sil; ja` after a zero extension from a byte, with a cmp for
# another branch on the way (jumptable._bound_path()'s narrow bound).
HOISTED = r"""
#include <stdio.h>
#define FN(name) ".globl " #name "\n.type " #name ",@function\n" #name ":\n"
__asm__(".text\n"
FN(hoist)
"  push %rbx\n  xor %eax,%eax\n  xor %ecx,%ecx\n  lea .Lt1(%rip),%rbx\n"
".Ll1:\n  cmp %edi,%ecx\n  jge .Ld1\n  mov %ecx,%edx\n  and $7,%edx\n  cmp $3,%edx\n  ja .Lx1\n"
"  movslq (%rbx,%rdx,4),%rdx\n  add %rbx,%rdx\n  jmp *%rdx\n"
".Lc10:\n  add $1,%eax\n  jmp .Ln1\n"
".Lc11:\n  add $10,%eax\n  jmp .Ln1\n"
".Lc12:\n  add $100,%eax\n  jmp .Ln1\n"
".Lc13:\n  add $1000,%eax\n  jmp .Ln1\n"
".Lx1:\n  add $7,%eax\n"
".Ln1:\n  inc %ecx\n  jmp .Ll1\n"
".Ld1:\n  pop %rbx\n  ret\n"
".size hoist,.-hoist\n"
FN(hoist_bad)
"  push %rbx\n  xor %eax,%eax\n  xor %ecx,%ecx\n  lea .Lt2(%rip),%rbx\n"
".Ll2:\n  cmp %edi,%ecx\n  jge .Ld2\n  mov %ecx,%edx\n  and $3,%edx\n  cmp $3,%edx\n  ja .Lx2\n"
"  movslq (%rbx,%rdx,4),%rdx\n  add %rbx,%rdx\n  jmp *%rdx\n"
".Lc20:\n  add $2,%eax\n  jmp .Ln2\n"
".Lc21:\n  add $20,%eax\n  jmp .Ln2\n"
".Lc22:\n  add $200,%eax\n  jmp .Ln2\n"
".Lc23:\n  add $2000,%eax\n  jmp .Ln2\n"
".Lx2:\n  mov %rsi,%rbx\n"                 /* never taken: the index is 0..3 */
".Ln2:\n  inc %ecx\n  jmp .Ll2\n"
".Ld2:\n  pop %rbx\n  ret\n"
".size hoist_bad,.-hoist_bad\n"
FN(elem)
"  xor %eax,%eax\n  xor %ecx,%ecx\n  lea .Lt3(%rip),%r8\n"
".Ll3:\n  cmp %esi,%ecx\n  jge .Ld3\n  movslq %ecx,%rdx\n  lea 1(%rdx),%r9\n"
"  cmpl $2,(%rdi,%rdx,4)\n  movslq (%rdi),%r10\n  ja .Lx3\n  mov -4(%rdi,%r9,4),%edx\n"
"  movslq (%r8,%rdx,4),%rdx\n  add %r8,%rdx\n  jmp *%rdx\n"
".Lc30:\n  add $3,%eax\n  jmp .Ln3\n"
".Lc31:\n  add $30,%eax\n  jmp .Ln3\n"
".Lc32:\n  add $300,%eax\n  jmp .Ln3\n"
".Lx3:\n  add $9,%eax\n"
".Ln3:\n  inc %ecx\n  jmp .Ll3\n"
".Ld3:\n  ret\n"
".size elem,.-elem\n"
FN(narrow)
"  movzbl %dil,%esi\n  cmp $9,%esi\n  ja .Lx4\n  cmp $7,%esi\n  je .Lx4\n  cmp $2,%sil\n  ja .Lx4\n"
"  lea .Lt4(%rip),%rcx\n  movslq (%rcx,%rsi,4),%rax\n  add %rcx,%rax\n  jmp *%rax\n"
".Lc40:\n  mov $40,%eax\n  ret\n"
".Lc41:\n  mov $41,%eax\n  ret\n"
".Lc42:\n  mov $42,%eax\n  ret\n"
".Lx4:\n  mov $1,%eax\n  ret\n"
".size narrow,.-narrow\n"
/* The base set after a check whose failure calls abort(), and abort's call
   followed by case code: the call does not return, so the base is set on every
   path to the jump.  hoist_ret calls getpid() there instead, which returns:
   the base may be the caller's, and the kernel's refusal stays. */
FN(hoist_nr)
"  push %rbx\n  xor %eax,%eax\n  xor %ecx,%ecx\n  test %edi,%edi\n  js .Lf5\n  lea .Lt5(%rip),%rbx\n"
".Ll5:\n  cmp %edi,%ecx\n  jge .Ld5\n  mov %ecx,%edx\n  and $3,%edx\n  cmp $3,%edx\n  ja .Lx5\n"
"  movslq (%rbx,%rdx,4),%rdx\n  add %rbx,%rdx\n  jmp *%rdx\n"
".Ld5:\n  pop %rbx\n  ret\n"
".Lf5:\n  call abort@PLT\n"
".Lc50:\n  add $5,%eax\n  jmp .Ln5\n"
".Lc51:\n  add $50,%eax\n  jmp .Ln5\n"
".Lc52:\n  add $500,%eax\n  jmp .Ln5\n"
".Lc53:\n  add $5000,%eax\n  jmp .Ln5\n"
".Lx5:\n  add $9,%eax\n"
".Ln5:\n  inc %ecx\n  jmp .Ll5\n"
".size hoist_nr,.-hoist_nr\n"
FN(hoist_ret)
"  push %rbx\n  xor %eax,%eax\n  xor %ecx,%ecx\n  test %edi,%edi\n  js .Lf6\n  lea .Lt6(%rip),%rbx\n"
".Ll6:\n  cmp %edi,%ecx\n  jge .Ld6\n  mov %ecx,%edx\n  and $3,%edx\n  cmp $3,%edx\n  ja .Lx6\n"
"  movslq (%rbx,%rdx,4),%rdx\n  add %rbx,%rdx\n  jmp *%rdx\n"
".Ld6:\n  pop %rbx\n  ret\n"
".Lf6:\n  call getpid@PLT\n"
".Lc60:\n  add $6,%eax\n  jmp .Ln6\n"
".Lc61:\n  add $60,%eax\n  jmp .Ln6\n"
".Lc62:\n  add $600,%eax\n  jmp .Ln6\n"
".Lc63:\n  add $6000,%eax\n  jmp .Ln6\n"
".Lx6:\n  add $9,%eax\n"
".Ln6:\n  inc %ecx\n  jmp .Ll6\n"
".size hoist_ret,.-hoist_ret\n"
".section .rodata\n.p2align 2\n"
".Lt5:\n  .long .Lc50-.Lt5, .Lc51-.Lt5, .Lc52-.Lt5, .Lc53-.Lt5\n"
".Lt6:\n  .long .Lc60-.Lt6, .Lc61-.Lt6, .Lc62-.Lt6, .Lc63-.Lt6\n"
/* three entries, then data that is no table's: read with the wider bound (10),
   the table would hold non-code entries and stay unbounded */
".Lt4:\n  .long .Lc40-.Lt4, .Lc41-.Lt4, .Lc42-.Lt4, 0x7fffff00, 0x7fffff00, 0x7fffff00, 0x7fffff00\n"
".Lt1:\n  .long .Lc10-.Lt1, .Lc11-.Lt1, .Lc12-.Lt1, .Lc13-.Lt1\n"
".Lt2:\n  .long .Lc20-.Lt2, .Lc21-.Lt2, .Lc22-.Lt2, .Lc23-.Lt2\n"
".Lt3:\n  .long .Lc30-.Lt3, .Lc31-.Lt3, .Lc32-.Lt3\n"
".text\n");
int hoist(int), hoist_bad(int, long), elem(const int *, int), narrow(int), hoist_nr(int), hoist_ret(int);
int main(void)
{
    static const int a[] = {0, 1, 2, 2, 1, 0, 2};
    int n = 0;
    for (int i = 0; i < 300; i++)
        n += narrow(i);
    printf("%d %d %d %d\n", hoist(13), hoist_bad(13, 0), elem(a, 7), n);
    printf("%d %d\n", hoist_nr(13), hoist_ret(13));
    return 0;
}
"""
HOISTED_FUNCS = ["hoist", "hoist_bad", "elem", "narrow", "hoist_nr", "hoist_ret"]


def _hoisted(tmp):
    prog = cc(tmp, "hoisted", HOISTED, "-O2", "-fpie", "-pie")
    spec = write_spec(tmp, "".join(f"[[kprobe]]\nsymbol_name = \"{f}\"\noffset = {off}\n"
                                   for f in HOISTED_FUNCS for off, _ in insns(prog, f)))
    check = kprewrite("check", prog, "--spec", spec).stdout.splitlines()
    return prog, check, instrument(prog, spec, tmp / "opt"), instrument(prog, spec, tmp / "int3", "--no-optimize")


def test_hoisted_table_base_and_checked_element(once, runner):
    prog, check, opt, oracle = once(_hoisted)
    by_func: dict[str, list[str]] = {}
    for line in check:
        by_func.setdefault(line.split("+")[0], []).append(line)
    for f in ("hoist", "elem", "narrow", "hoist_nr"):
        assert not any("indirect_jump" in l for l in by_func[f]), by_func[f]
        assert sum(" optimized" in l for l in by_func[f]) >= 0.75 * len(by_func[f]), by_func[f]
    # hoist_bad's jump stays unbounded, and the hand-written function has no CFI to tell
    # its targets from a region's instructions: only one-instruction regions (its 5-
    # and 7-byte instructions), which nothing can land inside, are jump-optimized.
    sizes = dict(insns(prog, "hoist_bad"))
    for l in by_func["hoist_bad"]:
        off = int(l.split("  ")[0].split("+")[1], 16)
        assert (" optimized" in l) == (sizes[off].size >= 5), l
    assert "indirect_jump" in by_func["hoist_bad"][0], by_func["hoist_bad"]
    assert "indirect_jump" in by_func["hoist_ret"][0], by_func["hoist_ret"]
    want = run(prog, runner=runner)
    assert want.returncode == 0 and want.stdout == "2257 6668 966 540\n16670 20004\n", want.stdout
    got = run(opt, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    ref = run(oracle, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert got.returncode == 0 and got.stdout == want.stdout, got.stderr[-2000:]
    assert ref.returncode == 0 and ref.stdout == want.stdout, ref.stderr[-2000:]
    assert profile(got.stderr) == profile(ref.stderr) and profile(got.stderr)


UNBOUNDED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noipa)) long g(long x) { return x * 3 + 1; }

/* Py_UNREACHABLE()-style switches: no bound check, the index is bounded by the caller,
   so the tables cannot be read.  rich() starts with a 7-byte instruction; rich2()
   saves registers first, so its prologue's CFA rules (%rsp+8..+32) differ from the
   dispatch's, where every case label is (%rsp+32). */
__attribute__((noipa)) long rich(int op, long a, long b) {
    switch (op) {
    case 0: return a < b;
    case 1: return a <= b + 3;
    case 2: return a == b;
    case 3: return a != b * 2;
    case 4: return a > b;
    case 5: return a >= b - 5;
    default: __builtin_unreachable();
    }
}

__attribute__((noipa)) long rich2(int op, long a, long b) {
    long r, s = a ^ b;
    switch (op) {
    case 0: r = g(a) < g(b); break;
    case 1: r = g(a) <= b; break;
    case 2: r = a == g(b); break;
    case 3: r = g(a + b) != 7; break;
    case 4: r = g(a) > g(b + 1); break;
    case 5: r = a >= g(b - 1); break;
    default: __builtin_unreachable();
    }
    return r + g(r) + s;
}

int main(int argc, char **argv) {
    long t = 0;
    int n = argc > 1 ? atoi(argv[1]) : 3000;
    for (int i = 0; i < n; i++)
        t += rich(i % 6, i, n - i) + rich2((i * 7) % 6, i, n - i);
    printf("%ld\n", t);
    return 0;
}
"""


def _unbounded(tmp):
    prog = cc(tmp, "unbounded", UNBOUNDED, "-O2", "-fpie", "-pie")
    spec = write_spec(tmp, "".join(f"[[kprobe]]\nsymbol_name = \"{f}\"\noffset = {off}\n"
                                   for f in ("rich", "rich2") for off, _ in insns(prog, f)))
    check = kprewrite("check", prog, "--spec", spec).stdout.splitlines()
    return prog, check, instrument(prog, spec, tmp / "opt"), instrument(prog, spec, tmp / "int3", "--no-optimize")


def test_unbounded_jump_table_regions(once, runner):
    """A jump table that cannot be bounded refuses only the regions it could land
    inside (optprobe._unbounded_jump_may_land_inside()): a one-instruction region,
    or one whose inner instructions have CFA rules the jump's cannot share.  With a
    probe on every instruction, a region run over a case label would be jumped into
    the middle of, and the program would crash or print something else."""
    prog, check, opt, oracle = once(_unbounded)
    by_func: dict[str, list[str]] = {}
    for line in check:
        by_func.setdefault(line.split("+")[0], []).append(line)
    assert by_func["rich"][0].split("  ")[2] == "optimized", by_func["rich"]
    assert by_func["rich2"][0].split("  ")[2] == "optimized", by_func["rich2"]
    want = run(prog, runner=runner)
    assert want.returncode == 0 and want.stdout.strip().lstrip("-").isdigit(), want.stdout
    got = run(opt, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    ref = run(oracle, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert got.returncode == 0 and got.stdout == want.stdout, got.stderr[-2000:]
    assert ref.returncode == 0 and ref.stdout == want.stdout, ref.stderr[-2000:]
    assert profile(got.stderr) == profile(ref.stderr) and profile(got.stderr)
    # Past the prologue the case labels share the dispatch's CFA: some regions there
    # must be refused, saying why.
    assert any("may be a target" in l for l in by_func["rich2"]), by_func["rich2"]
