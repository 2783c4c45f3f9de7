"""kretprobes whose handlers never read regs: the entry and return halves are
per-site templates with the common case inlined (retprobe.kret_entry_body,
retprobe.clean_ret_hook) and everything else in C.  Real programs, natively
and under qemu-x86_64; the uncommon cases (maxactive exhausted, abandoned
frames, tail calls, a regs-reading caller's instance at the same slot,
threads) are driven on purpose."""
from __future__ import annotations

import pytest

from conftest import ALL_ARCHES, ARCH, cc, instrument, meta, probe_spec, profile, run, write_spec
from test_kretprobe import (EXCEPTIONS, HANDLERS as REGS_HANDLERS, LONGJMP, RECURSION, TAIL_FUNCS, TAILS, THREADS,
                            check_threads_run, events)

ARCHES = ALL_ARCHES

# Handlers that never read regs: the entry handler numbers the call in
# ri->data, the return handler prints that number (so order and pairing show).
CLEAN = r"""
#include <kprewrite/kprobes.h>
static long seq;
int c_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	*(long *)ri->data = ++seq;
	pr_info("E %s %ld\n", ri->rp->kp.symbol_name, *(long *)ri->data);
	return 0;
}
int c_return(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	pr_info("R %s %ld\n", ri->rp->kp.symbol_name, *(long *)ri->data);
	return 0;
}
int c_count(struct kretprobe_instance *ri, struct pt_regs *regs) { return 0; }
"""


# The keys of a [[kretprobe]] table with those handlers (probe_spec("kretprobe", funcs, **CLEAN_KRET)).
CLEAN_KRET = dict(handler="c_return", data_size=8, entry_handler="c_entry")


def kret_meta(out) -> dict:
    return {p["symbol"]: p for p in meta(out)["probes"] if p["kind"] == "r"}


def assert_inline(out, *funcs):
    meta = kret_meta(out)
    for f in funcs:
        m = meta[f]
        assert (m["call"], m["inline_dispatch"], m["return_hook"]) == ("clean", True, "inline clean"), (f, m)


def _recursion(tmp):
    prog = cc(tmp, "prog", RECURSION, "-O2")
    return instrument(prog, write_spec(tmp, probe_spec("kretprobe", ["rec"], **CLEAN_KRET, maxactive=10), CLEAN))


def test_recursion_deeper_than_maxactive_clean(once, runner):
    out = once(_recursion)
    assert_inline(out, "rec")
    depth = 29                      # 30 nested calls: 10 get an instance, 20 miss
    r = run(out, depth, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"s={2 * depth * (depth + 1) // 2}\n"
    exp = []
    for k in (0, 10):
        exp += [f"E rec {k + i}" for i in range(1, 11)] + [f"R rec {k + i}" for i in range(10, 0, -1)]
    assert events(r.stderr) == exp
    assert profile(r.stderr) == {"r_rec_0": (60, 40)}


def _entry_nonzero(tmp):
    prog = cc(tmp, "prog", RECURSION, "-O2")
    handlers = CLEAN + r"""
static long n;
int every_other(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	*(long *)ri->data = ++n;
	return n % 2 == 0;
}
"""
    return instrument(prog, write_spec(tmp, probe_spec("kretprobe", ["rec"], **dict(CLEAN_KRET, entry_handler="every_other"),
                                                      maxactive=2), handlers))


def test_entry_handler_nonzero_drops_the_return_clean(once, runner):
    out = once(_entry_nonzero)
    assert_inline(out, "rec")
    r = run(out, 5, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    # Round one: n=1 kept, n=2 dropped (its instance is free again), n=3 kept,
    # then both instances are taken and three calls miss (no entry_handler).
    # Round two: n=4 dropped, 5 kept, 6 dropped, 7 kept, two calls miss.
    assert events(r.stderr) == [f"R rec {i}" for i in (3, 1, 7, 5)]
    assert profile(r.stderr) == {"r_rec_0": (12, 5)}


def _exceptions_and_longjmp(tmp):
    prog = cc(tmp, "exc", EXCEPTIONS, "-O2", lang="c++")
    out = instrument(prog, write_spec(tmp, probe_spec("kretprobe", ["thrower", "middle"], **CLEAN_KRET, maxactive=3), CLEAN))
    prog = cc(tmp, "lj", LONGJMP, "-O2")
    return out, instrument(prog, write_spec(tmp, probe_spec("kretprobe", ["probed"], **CLEAN_KRET, maxactive=3), CLEAN,
                                            name="lj.toml"))


def test_exceptions_and_longjmp_clean(once, runner):
    """Frames left by C++ unwinding and by longjmp: their instances are
    reclaimed, never fired, and later calls find instances (maxactive 3, so
    the inlined claim at the hint succeeds and the entry must reclaim)."""
    out, out_lj = once(_exceptions_and_longjmp)
    assert_inline(out, "thrower", "middle")
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"sum={sum(i * 10 + 1 for i in range(3000) if i % 3)} caught=1000\n"
    exp, n = [], 0
    for i in range(3000):
        exp += [f"E middle {n + 1}", f"E thrower {n + 2}"]
        if i % 3:
            exp += [f"R thrower {n + 2}", f"R middle {n + 1}"]
        n += 2
    assert events(r.stderr) == exp
    assert profile(r.stderr) == {"r_thrower_0": (3000, 0), "r_middle_0": (3000, 0)}

    out = out_lj
    assert_inline(out, "probed")
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"jumps=5000 s={sum(2 * (i + 1) for i in range(5000))}\n"
    exp = [f"E probed {k}" for k in range(1, 5001)]
    for k in range(5001, 10001):
        exp += [f"E probed {k}", f"R probed {k}"]
    assert events(r.stderr) == exp
    assert profile(r.stderr) == {"r_probed_0": (10000, 0)}


def _tails(tmp):
    prog = cc(tmp, "prog", TAILS, "-O2")
    out = instrument(prog, write_spec(tmp, probe_spec("kretprobe", TAIL_FUNCS, **CLEAN_KRET), CLEAN))
    handlers = REGS_HANDLERS + CLEAN.replace("#include <kprewrite/kprobes.h>", "")
    spec = ('handlers = ["handlers.c"]\n'
            '[[kretprobe]]\nsymbol_name = "tail_probed"\nhandler = "on_return"\nentry_handler = "on_entry"\ndata_size = 8\n'
            '[[kretprobe]]\nsymbol_name = "leaf_probed"\nhandler = "c_return"\nentry_handler = "c_entry"\ndata_size = 8\n')
    return out, instrument(prog, write_spec(tmp, spec, handlers, name="mixed.toml"), tmp / "prog.mixed.kp")


def test_tail_calls_clean_and_a_regs_reading_caller(once, runner):
    """Tail calls between clean kretprobes (the caller's pending instance fires
    at the callee's inlined hook, through C), and a tail call from a function
    whose handler reads regs into a clean one: at the callee's ret the inlined
    hook hands over to the full one, which builds pt_regs for it."""
    out, out_mixed = once(_tails)
    assert_inline(out, "multi", "leaf_probed")
    r = run(out, runner=runner)
    assert r.returncode == 0, r.stderr
    exp, n = [], 0
    for i in range(4):
        for f, inner in (("multi", None), ("tail_probed", "leaf_probed"), ("tail_plain", None),
                         ("tail_libc", None), ("tail_either", "leaf_probed" if i & 1 else None)):
            n += 1
            outer = n
            exp.append(f"E {f} {outer}")
            if inner:
                n += 1
                exp += [f"E {inner} {n}", f"R {inner} {n}"]
            exp.append(f"R {f} {outer}")
    assert events(r.stderr) == exp

    # tail_probed's handler reads regs (the return value); leaf_probed's does not.
    out = out_mixed
    meta = kret_meta(out)
    assert meta["leaf_probed"]["return_hook"] == "inline clean", meta
    assert meta["tail_probed"]["return_hook"] == "pt_regs", meta      # its one exit is the tail call
    r = run(out, runner=runner)
    assert r.returncode == 0, r.stderr
    exp, n = [], 0
    for i in range(4):
        n += 1
        exp += [f"E tail_probed {i}", f"E leaf_probed {n}", f"R leaf_probed {n}", f"R tail_probed {i} = {3 * (i + 1)}"]
        if i & 1:
            n += 1
            exp += [f"E leaf_probed {n}", f"R leaf_probed {n}"]
    assert events(r.stderr) == exp


THREAD_CHECK = r"""
#include <kprewrite/kprobes.h>
static long returns, bad;
/* Each instance's data holds its own slot and return address, written at
 * entry; another thread's or call's instance would not match. */
int t_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	((unsigned long *)ri->data)[0] = (unsigned long)ri->fp ^ 0x5a5a5a5aUL;
	((unsigned long *)ri->data)[1] = (unsigned long)ri->ret_addr;
	return 0;
}
int t_return(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	__atomic_fetch_add(&returns, 1, __ATOMIC_RELAXED);
	if (((unsigned long *)ri->data)[0] != ((unsigned long)ri->fp ^ 0x5a5a5a5aUL) ||
	    ((unsigned long *)ri->data)[1] != *(unsigned long *)ri->fp)
		__atomic_fetch_add(&bad, 1, __ATOMIC_RELAXED);
	return 0;
}
int report(struct kprobe *p, struct pt_regs *regs) { pr_info("returns=%ld bad=%ld\n", returns, bad); return 0; }
"""


def _threads(tmp):
    prog = cc(tmp, "prog", THREADS, "-O2", "-pthread")
    spec = ('handlers = ["handlers.c"]\n[[kretprobe]]\nsymbol_name = "probed"\nhandler = "t_return"\n'
            'entry_handler = "t_entry"\ndata_size = 16\nmaxactive = 16\n'
            '[[kprobe]]\nsymbol_name = "report"\npre_handler = "report"\n')
    return instrument(prog, write_spec(tmp, spec, THREAD_CHECK))


@pytest.mark.skipif(ARCH != "x86_64", reason="ri->fp is the return address's slot on x86-64 only (arm64: the sp)")
def test_threads_clean(once, runner):
    out = once(_threads)
    assert_inline(out, "probed")
    check_threads_run(out, runner)


# Caller-saved registers and the flags a function leaves must survive the
# inlined hooks (gcc's -fipa-ra lets a caller rely on registers a callee is
# known not to touch).  plong has its own return site; pshort's ret lies in
# the entry's region (the hook is inlined in the entry detour).
REGS = r"""
#include <stdio.h>
__asm__(".text\n"
	".globl plong\n.type plong,@function\nplong:\n"
	"  push %rbx\n  mov %rdi, %rbx\n  lea 1(%rbx), %rax\n  stc\n"
	"  nop\n  nop\n  nop\n  nop\n  nop\n  nop\n  pop %rbx\n  ret\n.size plong,.-plong\n"
	".globl pshort\n.type pshort,@function\npshort:\n  lea 2(%rdi), %rax\n  ret\n.size pshort,.-pshort\n"
	".globl regcheck\n.type regcheck,@function\nregcheck:\n"
	"  push %rbx\n  push %r12\n  push %r13\n  mov %rdi, %r12\n  mov %rsi, %rdi\n"
	"  mov $0x1111, %ecx\n  mov $0x2222, %edx\n  mov $0x3333, %esi\n  mov $0x8888, %r8d\n"
	"  mov $0x9999, %r9d\n  mov $0xaaaa, %r10d\n  mov $0xbbbb, %r11d\n  clc\n"
	"  call *%r12\n"
	"  setc %bl\n  movzbl %bl, %ebx\n  lea after(%rip), %r13\n"
	"  mov %rcx, 0(%r13)\n  mov %rdx, 8(%r13)\n  mov %rsi, 16(%r13)\n  mov %r8, 24(%r13)\n"
	"  mov %r9, 32(%r13)\n  mov %r10, 40(%r13)\n  mov %r11, 48(%r13)\n  mov %rbx, 56(%r13)\n"
	"  pop %r13\n  pop %r12\n  pop %rbx\n  ret\n.size regcheck,.-regcheck\n");
long plong(long), pshort(long), regcheck(long (*)(long), long);
unsigned long after[8];
int main(void)
{
	static const unsigned long want[7] = { 0x1111, 0x2222, 0x3333, 0x8888, 0x9999, 0xaaaa, 0xbbbb };
	int bad = 0;
	for (long i = 0; i < 1000; i++) {
		long a = regcheck(plong, i);
		for (int k = 0; k < 7; k++)
			bad += after[k] != want[k];
		bad += after[7] != 1 || a != i + 1;	/* plong returns with CF set */
		long b = regcheck(pshort, i);
		for (int k = 0; k < 7; k++)
			bad += after[k] != want[k];
		bad += b != i + 2;
	}
	printf("bad=%d\n", bad);
	return 0;
}
"""

# Handlers that write every call-clobbered register they can: pr_info calls
# into the runtime.
NOISY = r"""
#include <kprewrite/kprobes.h>
int n_entry(struct kretprobe_instance *ri, struct pt_regs *regs) { *(long *)ri->data = 7; return 0; }
int n_return(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	static long k;
	if (++k % 500 < 2)
		pr_info("R %s %ld\n", ri->rp->kp.symbol_name, *(long *)ri->data);
	return 0;
}
"""


def _regs(tmp, handlers):
    prog = cc(tmp, "prog", REGS, "-O2")
    src = NOISY if handlers == "noisy" else NOISY.replace(
        "\tif (++k % 500 < 2)\n\t\tpr_info(\"R %s %ld\\n\", ri->rp->kp.symbol_name, *(long *)ri->data);\n",
        "\t++k;\n")
    spec = probe_spec("kretprobe", ["plong", "pshort"], handler="n_return", data_size=8, entry_handler="n_entry")
    return instrument(prog, write_spec(tmp, spec, src))


@pytest.mark.parametrize("handlers", ["noisy", "leaf"])
@pytest.mark.skipif(ARCH != "x86_64", reason="x86-64 assembly")
def test_registers_and_flags_survive_the_inlined_hooks(once, runner, handlers):
    out = once(_regs, handlers)
    assert_inline(out, "plong", "pshort")
    meta = kret_meta(out)
    assert meta["pshort"]["return_sites"][0][0] == meta["pshort"]["addr"]        # embedded in the entry detour
    assert meta["plong"]["return_sites"][0][0] != meta["plong"]["addr"]
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == "bad=0\n"
    if handlers == "noisy":
        assert events(r.stderr) == ["R plong 7", "R pshort 7"] * 4
    assert profile(r.stderr) == {"r_plong_0": (1000, 0), "r_pshort_0": (1000, 0)}
