"""The optimizer's safety checks, each tripped by a real program, and the hard
cases that must still work when jump-optimized."""
from __future__ import annotations

import pytest

from conftest import cc, check_lines, insns, instrument, kprewrite, probe_spec, profile, run, symbols, write_spec

ARCHES = ["x86_64"]      # x86-64 only: x86-64 assembly (the optimizer's checks on 5-byte regions)

ASM = r"""
__asm__(
".text\n"
/* A loop jumps back to offset 1: inside the region of a probe at 0, even a
   short jump's (planner.short_jumps.short_jumps(), evict_neighbour()). */
".globl jump_into\n.type jump_into,@function\njump_into:\n"
"  xchg %eax,%edi\n"
"1: sub $1,%eax\n"
"  cmp $3,%eax\n"
"  jg 1b\n"
"  ret\n"
".size jump_into,.-jump_into\n"
/* An indirect jump to an address computed by arithmetic the jump-table reader
   does not follow: unbounded, and with no CFI to tell its targets from the
   entry region's second instruction (a short jump's too: the nop comes first),
   the kernel's refusal stays. */
".globl jump_table\n.type jump_table,@function\njump_table:\n"
"  nop\n"
"  xor %edx,%edx\n"
"  lea 1f(%rip),%rax\n"
"  add %rdx,%rax\n"
"  jmp *%rax\n"
"1: mov %edi,%eax\n"
"  ret\n"
".size jump_table,.-jump_table\n"
/* One byte: a 5-byte jump, even a 2-byte one, would cross the function's end. */
".globl tiny\n.type tiny,@function\ntiny:\n"
"  ret\n"
".size tiny,.-tiny\n"
/* A RIP-relative load heads the region. */
".globl rip_rel\n.type rip_rel,@function\nrip_rel:\n"
"  mov counter(%rip),%eax\n"
"  add %edi,%eax\n"
"  mov %eax,counter(%rip)\n"
"  ret\n"
".size rip_rel,.-rip_rel\n"
/* A short conditional branch inside the region. */
".globl short_br\n.type short_br,@function\nshort_br:\n"
"  test %edi,%edi\n"
"  je 1f\n"
"  mov $1,%eax\n"
"  ret\n"
"1: mov $2,%eax\n"
"  ret\n"
".size short_br,.-short_br\n"
/* A leaf that keeps live data in the red zone across the probe at +10. */
".globl redzone\n.type redzone,@function\nredzone:\n"
"  mov %rdi,-8(%rsp)\n"
"  mov %rsi,-0x78(%rsp)\n"
"  mov -8(%rsp),%rax\n"
"  add -0x78(%rsp),%rax\n"
"  ret\n"
".size redzone,.-redzone\n"
/* A call heads the region: the callee must see the original return address. */
".globl calls\n.type calls,@function\ncalls:\n"
"  sub $8,%rsp\n"
"  call where_from\n"
"  add $8,%rsp\n"
"  ret\n"
".size calls,.-calls\n"
);
"""

PROGRAM = ASM + r"""
#include <stdio.h>
#include <stdlib.h>
int counter;
int jump_into(int), jump_table(int), rip_rel(int), short_br(int);
void tiny(void);
long redzone(long, long);
void *calls(void);
__attribute__((noinline)) void *where_from(void) { return __builtin_return_address(0); }
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 5;
    int t = 0;
    for (int i = 0; i < n; i++) t += rip_rel(i);
    printf("jump_into=%d jump_table=%d tiny=%d\n", jump_into(7), jump_table(9), (tiny(), 0));
    printf("rip_rel=%d counter=%d\n", t, counter);
    printf("short_br=%d,%d\n", short_br(0), short_br(1));
    printf("redzone=%ld\n", redzone(40, 2));
    void *ra = calls();
    printf("calls returns inside calls: %d\n", (char *)ra > (char *)calls && (char *)ra < (char *)calls + 16);
    return 0;
}
"""

NOISY = r"""
#include <kprewrite/kprobes.h>
/* Uses a lot of stack: anything left in the probed code's red zone would be overwritten. */
int noisy(struct kprobe *p, struct pt_regs *regs)
{
    char buf[512];
    for (int i = 0; i < (int)sizeof(buf); i++)
        ((volatile char *)buf)[i] = (char)0xa5;
    snprintf(buf, sizeof(buf), "%s", p->symbol_name);
    pr_info("hit %s+%u\n", buf, p->offset);
    return 0;
}
"""


def _prog(tmp):
    return cc(tmp, "prog", PROGRAM, "-O2")


def _refused(tmp, prog, sym):
    spec = write_spec(tmp, probe_spec("kprobe", [(sym, 0)], pre_handler="noisy"), NOISY)
    check = kprewrite("check", prog, "--spec", spec, check=False)
    out = instrument(prog, spec, tmp / "out")
    return check, out, kprewrite("list", out).stdout


@pytest.mark.parametrize("sym,check,where", [
    ("jump_into", "jump_into_region", lambda a: a["jump_into"] + 7),      # the jg
    ("jump_table", "indirect_jump", lambda a: a["jump_table"] + 13),      # the jmp *%rax
    ("tiny", "func_size", lambda a: a["tiny"]),
])
def test_safety_check_refuses(once, sym, check, where, runner):
    """A probe the optimizer refuses becomes a breakpoint (int3) probe; check
    still names the check that refused the jump and the offending address."""
    prog = once(_prog)
    addrs = symbols(prog)
    r, out, listing = once(_refused, prog, sym)
    line = r.stdout.strip()
    assert r.returncode == 0 and line.startswith(f"{sym}+0x0  k  int3  "), r.stdout + r.stderr
    assert f"{check} at {where(addrs):#x}" in line, line
    # instrument places it as a breakpoint; the program's behaviour is unchanged.
    r = run(out, runner=runner)
    assert r.returncode == 0, r.stderr
    assert r.stdout == run(prog, runner=runner).stdout
    assert f"hit {sym}+0" in r.stderr
    assert "[OPTIMIZED]" not in listing


HARD = [("rip_rel", 0), ("short_br", 0), ("redzone", 10), ("calls", 4)]


def _hard(tmp, prog):
    spec = write_spec(tmp, probe_spec("kprobe", HARD, pre_handler="noisy"), NOISY)
    return check_lines(prog, spec), instrument(prog, spec, tmp / "prog.kp")


def test_hard_cases_optimized(once, runner):
    prog = once(_prog)
    lines, out = once(_hard, prog)
    assert lines == [f"{s}+{o:#x}  k  optimized" for s, o in HARD]
    expect = run(prog)
    got = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert got.returncode == 0, got.stderr
    assert got.stdout == expect.stdout
    assert "redzone=42\n" in got.stdout and "calls returns inside calls: 1\n" in got.stdout
    prof = profile(got.stderr)
    assert prof == {"p_rip_rel_0": (5, 0), "p_short_br_0": (2, 0), "p_redzone_10": (1, 0), "p_calls_4": (1, 0)}


CXX = r"""
#include <cstdio>
#include <stdexcept>
__attribute__((noinline)) int may_throw(int x) { if (x > 2) throw std::runtime_error("big"); return x; }
__attribute__((noinline)) int catcher(int x) {
    int r = 0;
    try { r = may_throw(x); } catch (const std::exception &e) { r = -1; }
    return r;
}
int main() { int s = 0; for (int i = 0; i < 6; i++) s += catcher(i); std::printf("s=%d\n", s); return 0; }
"""


def _landing_pad(tmp):
    from rewriter.elf import ehframe
    prog = cc(tmp, "prog", CXX, "-O2", lang="c++")
    data = prog.read_bytes()
    fdes = ehframe.read_fdes(data)
    pads = ehframe.landing_pads(data, fdes)
    addrs = symbols(prog)
    catcher = addrs["_Z7catcheri"]
    pad = pads[catcher][0]
    # The instruction that starts within 4 bytes before the landing pad.
    starts = [catcher + off for off, _ in insns(prog, "_Z7catcheri")]
    before = max(a for a in starts if a < pad)
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\n[[kprobe]]\nsymbol_name = "_Z7catcheri"\n'
                      f'offset = {before - catcher}\npre_handler = "noisy"\n', NOISY)
    near = None
    if pad - before < 5:
        near = kprewrite("check", prog, "--spec", spec, check=False), instrument(prog, spec, tmp / "near_pad")
    # Probes on the entries of the throwing and the catching function.
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\n[[kprobe]]\nsymbol_name = "_Z9may_throwi"\npre_handler = "noisy"\n'
                      '[[kprobe]]\nsymbol_name = "_Z7catcheri"\npre_handler = "noisy"\n', NOISY, name="ok.toml")
    return near, instrument(prog, spec)


def test_landing_pad_refuses_and_exceptions_still_work(once, runner):
    near, out = once(_landing_pad)
    if near is not None:                # a probe whose 5 bytes would cover the landing pad
        r, near_out = near
        assert "int3  jump_into_region" in r.stdout and "landing pad" in r.stdout, r.stdout
        # As a breakpoint probe, exceptions still land on the pad.
        r = run(near_out, runner=runner)
        assert r.returncode == 0 and r.stdout == "s=0\n", r.stderr
    # Probes on the entries of the throwing and the catching function: exceptions still land.
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == "s=0\n", r.stderr
    assert profile(r.stderr) == {"p__Z9may_throwi_0": (6, 0), "p__Z7catcheri_0": (6, 0)}


SEMANTICS = r"""
#include <stdio.h>
#include <pthread.h>
#include <stdlib.h>
static int side_effect;
__attribute__((noinline)) long alloc_thing(long n) { side_effect++; return n * 2; }
__attribute__((noinline)) long work(long x) { return x + 85; }
__attribute__((noinline)) long helper(long x) { return x + 1; }
__attribute__((noinline)) long outer(long x, long (*f)(long)) { return x * 10; }
static void *thread(void *arg) { long s = 0; for (long i = 0; i < 200000; i++) s += helper(i); return (void *)s; }
int main(void) {
    long a5 = alloc_thing(5), a6 = alloc_thing(6);
    printf("alloc=%ld,%ld side_effect=%d\n", a5, a6, side_effect);
    printf("work=%ld\n", work(1));
    long o = 0;
    for (int i = 0; i < 10; i++) o += outer(i, helper);
    printf("outer=%ld\n", o);
    pthread_t t[8];
    for (int i = 0; i < 8; i++) pthread_create(&t[i], 0, thread, 0);
    long total = 0;
    for (int i = 0; i < 8; i++) { void *r; pthread_join(t[i], &r); total += (long)r; }
    printf("threads=%ld\n", total);
    return 0;
}
"""

SEM_HANDLERS = r"""
#include <kprewrite/kprobes.h>
/* Fault injection: return -ENOMEM from alloc_thing without running it. */
int fail_alloc(struct kprobe *p, struct pt_regs *regs)
{
    if (regs->di != 6)
        return 0;
    regs->ax = (unsigned long)-12;
    regs->ip = *(unsigned long *)regs->sp;
    regs->sp += 8;
    return 1;
}
/* Rewrites the argument register. */
int set_arg(struct kprobe *p, struct pt_regs *regs) { regs->di = 42; return 0; }
int first(struct kprobe *p, struct pt_regs *regs) { pr_info("first\n"); return 0; }
int second(struct kprobe *p, struct pt_regs *regs) { pr_info("second\n"); return 0; }
/* Calls a probed function from inside a handler: that hit is missed. */
int reenter(struct kprobe *p, struct pt_regs *regs)
{
    long (*f)(long) = (long (*)(long))regs->si;
    f(1);
    return 0;
}
"""

SEM_SPEC = """
handlers = ["handlers.c"]
[[kprobe]]
symbol_name = "alloc_thing"
pre_handler = "fail_alloc"
[[kprobe]]
symbol_name = "work"
pre_handler = "first"
[[kprobe]]
symbol_name = "work"
pre_handler = "set_arg"
[[kprobe]]
symbol_name = "work"
pre_handler = "second"
name = "work_second"
[[kprobe]]
symbol_name = "outer"
pre_handler = "reenter"
[[kprobe]]
symbol_name = "helper"
"""


def _semantics(tmp):
    prog = cc(tmp, "prog", SEMANTICS, "-O2", "-pthread")
    return instrument(prog, write_spec(tmp, SEM_SPEC, SEM_HANDLERS))


def test_semantics(once, runner):
    out = once(_semantics)
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    total = 8 * sum(i + 1 for i in range(200000))
    assert r.stdout == f"alloc=10,-12 side_effect=1\nwork=127\nouter={sum(i * 10 for i in range(10))}\nthreads={total}\n"
    # Aggregation: pre_handlers in spec order.
    assert [l for l in r.stderr.splitlines() if l in ("first", "second")] == ["first", "second"]
    prof = profile(r.stderr)
    assert prof["p_alloc_thing_0"] == (2, 0)
    assert prof["p_outer_0"] == (10, 0)
    # helper: 1.6 M hits from 8 threads, exact; the 10 calls from inside a handler are missed.
    assert prof["p_helper_0"] == (8 * 200000, 10)
