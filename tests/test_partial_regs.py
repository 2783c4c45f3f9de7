"""The partial pt_regs template: a site with one probe whose pre_handler only loads
from regs at constant offsets (handler_abi.regs_loads()) gets the clean template with
those pt_regs fields stored in its frame and nothing restored (emit.clean_detour's
regs_fields).  These programs check that the handler sees every field it reads as the
kernel's optprobe would show it (registers, the flags, ip, sp), on the fast path and
the slow one (a thread's first hit, a missed hit from a signal handler), and that a
handler that writes regs, passes it on or reads at a computed offset keeps the full
form, whose writes take effect."""
from __future__ import annotations

import re

from conftest import cc, instrument, kprewrite, meta, profile, run, write_spec

ARCHES = ["x86_64"]      # x86-64 only: x86-64 assembly (the partial pt_regs template)

PROG = r"""
#include <signal.h>
#include <stdio.h>
#include <sys/time.h>
/* mid(a, b): at +16 the flags of `cmp %rsi,%rdi` are live (seta reads them after the
   probe), %rbx and %r10 hold known values, and the stack is 16-byte aligned (one push
   after the entry's return address). */
__asm__(
".text\n.globl mid\n.type mid,@function\nmid:\n"
"  push %rbx\n"                   /* +0 */
"  mov %rdi,%rbx\n"               /* +1 */
"  lea 7(%rsi),%r10\n"            /* +4 */
"  nop\n  nop\n  nop\n  nop\n  nop\n  nop\n  nop\n"   /* +8 */
"  cmp %rsi,%rdi\n"               /* +15: 3 bytes */
"  mov $100,%eax\n"               /* +18: the probe (5 bytes, flags untouched) */
"  seta %cl\n"
"  movzbl %cl,%ecx\n"
"  imul %rcx,%rax\n"
"  add %rbx,%rax\n  add %r10,%rax\n"
"  pop %rbx\n  ret\n"
".size mid,.-mid\n");
long mid(long, long);
__attribute__((noinline)) long entry2(long a, long b) { return a * 10 + b; }
__attribute__((noipa)) long twice(long x) { return 2 * x; }
__attribute__((noipa)) long passed(long x) { return x + 1; }
__attribute__((noipa)) long indexed(long x) { return x + 2; }
static volatile long in_signal;
static void tick(int sig) { in_signal += entry2(-1, -2); }    /* may hit while a handler runs */
int main(void) {
    long m = 0;
    for (long i = 0; i < 3; i++)
        m += mid(i, 1);                                   /* a < b, a == b, a > b */
    printf("mid %ld\n", m);
    signal(SIGALRM, tick);
    struct itimerval it = {{0, 50}, {0, 50}};
    setitimer(ITIMER_REAL, &it, 0);
    long s = 0;
    for (long i = 0; i < 200000; i++)
        s += entry2(i, i & 7);
    it.it_value.tv_usec = it.it_interval.tv_usec = 0;
    setitimer(ITIMER_REAL, &it, 0);
    printf("entry2 %ld\n", s);
    long t = 0;
    for (long i = 0; i < 100; i++)
        t += twice(i) + passed(i) + indexed(i);
    printf("rest %ld\n", t);
    return 0;
}
"""

HANDLERS = r"""
#include <kprewrite/kprobes.h>
/* Loads only: the partial pt_regs.  What it prints is checked against the program. */
int at_mid(struct kprobe *p, struct pt_regs *regs)
{
    pr_info("mid bx=%lu r10=%lu cf=%lu zf=%lu if=%lu ip=%lu sp16=%lu\n", regs->bx, regs->r10,
            regs->flags & 1, regs->flags >> 6 & 1, regs->flags >> 9 & 1,
            regs->ip - (unsigned long)p->addr, regs->sp & 15);
    return 0;
}
/* A leaf reading two registers (the benchmark's kind): summed, printed at the end. */
static unsigned long sum;
int at_entry2(struct kprobe *p, struct pt_regs *regs)
{
    if ((long)regs->di >= 0)                        /* not the signal handler's calls */
        sum += regs->di * 3 + regs->si;
    if (regs->di == 199999)
        pr_info("entry2 sum=%lu\n", sum);
    return 0;
}
/* Writes regs: the full form, and the write takes effect. */
int at_twice(struct kprobe *p, struct pt_regs *regs) { if (regs->di == 7) regs->di = 1000; return 0; }
/* Passes regs on: the full form. */
static unsigned long fetched;
__attribute__((noinline)) unsigned long fetch_di(struct pt_regs *regs) { return regs->di; }
int at_passed(struct kprobe *p, struct pt_regs *regs) { fetched += fetch_di(regs); return 0; }
/* Reads at a computed offset: the full form. */
static volatile unsigned int which = 14;            /* pt_regs word 14: di */
static unsigned long indexed_sum;
int at_indexed(struct kprobe *p, struct pt_regs *regs)
{
    indexed_sum += ((unsigned long *)regs)[which];
    if (regs->di == 99)
        pr_info("passed=%lu indexed=%lu\n", fetched, indexed_sum);
    return 0;
}
"""

SPEC = """
handlers = ["handlers.c"]
[[kprobe]]
symbol_name = "mid"
offset = 18
pre_handler = "at_mid"
[[kprobe]]
symbol_name = "entry2"
pre_handler = "at_entry2"
[[kprobe]]
symbol_name = "twice"
pre_handler = "at_twice"
[[kprobe]]
symbol_name = "passed"
pre_handler = "at_passed"
[[kprobe]]
symbol_name = "indexed"
pre_handler = "at_indexed"
"""

# pt_regs byte offsets (arch/x86/include/asm/ptrace.h).
PT = {"bx": 40, "r10": 56, "si": 104, "di": 112, "ip": 128, "flags": 144, "sp": 152}


def _mid(a, b):
    return (100 if a > b else 0) + a + b + 7


def _expected(rewritten: bool):
    twice = sum(2 * (1000 if rewritten and i == 7 else i) for i in range(100))
    rest = twice + sum(i + 1 + i + 2 for i in range(100))
    return (f"mid {sum(_mid(i, 1) for i in range(3))}\n"
            f"entry2 {sum(i * 10 + (i & 7) for i in range(200000))}\n"
            f"rest {rest}\n")


def _prog(tmp):
    prog = cc(tmp, "prog", PROG, "-O2")
    return prog, instrument(prog, write_spec(tmp, SPEC, HANDLERS))


def test_partial_form_is_chosen_by_the_handlers_code(once):
    """Loads only: the template with the fields read (list --format json's regs_fields);
    a write, a call with regs or a computed offset: the full pt_regs template."""
    prog, out = once(_prog)
    forms = {p["symbol"]: (p["call"], p["inline_dispatch"], p.get("regs_fields")) for p in meta(out)["probes"]}
    assert forms == {"mid": ("pt_regs", True, sorted(PT[f] for f in ("bx", "r10", "ip", "flags", "sp"))),
                     "entry2": ("pt_regs", True, [PT["si"], PT["di"]]),
                     "twice": ("pt_regs", True, None), "passed": ("pt_regs", True, None),
                     "indexed": ("pt_regs", True, None)}
    import json
    listed = {p["symbol"]: p.get("regs_fields") for p in
              json.loads(kprewrite("list", out, "--format", "json").stdout)["probes"]}
    assert listed["entry2"] == [PT["si"], PT["di"]] and listed["twice"] is None


def test_partial_regs_values(once, runner):
    """Every field the handler reads is as at the probe: %rbx and %r10, the flags of the
    cmp (CF, ZF, IF set), ip = the probe + 1, sp where the probed code has it; two
    registers summed over 200,000 hits, some of them missed from a 50 us timer's signal
    handler (the slow path), as the program computes them.  The write of the full form
    takes effect; the other full-form handlers read di."""
    prog, out = once(_prog)
    assert run(prog).stdout == _expected(False)
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == _expected(True), r.stderr
    mids = re.findall(r"mid bx=(\d+) r10=(\d+) cf=(\d) zf=(\d) if=(\d) ip=(\d+) sp16=(\d+)", r.stderr)
    assert mids == [(str(a), str(1 + 7), str(int(a < 1)), str(int(a == 1)), "1", "1", "0") for a in range(3)], r.stderr
    prof = profile(r.stderr)
    hits, missed = prof["p_entry2_0"]
    # Each hit ran the handler but those that found it running (a signal in it): missed.
    signals = hits + missed - 200000
    assert signals >= 0
    assert f"entry2 sum={sum(i * 3 + (i & 7) for i in range(200000))}\n" in r.stderr, r.stderr
    assert f"passed={sum(i for i in range(100))} indexed={sum(i for i in range(100))}\n" in r.stderr, r.stderr
    assert prof["p_mid_18"] == (3, 0) and prof["p_twice_0"] == (100, 0)


def test_partial_regs_disarmed(once, runner):
    """KPREWRITE_ENABLED=0: every hit takes the slow path, which runs nothing."""
    prog, out = once(_prog)
    r = run(out, runner=runner, env={"KPREWRITE_ENABLED": "0", "KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == _expected(False), r.stderr
    assert "mid bx" not in r.stderr and profile(r.stderr)["p_entry2_0"] == (0, 0)
