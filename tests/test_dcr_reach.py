"""Every relocatable instruction in the DCR: beyond can_boost(),
SSE moves and compares, push m64, bt, with RIP-relative operands re-encoded;
a final call through a register or memory, emulated so the callee sees the
original return address; a jmp through memory.  Each function's entry region
holds one of them; the program prints what would change if a copy ran wrong
(a RIP-relative constant read from the wrong place, a return address in the
detour), natively and under qemu."""
from __future__ import annotations

import pytest

from conftest import cc, check_lines, instrument, profile, run, write_spec

ARCHES = ["x86_64"]      # x86-64 only: x86-64 instructions relocated in the DCR (RIP-relative, SSE, push m64)

ASM = r"""
__asm__(
".section .rodata\n.balign 16\n"
"consts: .double 1.5, 2.25\n"
"        .quad 0x1122334455667788\n"
".text\n"
/* movupd consts(%rip): 66 0f 10, not boostable in the kernel. */
".globl sse_load\n.type sse_load,@function\nsse_load:\n"
"  movupd consts(%rip),%xmm1\n"
"  addsd %xmm1,%xmm0\n"
"  unpckhpd %xmm1,%xmm1\n"
"  addsd %xmm1,%xmm0\n"
"  ret\n"
".size sse_load,.-sse_load\n"
/* ucomisd consts(%rip): 66 0f 2e. */
".globl sse_cmp\n.type sse_cmp,@function\nsse_cmp:\n"
"  ucomisd consts(%rip),%xmm0\n"
"  seta %al\n"
"  movzbl %al,%eax\n"
"  ret\n"
".size sse_cmp,.-sse_cmp\n"
/* push consts+16(%rip): ff /6. */
".globl push_mem\n.type push_mem,@function\npush_mem:\n"
"  push consts+16(%rip)\n"
"  pop %rax\n"
"  ret\n"
".size push_mem,.-push_mem\n"
/* bt $3,%edi: 0f ba. */
".globl bit_test\n.type bit_test,@function\nbit_test:\n"
"  bt $3,%edi\n"
"  setc %al\n"
"  movzbl %al,%eax\n"
"  ret\n"
".size bit_test,.-bit_test\n"
/* A call through a RIP-relative pointer ends the region. */
".globl call_mem\n.type call_mem,@function\ncall_mem:\n"
"  sub $8,%rsp\n"
"  call *fptr(%rip)\n"
"  add $8,%rsp\n"
"  ret\n"
".size call_mem,.-call_mem\n"
/* A call through a register ends the region. */
".globl call_reg\n.type call_reg,@function\ncall_reg:\n"
"  sub $8,%rsp\n"
"  call *%rdi\n"
"  add $8,%rsp\n"
"  ret\n"
".size call_reg,.-call_reg\n"
/* A call through 8(%rdi) ends the region. */
".globl call_ind\n.type call_ind,@function\ncall_ind:\n"
"  sub $8,%rsp\n"
"  call *8(%rdi)\n"
"  add $8,%rsp\n"
"  ret\n"
".size call_ind,.-call_ind\n"
/* A tail jump through a RIP-relative pointer. */
".globl jmp_mem\n.type jmp_mem,@function\njmp_mem:\n"
"  jmp *gptr(%rip)\n"
".size jmp_mem,.-jmp_mem\n"
);
"""

PROGRAM = ASM + r"""
#include <stdio.h>
#include <stdlib.h>
double sse_load(double);
int sse_cmp(double), bit_test(int);
long push_mem(void);
void *call_mem(void), *call_reg(void *(*)(void)), *call_ind(void *);
long jmp_mem(long);

__attribute__((noinline)) void *where(void) { return __builtin_return_address(0); }
__attribute__((noinline)) long plus42(long x) { return x + 42; }
void *(*fptr)(void) = where;
long (*gptr)(long) = plus42;
struct ops { long pad; void *(*fn)(void); } ops = {0, where};

static int inside(void *ra, void *f) { return (char *)ra > (char *)f && (char *)ra < (char *)f + 16; }

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 3;
    double d = 0;
    long t = 0;
    int in = 0;
    for (int i = 0; i < n; i++) {
        d += sse_load(i * 0.5);
        t += sse_cmp(i * 0.5) + bit_test(i) + jmp_mem(i);
        t += push_mem() == 0x1122334455667788L;
        in += inside(call_mem(), (void *)call_mem) + inside(call_reg(where), (void *)call_reg)
              + inside(call_ind(&ops), (void *)call_ind);
    }
    printf("d=%.2f t=%ld returns inside the caller: %d of %d\n", d, t, in, 3 * n);
    return 0;
}
"""

FUNCS = ["sse_load", "sse_cmp", "push_mem", "bit_test", "call_mem", "call_reg", "call_ind", "jmp_mem"]


def _build(tmp, pie):
    prog = cc(tmp, "dcr", PROGRAM, "-O2", *(["-fpie", "-pie"] if pie else ["-fno-pie", "-no-pie"]))
    spec = write_spec(tmp, "".join(f'[[kprobe]]\nsymbol_name = "{f}"\n' for f in FUNCS))
    return prog, check_lines(prog, spec), instrument(prog, spec, tmp / "dcr.kp")


@pytest.mark.parametrize("pie", [True, False], ids=["pie", "nopie"])
def test_relocatable_instructions_in_the_dcr(once, pie, runner):
    prog, check, out = once(_build, pie)
    decisions = dict(zip(FUNCS, [l.split("  ")[2] for l in check]))
    # An image linked at a fixed address stores code pointers with no relocation:
    # its constants that may be code addresses are known jump targets instead
    # (jumptable.fixed_code_pointers()), so a jump through one is read there too.
    assert decisions == {f: "optimized" for f in FUNCS}, check
    want = run(prog, 7, runner=runner)
    assert want.returncode == 0 and want.stdout.endswith("returns inside the caller: 21 of 21\n"), want.stdout
    got = run(out, 7, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert got.returncode == 0 and got.stdout == want.stdout, got.stdout + got.stderr[-2000:]
    hits = profile(got.stderr)
    assert {k: v[0] for k, v in hits.items()} == {f"p_{f}_0": 7 for f in FUNCS}, hits


# A return region may hold what a DCR may: each case of this switch is
# `movsd C(%rip),%xmm0; ret` (how _PyUnicode_ToNumeric's 400 returns look), whose
# return hook takes a jump over both, the constant's load re-encoded.
RET_SSE = r"""
#include <stdio.h>
__asm__(
".section .rodata\n.balign 8\n"
"k: .double 0.5, 1.25, 2.75, 4.0\n"
"tab: .long c0-tab, c1-tab, c2-tab, c3-tab\n"
".text\n"
".globl pick\n.type pick,@function\npick:\n"
"  cmp $3,%edi\n  ja c0\n  lea tab(%rip),%rdx\n  movslq (%rdx,%rdi,4),%rax\n  add %rdx,%rax\n  jmp *%rax\n"
"c0: movsd k(%rip),%xmm0\n  ret\n"
"c1: movsd k+8(%rip),%xmm0\n  ret\n"
"c2: movsd k+16(%rip),%xmm0\n  ret\n"
"c3: movsd k+24(%rip),%xmm0\n  ret\n"
".size pick,.-pick\n");
double pick(unsigned);
int main(void)
{
    double t = 0;
    for (unsigned i = 0; i < 10; i++)
        t += pick(i % 5);
    printf("%.2f\n", t);
    return 0;
}
"""

RET_HANDLERS = r"""
#include <linux/kprobes.h>
static unsigned long n;
int on_ret(struct kretprobe_instance *ri, struct pt_regs *regs) { n++; return 0; }
"""


def _ret_sse(tmp):
    prog = cc(tmp, "retsse", RET_SSE, "-O2")
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\n[[kretprobe]]\nsymbol_name = "pick"\nhandler = "on_ret"\n',
                      RET_HANDLERS)
    from conftest import kprewrite
    import json
    doc = json.loads(kprewrite("check", prog, "--spec", spec, "--format", "json").stdout)
    return prog, doc["probes"][0]["returns"], instrument(prog, spec)


def test_return_region_with_sse_move(once, runner):
    prog, returns, out = once(_ret_sse)
    assert returns["mode"] == "hooks" and len(returns["sites"]) == 4, returns
    assert not any(s["int3"] for s in returns["sites"]), returns
    want = run(prog, runner=runner)
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == want.stdout == "18.00\n", r.stderr
    assert profile(r.stderr)["r_pick_0"][0] == 10, r.stderr
