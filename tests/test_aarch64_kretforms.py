"""AArch64's inlined kretprobe halves (emit.kret_entry_detour(), retprobe.clean_ret_hook()
and full_ret_hook()), as x86-64's (tests/test_kretprobe_clean.py): the entry claims the
instance at the pool's hint, records it and pushes it, and calls the entry_handler
directly; the hook inlined before each `ret` pops the instance recorded at that sp and
calls the handler directly, with struct pt_regs built in place when it reads regs.  The
uncommon cases (maxactive exhausted, frames left by longjmp and C++ unwinding, tail
calls, a regs-reading caller's instance at the same slot, threads) go to the runtime's
C, and are driven on purpose under qemu-aarch64; `regcheck` asserts that every register
x1-x18 and the flags a function returns with survive both halves."""
from __future__ import annotations

import pytest

from conftest import cc, instrument, probe_spec, profile, run, write_spec
from test_kretprobe import THREADS, events
# The same programs, handlers and assertions as on x86-64: collected here, they run
# under qemu-aarch64 (this module's ARCHES).
from test_kretprobe_clean import (CLEAN, assert_inline, kret_meta,  # noqa: F401
                                  test_entry_handler_nonzero_drops_the_return_clean,
                                  test_exceptions_and_longjmp_clean, test_recursion_deeper_than_maxactive_clean,
                                  test_tail_calls_clean_and_a_regs_reading_caller)

ARCHES = ["aarch64"]

# pf(x): x + 1 if the flags it is entered with say "ne", then returns with Z and C set;
# it touches no other register.  regcheck(pf, x) calls it with x1-x18 holding known
# values and "ne" (x19 = pf is not 0), and records x1-x18 and NZCV after the return.
REGS = r"""
#include <stdio.h>
__asm__(".text\n"
	".globl pf\n.type pf,%function\npf:\n"
	"  cinc x0, x0, ne\n  cmp x0, x0\n  ret\n.size pf,.-pf\n"
	".globl regcheck\n.type regcheck,%function\nregcheck:\n"
	"  stp x29, x30, [sp, #-32]!\n  mov x29, sp\n  stp x19, x20, [sp, #16]\n"
	"  mov x19, x0\n  mov x0, x1\n"
	"  mov x1, #0x101\n  mov x2, #0x102\n  mov x3, #0x103\n  mov x4, #0x104\n  mov x5, #0x105\n"
	"  mov x6, #0x106\n  mov x7, #0x107\n  mov x8, #0x108\n  mov x9, #0x109\n  mov x10, #0x10a\n"
	"  mov x11, #0x10b\n  mov x12, #0x10c\n  mov x13, #0x10d\n  mov x14, #0x10e\n  mov x15, #0x10f\n"
	"  mov x16, #0x110\n  mov x17, #0x111\n  mov x18, #0x112\n"
	"  cmp x19, #0\n  blr x19\n"
	"  mrs x20, nzcv\n  adrp x19, after\n  add x19, x19, :lo12:after\n"
	"  stp x1, x2, [x19]\n  stp x3, x4, [x19, #16]\n  stp x5, x6, [x19, #32]\n  stp x7, x8, [x19, #48]\n"
	"  stp x9, x10, [x19, #64]\n  stp x11, x12, [x19, #80]\n  stp x13, x14, [x19, #96]\n"
	"  stp x15, x16, [x19, #112]\n  stp x17, x18, [x19, #128]\n  str x20, [x19, #144]\n"
	"  ldp x19, x20, [sp, #16]\n  ldp x29, x30, [sp], #32\n  ret\n.size regcheck,.-regcheck\n");
long pf(long), regcheck(long (*)(long), long);
unsigned long after[19];
int main(void)
{
	int bad = 0;
	for (long i = 0; i < 1000; i++) {
		long a = regcheck(pf, i);
		for (int k = 0; k < 18; k++)
			bad += after[k] != 0x101 + k;
		bad += after[18] != 0x60000000 || a != i + 1;	/* Z and C, from pf's cmp */
	}
	printf("bad=%d\n", bad);
	return 0;
}
"""

REG_HANDLERS = {
    # Calls C (pr_info): may write every call-clobbered register and the flags.
    "noisy": r"""
#include <kprewrite/kprobes.h>
int n_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	static long e;
	*(long *)ri->data = 7;
	if (++e % 500 == 1)
		pr_info("E %s\n", ri->rp->kp.symbol_name);
	return 0;
}
int n_return(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	static long k;
	if (++k % 500 < 2)
		pr_info("R %s %ld\n", ri->rp->kp.symbol_name, *(long *)ri->data);
	return 0;
}
""",
    # Leaves: kprewrite reads which registers they write (the entry's cmp, the flags).
    "leaf": r"""
#include <kprewrite/kprobes.h>
static long k;
/* 7, from a comparison that leaves "eq" (pf is entered with "ne"). */
int n_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	*(long *)ri->data = 6 + (ri->rp->kp.symbol_name[0] == 'p');
	return 0;
}
int n_return(struct kretprobe_instance *ri, struct pt_regs *regs) { k += *(long *)ri->data; return 0; }
""",
    # Reads regs: the return value, pc (the return address) and sp (the entry's) it sees.
    "regs": r"""
#include <kprewrite/kprobes.h>
static long k, sum, bad;
int n_entry(struct kretprobe_instance *ri, struct pt_regs *regs) { *(long *)ri->data = 7; return 0; }
int n_return(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	sum += regs_return_value(regs);
	bad += regs->pc != (unsigned long)ri->ret_addr || regs->sp != (unsigned long)ri->fp
		|| *(long *)ri->data != 7 || (regs->pstate & 0xf0000000) != 0x60000000;
	if (++k % 500 < 2)
		pr_info("R %s %ld sum %ld bad %ld\n", ri->rp->kp.symbol_name, *(long *)ri->data, sum, bad);
	return 0;
}
""",
    # Reads regs at the entry too (the pt_regs template): sp, x30 and pc as at the entry.
    "regs_entry": r"""
#include <kprewrite/kprobes.h>
static long k, sum, bad;
int n_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	*(long *)ri->data = 7;
	bad += regs->sp != (unsigned long)ri->fp || regs->regs[30] != (unsigned long)ri->ret_addr
		|| regs->pc != (unsigned long)ri->rp->kp.addr || regs->regs[1] != 0x101;
	return 0;
}
int n_return(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	sum += regs_return_value(regs);
	bad += regs->pc != (unsigned long)ri->ret_addr || regs->sp != (unsigned long)ri->fp
		|| *(long *)ri->data != 7 || (regs->pstate & 0xf0000000) != 0x60000000;
	if (++k % 500 < 2)
		pr_info("R %s %ld sum %ld bad %ld\n", ri->rp->kp.symbol_name, *(long *)ri->data, sum, bad);
	return 0;
}
""",
}


def _regs(tmp, handlers):
    prog = cc(tmp, "prog", REGS, "-O2")
    spec = probe_spec("kretprobe", ["pf"], handler="n_return", data_size=8, entry_handler="n_entry")
    return instrument(prog, write_spec(tmp, spec, REG_HANDLERS[handlers]))


@pytest.mark.parametrize("handlers", ["noisy", "leaf", "regs", "regs_entry"])
def test_registers_and_flags_survive_the_inlined_halves(once, handlers):
    out = once(_regs, handlers)
    m = kret_meta(out)["pf"]
    assert (m["call"], m["inline_dispatch"], m["returns"]) == \
        ("pt_regs" if handlers == "regs_entry" else "clean", True, "optimized"), m
    assert m["return_hook"] == ("inline pt_regs" if handlers.startswith("regs") else "inline clean"), m
    r = run(out, runner="qemu", env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == "bad=0\n"
    if handlers == "noisy":
        assert events(r.stderr) == ["E pf", "R pf 7", "R pf 7", "E pf", "R pf 7", "R pf 7"]
    if handlers.startswith("regs"):
        # pf returns i + 1 for call i (from 0): the sums after calls 1, 500, 501 and 1000.
        sums = [sum(j + 1 for j in range(n)) for n in (1, 500, 501, 1000)]
        assert events(r.stderr) == [f"R pf 7 sum {s} bad 0" for s in sums]
    assert profile(r.stderr) == {"r_pf_0": (1000, 0)}


# Each instance's data holds its own slot (sp at the entry) and the thread pointer, written
# at entry by a handler that never reads regs; another thread's or call's would not match.
THREAD_CHECK = r"""
#include <kprewrite/kprobes.h>
static long returns, bad;
int t_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	((unsigned long *)ri->data)[0] = (unsigned long)ri->fp ^ 0x5a5a5a5aUL;
	((unsigned long *)ri->data)[1] = (unsigned long)__builtin_thread_pointer();
	return 0;
}
int t_return(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	__atomic_fetch_add(&returns, 1, __ATOMIC_RELAXED);
	if (((unsigned long *)ri->data)[0] != ((unsigned long)ri->fp ^ 0x5a5a5a5aUL) ||
	    ((unsigned long *)ri->data)[1] != (unsigned long)__builtin_thread_pointer())
		__atomic_fetch_add(&bad, 1, __ATOMIC_RELAXED);
	return 0;
}
int report(struct kprobe *p, struct pt_regs *regs) { pr_info("returns=%ld bad=%ld\n", returns, bad); return 0; }
"""


def _threads(tmp, maxactive):
    prog = cc(tmp, "prog", THREADS, "-O2", "-pthread")
    spec = ('handlers = ["handlers.c"]\n[[kretprobe]]\nsymbol_name = "probed"\nhandler = "t_return"\n'
            f'entry_handler = "t_entry"\ndata_size = 16\nmaxactive = {maxactive}\n'
            '[[kprobe]]\nsymbol_name = "report"\npre_handler = "report"\n')
    return instrument(prog, write_spec(tmp, spec, THREAD_CHECK))


@pytest.mark.parametrize("maxactive", [16, 4])
def test_threads_clean(once, maxactive):
    """8 threads x 20,000 calls: with 16 instances every call gets one (the claim at the
    hint, or C's scan of the pool when another thread holds it), none sees another's
    data; with 4 for 8 threads, the calls that find none count in nmissed, and every
    other call has its return handler."""
    out = once(_threads, maxactive)
    assert_inline(out, "probed")
    r = run(out, runner="qemu", env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    n = 8 * 20000
    assert r.stdout == f"s={sum(2 * (t * 1000000 + i + 1) for t in range(8) for i in range(20000))}\n"
    hits, missed = profile(r.stderr)["r_probed_0"]
    assert hits == n
    if maxactive == 16:
        assert missed == 0
    assert f"returns={n - missed} bad=0" in r.stderr, r.stderr
