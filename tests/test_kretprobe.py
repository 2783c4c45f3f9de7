"""kretprobes that keep the program's stack honest: real programs, rewritten
with the CLI, run natively and under qemu-x86_64; and cross-built for aarch64,
under qemu-aarch64 (KPREWRITE_TEST_ARCH=aarch64), the tests not marked
x86_only (their handlers name registers through the kernel's arch-neutral
accessors: regs_get_kernel_argument(), instruction_pointer(),
regs_return_value())."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from conftest import ALL_ARCHES, ARCH, CC, ROOT, cc, check_lines, insns, instrument, kprewrite, meta, probe_spec, profile, run, write_spec

ARCHES = ALL_ARCHES
# A test that depends on x86-64 facts (its assembly, objdump's x86 syntax, regs->ax).
x86_only = pytest.mark.skipif(ARCH != "x86_64", reason="depends on x86-64 code or registers")

# Handlers shared by most tests: the entry handler keeps the first argument in
# ri->data, the return handler prints it with the return value and checks that
# regs->ip is the caller's return address (ri->ret_addr).
HANDLERS = r"""
#include <kprewrite/kprobes.h>
struct my_data { long arg; };
int on_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	((struct my_data *)ri->data)->arg = regs_get_kernel_argument(regs, 0);
	pr_info("E %s %ld\n", ri->rp->kp.symbol_name, (long)regs_get_kernel_argument(regs, 0));
	return 0;
}
int on_return(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	pr_info("R %s %ld = %ld%s\n", ri->rp->kp.symbol_name, ((struct my_data *)ri->data)->arg,
		(long)regs_return_value(regs), instruction_pointer(regs) == (unsigned long)ri->ret_addr ? "" : " BAD-IP");
	return 0;
}
"""


# The keys of a [[kretprobe]] table with those handlers (probe_spec("kretprobe", funcs, **KRET)).
KRET = dict(handler="on_return", data_size=8, entry_handler="on_entry")


def events(stderr: str) -> list[str]:
    return [l for l in stderr.splitlines() if l[:2] in ("E ", "R ")]


def hooked(line: str, name: str | None = None) -> bool:
    """A kretprobe whose every exit is hooked (not the trampoline fallback)."""
    return ("  r  optimized  returns: " in line and "returns: trampoline" not in line
            and (name is None or line.startswith(f"{name}+0x0  r  ")))


# --- 1. __builtin_return_address and backtrace() see the real caller ----------

HONEST = r"""
#include <execinfo.h>
#include <stdio.h>
#include <stdlib.h>
long caller(long);
__attribute__((noinline)) long probed(long x)
{
	void *ra = __builtin_return_address(0);
	void *bt[8];
	int n = backtrace(bt, 8);
	int ra_ok = (char *)ra > (char *)caller && (char *)ra < (char *)caller + 200;
	int bt_ok = n >= 2 && (char *)bt[1] > (char *)caller && (char *)bt[1] < (char *)caller + 200;
	printf("ra_ok=%d bt_ok=%d\n", ra_ok, bt_ok);
	return x + 1;
}
__attribute__((noinline)) long caller(long x) { long r = probed(x); __asm__ volatile("" : "+r"(r)); return r * 2; }
int main(int argc, char **argv)
{
	long s = 0;
	for (int i = 0; i < 3; i++)
		s += caller(i);
	printf("s=%ld\n", s);
	return 0;
}
"""


def _honest(tmp):
    prog = cc(tmp, "prog", HONEST, "-O2")
    spec = write_spec(tmp, probe_spec("kretprobe", ["probed", "caller"], **KRET), HANDLERS)
    return check_lines(prog, spec), instrument(prog, spec)


def test_return_address_and_backtrace_show_the_real_caller(once, runner):
    lines, out = once(_honest)
    assert hooked(lines[0], "probed") and hooked(lines[1], "caller"), lines
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == "ra_ok=1 bt_ok=1\n" * 3 + "s=12\n"
    ev = events(r.stderr)
    assert ev == [x for i in range(3) for x in (f"E caller {i}", f"E probed {i}", f"R probed {i} = {i + 1}",
                                                 f"R caller {i} = {2 * (i + 1)}")], ev
    assert profile(r.stderr) == {"r_probed_0": (3, 0), "r_caller_0": (3, 0)}


# --- 2. C++ exceptions and longjmp through return-probed frames ---------------

EXCEPTIONS = r"""
#include <cstdio>
#include <stdexcept>
extern "C" __attribute__((noinline)) long thrower(long x)
{
	if (x % 3 == 0)
		throw std::runtime_error("boom");
	return x * 10;
}
extern "C" __attribute__((noinline)) long middle(long x)
{
	long r = thrower(x);
	__asm__ volatile("" : "+r"(r));
	return r + 1;
}
int main()
{
	long sum = 0, caught = 0;
	for (long i = 0; i < 3000; i++) {
		try {
			sum += middle(i);
		} catch (const std::exception &e) {
			caught++;
		}
	}
	std::printf("sum=%ld caught=%ld\n", sum, caught);
	return 0;
}
"""

COUNTING = r"""
#include <kprewrite/kprobes.h>
int count_return(struct kretprobe_instance *ri, struct pt_regs *regs) { return 0; }
"""


def _exceptions(tmp):
    prog = cc(tmp, "prog", EXCEPTIONS, "-O2", lang="c++")
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\n'
                      '[[kretprobe]]\nsymbol_name = "thrower"\nhandler = "count_return"\nmaxactive = 2\n'
                      '[[kretprobe]]\nsymbol_name = "middle"\nhandler = "count_return"\nmaxactive = 2\n', COUNTING)
    return check_lines(prog, spec), instrument(prog, spec)


def test_cxx_exception_through_return_probed_frames(once, runner):
    lines, out = once(_exceptions)
    assert all(hooked(l) for l in lines), lines
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    n_ok = sum(1 for i in range(3000) if i % 3)
    assert r.stdout == f"sum={sum(i * 10 + 1 for i in range(3000) if i % 3)} caught={3000 - n_ok}\n"
    # Every call found an instance although 1000 frames of each were unwound
    # with maxactive = 2: the abandoned instances were reclaimed.
    assert profile(r.stderr) == {"r_thrower_0": (3000, 0), "r_middle_0": (3000, 0)}


LONGJMP = r"""
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
static jmp_buf env;
__attribute__((noinline)) long leaf(long x)
{
	if (x < 0)
		longjmp(env, 1);
	return x + 1;
}
__attribute__((noinline)) long probed(long x)
{
	long r = leaf(x);
	__asm__ volatile("" : "+r"(r));
	return r * 2;
}
__attribute__((noinline)) void report(long n) { static volatile long sink; sink = n; sink += 1; }
int main(int argc, char **argv)
{
	long jumps = 0, s = 0;
	for (long i = 0; i < 5000; i++)
		if (!setjmp(env))
			probed(-1);
		else
			jumps++;
	for (long i = 0; i < 5000; i++)
		s += probed(i);
	report(0);
	printf("jumps=%ld s=%ld\n", jumps, s);
	return 0;
}
"""

COUNT_REPORT = r"""
#include <kprewrite/kprobes.h>
static long returns, bad;
int count_return(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	returns++;
	if ((long)regs_return_value(regs) != 2 * (*(long *)ri->data + 1))
		bad++;
	return 0;
}
int keep_arg(struct kretprobe_instance *ri, struct pt_regs *regs) { *(long *)ri->data = regs_get_kernel_argument(regs, 0); return 0; }
int report(struct kprobe *p, struct pt_regs *regs) { pr_info("returns=%ld bad=%ld\n", returns, bad); return 0; }
"""


def _longjmp(tmp):
    prog = cc(tmp, "prog", LONGJMP, "-O2")
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\n'
                      '[[kretprobe]]\nsymbol_name = "probed"\nhandler = "count_return"\nentry_handler = "keep_arg"\n'
                      'data_size = 8\nmaxactive = 1\n'
                      '[[kprobe]]\nsymbol_name = "report"\npre_handler = "report"\n', COUNT_REPORT)
    return check_lines(prog, spec), instrument(prog, spec)


def test_longjmp_out_of_return_probed_function_leaks_nothing(once, runner):
    lines, out = once(_longjmp)
    assert any(hooked(l, "probed") for l in lines)
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"jumps=5000 s={sum(2 * (i + 1) for i in range(5000))}\n"
    assert "returns=5000 bad=0" in r.stderr
    assert profile(r.stderr)["r_probed_0"] == (10000, 0)


# --- 3. Recursion deeper than maxactive ---------------------------------------

RECURSION = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) long rec(long n)
{
	if (n == 0)
		return 0;
	long r = rec(n - 1);
	__asm__ volatile("" : "+r"(r));
	return r + n;
}
int main(int argc, char **argv)
{
	long depth = atol(argv[1]), s = 0;
	for (int i = 0; i < 2; i++)
		s += rec(depth);
	printf("s=%ld\n", s);
	return 0;
}
"""


def _recursion(tmp):
    prog = cc(tmp, "prog", RECURSION, "-O2")
    spec = write_spec(tmp, probe_spec("kretprobe", ["rec"], **KRET, maxactive=10), HANDLERS)
    return check_lines(prog, spec), instrument(prog, spec)


def test_recursion_deeper_than_maxactive(once, runner):
    lines, out = once(_recursion)
    assert hooked(lines[0], "rec")
    depth = 29                      # 30 nested calls: 10 get an instance, 20 miss
    r = run(out, depth, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"s={2 * depth * (depth + 1) // 2}\n"
    one = [f"E rec {depth - d}" for d in range(10)]
    one += [f"R rec {depth - d} = {sum(range(depth - d + 1))}" for d in reversed(range(10))]
    assert events(r.stderr) == one * 2
    assert profile(r.stderr) == {"r_rec_0": (60, 40)}


# --- 4. Tail calls and several ret sites ----------------------------------------

TAILS = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) long leaf_probed(long x) { __asm__ volatile("" : "+r"(x)); return x * 3; }
__attribute__((noinline)) long leaf_plain(long x) { __asm__ volatile("" : "+r"(x)); return x * 5; }
/* Several ret sites. */
__attribute__((noinline)) long multi(long x)
{
	if (x & 1)
		return x + 100;
	__asm__ volatile("");
	if (x & 2)
		return leaf_plain(x) + 3;
	return -x;
}
/* Tail calls: to a return-probed function, to a plain one, to libc. */
__attribute__((noinline)) long tail_probed(long x) { return leaf_probed(x + 1); }
__attribute__((noinline)) long tail_plain(long x) { return leaf_plain(x + 2); }
static const char *numbers[] = { "50", "49", "48", "47" };
__attribute__((noinline)) long tail_libc(long x) { return strtol(numbers[x], 0, 10); }
__attribute__((noinline)) long tail_either(long x) { if (x & 1) return leaf_probed(x); return leaf_plain(x); }
int main(int argc, char **argv)
{
	long s = 0;
	for (long i = 0; i < 4; i++)
		s += multi(i) + tail_probed(i) + tail_plain(i) + tail_libc(i) + tail_either(i);
	printf("s=%ld\n", s);
	return 0;
}
"""


TAIL_FUNCS = ["multi", "tail_probed", "tail_plain", "tail_libc", "tail_either", "leaf_probed"]


def _tails(tmp):
    prog = cc(tmp, "prog", TAILS, "-O2")
    dis = subprocess.run(["objdump", "-d", str(prog)], capture_output=True, text=True).stdout
    spec = write_spec(tmp, probe_spec("kretprobe", TAIL_FUNCS, **KRET), HANDLERS)
    return dis, check_lines(prog, spec), instrument(prog, spec)


@x86_only
def test_tail_calls_and_several_ret_sites(once, runner):
    dis, lines, out = once(_tails)
    for f, target in (("tail_probed", "leaf_probed"), ("tail_plain", "leaf_plain"), ("tail_libc", "strtol")):
        body = dis.split(f"<{f}>:")[1].split("\n\n")[0]
        assert re.search(rf"jmp\s+\S+ <{target}", body), body     # the compiler made real tail calls
    assert all(hooked(l) for l in lines), lines
    assert "(pending)" in lines[1] and "(trampoline)" in lines[2] and "(pending or trampoline)" in lines[3], lines
    assert len(re.findall(r"0x[0-9a-f]+ ret", lines[0])) >= 2, lines[0]
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    exp = []
    s = 0
    for i in range(4):
        m = i + 100 if i & 1 else (i * 5 + 3 if i & 2 else -i)
        exp += [f"E multi {i}", f"R multi {i} = {m}"]
        exp += [f"E tail_probed {i}", f"E leaf_probed {i + 1}", f"R leaf_probed {i + 1} = {3 * (i + 1)}",
                f"R tail_probed {i} = {3 * (i + 1)}"]
        exp += [f"E tail_plain {i}", f"R tail_plain {i} = {5 * (i + 2)}"]
        exp += [f"E tail_libc {i}", f"R tail_libc {i} = {abs(i - 50)}"]
        if i & 1:
            exp += [f"E tail_either {i}", f"E leaf_probed {i}", f"R leaf_probed {i} = {3 * i}", f"R tail_either {i} = {3 * i}"]
        else:
            exp += [f"E tail_either {i}", f"R tail_either {i} = {5 * i}"]
        s += m + 3 * (i + 1) + 5 * (i + 2) + abs(i - 50) + (3 * i if i & 1 else 5 * i)
    assert r.stdout == f"s={s}\n"
    assert events(r.stderr) == exp


# --- 5. Threads ------------------------------------------------------------------

THREADS = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) long probed(long x)
{
	__asm__ volatile("" : "+r"(x));
	return 2 * (x + 1);
}
__attribute__((noinline)) void report(long n) { static volatile long sink; sink = n; sink += 1; }
static void *worker(void *arg)
{
	long id = (long)arg, s = 0;
	for (long i = 0; i < 20000; i++)
		s += probed(id * 1000000 + i);
	return (void *)s;
}
int main(void)
{
	pthread_t t[8];
	for (long i = 0; i < 8; i++)
		pthread_create(&t[i], 0, worker, (void *)i);
	long s = 0;
	for (int i = 0; i < 8; i++) {
		void *r;
		pthread_join(t[i], &r);
		s += (long)r;
	}
	report(0);
	printf("s=%ld\n", s);
	return 0;
}
"""

ATOMIC_REPORT = r"""
#include <kprewrite/kprobes.h>
static long returns, bad;
int count_return(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	__atomic_fetch_add(&returns, 1, __ATOMIC_RELAXED);
	if ((long)regs_return_value(regs) != 2 * (*(long *)ri->data + 1))
		__atomic_fetch_add(&bad, 1, __ATOMIC_RELAXED);
	return 0;
}
int keep_arg(struct kretprobe_instance *ri, struct pt_regs *regs) { *(long *)ri->data = regs_get_kernel_argument(regs, 0); return 0; }
int report(struct kprobe *p, struct pt_regs *regs) { pr_info("returns=%ld bad=%ld\n", returns, bad); return 0; }
"""


def _threads(tmp):
    prog = cc(tmp, "prog", THREADS, "-O2", "-pthread")
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\n'
                      '[[kretprobe]]\nsymbol_name = "probed"\nhandler = "count_return"\nentry_handler = "keep_arg"\n'
                      'data_size = 8\nmaxactive = 16\n'
                      '[[kprobe]]\nsymbol_name = "report"\npre_handler = "report"\n', ATOMIC_REPORT)
    return check_lines(prog, spec), instrument(prog, spec)


def test_threads_keep_their_instances(once, runner):
    lines, out = once(_threads)
    assert any(hooked(l, "probed") for l in lines)
    check_threads_run(out, runner)


def check_threads_run(out, runner):
    """THREADS rewritten with a kretprobe on probed() and a report() kprobe:
    every call of every thread had its return handler, none saw bad data."""
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    n = 8 * 20000
    assert r.stdout == f"s={sum(2 * (t * 1000000 + i + 1) for t in range(8) for i in range(20000))}\n"
    assert f"returns={n} bad=0" in r.stderr
    assert profile(r.stderr)["r_probed_0"] == (n, 0)


# --- 6. A kprobe and a kretprobe on the same function ---------------------------

def _kprobe_and_kretprobe(tmp):
    prog = cc(tmp, "prog", RECURSION, "-O2")
    handlers = HANDLERS + r"""
int on_pre(struct kprobe *p, struct pt_regs *regs) { pr_info("P %ld\n", (long)regs_get_kernel_argument(regs, 0)); return 0; }
"""
    spec = write_spec(tmp, probe_spec("kretprobe", ["rec"], **KRET,
                                      extra='[[kprobe]]\nsymbol_name = "rec"\npre_handler = "on_pre"\n'), handlers)
    lines = check_lines(prog, spec)
    out = instrument(prog, spec)
    return lines, out, kprewrite("list", out).stdout.splitlines()


def test_kprobe_and_kretprobe_on_the_same_function(once, runner):
    lines, out, listing = once(_kprobe_and_kretprobe)
    assert lines[0] == "rec+0x0  k  optimized", lines
    assert hooked(lines[1], "rec"), lines
    assert [l.split(None, 1)[1] for l in listing] == ["k  rec+0x0 [OPTIMIZED]", "r  rec+0x0 [OPTIMIZED]"]
    # One detour at the entry serves both (aggregation): one site, one jump.
    assert listing[0].split()[0] == listing[1].split()[0]
    r = run(out, 2, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    got = [l for l in r.stderr.splitlines() if l[:2] in ("P ", "E ", "R ")]
    one = ["P 2", "E rec 2", "P 1", "E rec 1", "P 0", "E rec 0", "R rec 0 = 0", "R rec 1 = 1", "R rec 2 = 3"]
    assert got == one * 2
    assert profile(r.stderr) == {"p_rec_0": (6, 0), "r_rec_0": (6, 0)}


# --- a kretprobe whose entry is a breakpoint: check, JSON and list say so ----------

INT3_FLAGS = {"boost": "BOOSTED", "emulate": "EMULATED", "single-step": "SINGLESTEP"}


def _int3_entry(tmp):
    prog = cc(tmp, "prog", RECURSION, "-O2")
    spec = write_spec(tmp, "optimize = false\n" + probe_spec("kretprobe", ["rec"], **KRET), HANDLERS)
    doc = json.loads(kprewrite("check", prog, "--spec", spec, "--format", "json").stdout)
    out = instrument(prog, spec)
    return check_lines(prog, spec), doc, out, kprewrite("list", out).stdout.splitlines()


def test_breakpoint_entry_is_reported_as_int3(once, runner):
    """A kretprobe's entry is a kprobe: where it is a breakpoint (here: optimize =
    false) check, its JSON and list give the breakpoint and why, not `optimized`."""
    lines, doc, out, listing = once(_int3_entry)
    rec = doc["probes"][0]
    assert rec["kind"] == "r" and rec["decision"] == "int3", rec
    assert rec["reason"]["check"] == "kprobes_optimization" and rec["int3"] in INT3_FLAGS, rec
    assert lines[0].startswith(f"rec+0x0  r  int3  {rec['reason']['message']}  [{rec['int3']}]  returns: "), lines
    assert [l.split(None, 1)[1] for l in listing] == [f"r  rec+0x0 [{INT3_FLAGS[rec['int3']]}]"], listing
    r = run(out, 3, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == "s=12\n", r.stderr
    one = [f"E rec {d}" for d in (3, 2, 1, 0)] + [f"R rec {d} = {sum(range(d + 1))}" for d in (0, 1, 2, 3)]
    assert events(r.stderr) == one * 2
    assert profile(r.stderr) == {"r_rec_0": (8, 0)}


# --- semantics: entry_handler != 0, disable_kretprobe, maxactive default ---------

SEMANTICS_HANDLERS = r"""
#include <kprewrite/kprobes.h>
static int returns;
int odd_only(struct kretprobe_instance *ri, struct pt_regs *regs) { return !(regs_get_kernel_argument(regs, 0) & 1); }
int ret_then_disable(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	pr_info("R %ld\n", (long)regs_return_value(regs));
	if (++returns == 2)
		disable_kretprobe(get_kretprobe(ri));
	return 0;
}
"""


def _semantics(tmp):
    prog = cc(tmp, "prog", RECURSION, "-O2")
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\n[[kretprobe]]\nsymbol_name = "rec"\n'
                      'handler = "ret_then_disable"\nentry_handler = "odd_only"\n', SEMANTICS_HANDLERS)
    return instrument(prog, spec)


def test_entry_handler_nonzero_and_disable_from_handler(once, runner):
    out = once(_semantics)
    r = run(out, 5, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    # rec(5..0): entry handler accepts 5, 3, 1; returns come back 1 (=1), 3 (=6),
    # then the probe is disabled: 5's instance still fires (it was taken), the
    # second round claims nothing.
    assert [l for l in r.stderr.splitlines() if l.startswith("R ")] == ["R 1", "R 6", "R 15"]
    assert profile(r.stderr) == {"r_rec_0": (6, 0)}


# --- refusals -----------------------------------------------------------------------

@x86_only
def test_refused_not_entry_and_blacklist(tmp_path):
    prog = cc(tmp_path, "prog", RECURSION, "-O2")
    spec = write_spec(tmp_path, 'handlers = ["handlers.c"]\n'
                      '[[kretprobe]]\nsymbol_name = "rec"\noffset = 8\nhandler = "on_return"\n'
                      '[[kretprobe]]\nsymbol_name = "_start"\nhandler = "on_return"\n', HANDLERS)
    r = kprewrite("instrument", prog, "--spec", spec, "-o", tmp_path / "out", check=False)
    assert r.returncode == 1
    assert not (tmp_path / "out").exists()
    lines = r.stderr.splitlines()
    assert len(lines) == 2, lines
    # the check and its address first, as `check` names them
    assert re.search(r"\[\[kretprobe\]\] #1 \(rec\+0x8\): func_entry at 0x[0-9a-f]+: a kretprobe must be on a "
                     r"function entry", lines[0]), lines[0]
    assert re.search(r"\[\[kretprobe\]\] #2 \(_start\+0x0\): kretprobe_blacklist at 0x[0-9a-f]+: _start is on the "
                     r"kretprobe blacklist", lines[1]), lines[1]
    assert "Traceback" not in r.stderr
    bad = write_spec(tmp_path, 'handlers = ["handlers.c"]\n[[kretprobe]]\nsymbol_name = "rec"\nhandler = "nope"\n'
                     '[[kretprobe]]\nsymbol_name = "nosuch"\n', HANDLERS, name="bad.toml")
    r = kprewrite("instrument", prog, "--spec", bad, "-o", tmp_path / "out", check=False)
    assert r.returncode == 1 and not (tmp_path / "out").exists()
    assert r.stderr.splitlines() == ["kprewrite: bad.toml: [[kretprobe]] #2: symbol 'nosuch' not found in prog",
                                     "kprewrite: bad.toml: [[kretprobe]] #1: handler 'nope' is not defined in any "
                                     "handler file (handlers.c)"], r.stderr
    c = kprewrite("check", prog, "--spec", spec, check=False)
    assert c.returncode == 1
    assert "rec+0x8  r  refused  func_entry at " in c.stdout and ": a kretprobe must be on a function entry" in c.stdout


# --- the trampoline fallback --------------------------------------------------------

FALLBACK = r"""
__asm__(
".text\n"
".globl helper\n.type helper,@function\nhelper:\n"
"  lea 7(%rdi),%rax\n"
"  ret\n"
".size helper,.-helper\n"
/* The ret follows a call by 4 bytes and the next function starts right after:
 * no 5-byte region ends with it.  The return address it sees in its slot is
 * recorded in seen_ra: its CFI says where that slot is, so the trampoline is
 * refused for it (it would see the trampoline), and its return hook is a breakpoint. */
".globl cramped\n.type cramped,@function\ncramped:\n"
"  .cfi_startproc\n"
"  push %rbx\n"
"  .cfi_def_cfa_offset 16\n"
"  mov %rdi,%rbx\n"
"  mov 8(%rsp),%rcx\n"
"  mov %rcx,seen_ra(%rip)\n"
"  call helper\n"
"  add %ebx,%eax\n"
"  pop %rbx\n"
"  .cfi_def_cfa_offset 8\n"
"  ret\n"
"  .cfi_endproc\n"
".size cramped,.-cramped\n"
".globl after\n.type after,@function\nafter:\n"
"  mov %rdi,%rax\n"
"  ret\n"
".size after,.-after\n"
);
#include <stdio.h>
long cramped(long), after(long);
void *seen_ra;
int main(void)
{
	long s = 0;
	int ra_ok = 1;
	for (long i = 0; i < 3; i++) {
		s += cramped(i) + after(i);
		ra_ok &= (char *)seen_ra > (char *)main && (char *)seen_ra < (char *)main + 400;
	}
	printf("s=%ld ra_ok=%d\n", s, ra_ok);
	return 0;
}
"""


def _fallback(tmp):
    prog = cc(tmp, "prog", FALLBACK, "-O2")
    spec = write_spec(tmp, probe_spec("kretprobe", ["cramped"], **KRET), HANDLERS)
    lines = check_lines(prog, spec)
    out = instrument(prog, spec)
    plus = write_spec(tmp, 'handlers = ["handlers.c"]\n[[kretprobe]]\nsymbol_name = "cramped"\nhandler = "plus_100"\n',
                      "#include <kprewrite/kprobes.h>\n"
                      "int plus_100(struct kretprobe_instance *ri, struct pt_regs *regs) { regs->ax += 100; return 0; }\n",
                      name="plus.toml")
    return lines, out, instrument(prog, plus, tmp / "prog.plus.kp")


@x86_only
def test_int3_return_hook_fallback_is_reported_and_works(once, runner):
    """An exit no jump can hook, in a function that reads its return-address
    slot, gets a breakpoint return hook (the trampoline would be read): the return
    address is not replaced, and the handler sees what a jump hook's
    does (regs->ip the return address, the return value)."""
    lines, out, out_plus = once(_fallback)
    assert re.fullmatch(r"cramped\+0x0  r  optimized  returns: 0x[0-9a-f]+ ret \(int3\)  \S+ at 0x[0-9a-f]+: .*; "
                        r"no trampoline: trampoline_unsafe at 0x[0-9a-f]+: mov rcx, qword ptr \[rsp \+ 8\] at "
                        r"0x[0-9a-f]+ addresses the return-address slot: it would see the trampoline", lines[0]), lines
    kret = [p for p in meta(out)["probes"] if p["kind"] == "r"][0]
    assert len(kret["int3_exits"]) == 1 and kret["return_sites"] == [], kret
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"s={sum(2 * i + 7 + i for i in range(3))} ra_ok=1\n"
    assert events(r.stderr) == [x for i in range(3) for x in (f"E cramped {i}", f"R cramped {i} = {2 * i + 7}")]
    assert profile(r.stderr) == {"r_cramped_0": (3, 0)}
    # A handler's write to regs->ax is the value the caller gets, as with a jump hook.
    r = run(out_plus, runner=runner)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"s={sum(2 * i + 7 + 100 + i for i in range(3))} ra_ok=1\n"


# --- every function of a program ----------------------------------------------------

def _glob(tmp):
    prog = cc(tmp, "prog", TAILS, "-O2")
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\n[[kretprobe]]\nsymbol_name = "*"\n', HANDLERS)
    return prog, instrument(prog, spec)


def test_glob_every_function(once, runner):
    prog, out = once(_glob)
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == run(prog, runner=runner).stdout
    prof = profile(r.stderr)
    assert prof["r_multi_0"] == (4, 0) and prof["r_main_0"] == (1, 0), prof


# --- shared objects, and a handler that changes the return value -------------------

LIB = r"""
__attribute__((noinline)) long lib_work(long x) { __asm__ volatile("" : "+r"(x)); return x + 100; }
long lib_api(long x) { return lib_work(x) * 2; }
"""
LIB_MAIN = r"""
#include <stdio.h>
long lib_api(long);
int main(void) { long s = 0; for (int i = 0; i < 7; i++) s += lib_api(i); printf("s=%ld\n", s); return 0; }
"""


def _shared_object(tmp):
    lib = cc(tmp, "libw.so", LIB, "-O2", "-shared", "-fPIC")
    prog = cc(tmp, "main", LIB_MAIN, "-O2", f"-L{tmp}", "-lw")
    spec = write_spec(tmp, probe_spec("kretprobe", ["lib_work", "lib_api"], **KRET), HANDLERS)
    outdir = tmp / "out"
    outdir.mkdir()
    instrument(lib, spec, outdir / "libw.so")
    return prog, outdir


def test_shared_object(once, runner):
    prog, outdir = once(_shared_object)
    r = run(prog, runner=runner, libdir=outdir, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"s={sum((i + 100) * 2 for i in range(7))}\n"
    assert events(r.stderr) == [x for i in range(7) for x in (
        f"E lib_api {i}", f"E lib_work {i}", f"R lib_work {i} = {i + 100}", f"R lib_api {i} = {2 * (i + 100)}")]


# --- tail calls through a pointer and through the PLT --------------------------------
# A tail call through a pointer (a table of functions, -fno-plt's GOT load) or to a PLT
# stub (through its GOT slot) leaves the caller's instance pending when the target is a
# return-hooked entry of the same object (kp_kret_hooked[]): it fires at the target's
# ret.  Any other target (a function without kretprobe, libc's) gets the trampoline.

PTR_LIB = r"""
#include <stdlib.h>
__attribute__((noinline)) long leaf_a(long x) { __asm__ volatile("" : "+r"(x)); return x * 3; }
__attribute__((noinline)) long leaf_b(long x) { __asm__ volatile("" : "+r"(x)); return x * 5; }
__attribute__((noinline)) static long leaf_c(long x) { __asm__ volatile("" : "+r"(x)); return x * 7; }
long (*const table[4])(long) = { leaf_a, leaf_b, leaf_c, labs };
long ptr_tail(long i, long x) { return table[i & 3](x); }
long plt_tail(long x) { return leaf_a(x + 1); }
long plt_plain(long x) { return leaf_b(x + 2); }
static const char *numbers[] = { "50", "49", "48", "47" };
long libc_tail(long x) { return strtol(numbers[x & 3], 0, 10); }
"""
PTR_MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
long ptr_tail(long, long), plt_tail(long), plt_plain(long), libc_tail(long);
int main(int argc, char **argv)
{
	long s = 0, n = atol(argv[1]);
	for (long i = 0; i < n; i++) {
		s += ptr_tail(i, i);
		s += plt_tail(i);
		s += plt_plain(i);
		s += libc_tail(i);
	}
	printf("s=%ld\n", s);
	return 0;
}
"""
PTR_FUNCS = ["ptr_tail", "plt_tail", "plt_plain", "libc_tail", "leaf_a", "leaf_c"]


def _pointer_tails(tmp, plt):
    lib = cc(tmp, "libpt.so", PTR_LIB, "-O2", "-shared", "-fPIC", *([] if plt else ["-fno-plt"]))
    prog = cc(tmp, "main", PTR_MAIN, "-O2", f"-L{tmp}", "-lpt")
    dis = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True).stdout
    spec = write_spec(tmp, probe_spec("kretprobe", PTR_FUNCS, **KRET), HANDLERS)
    # Every function of the object, no handler, one instance each: an instance left
    # claimed by a pending tail call makes the next call miss.
    bare = write_spec(tmp, '[[kretprobe]]\nsymbol_name = "*"\nmaxactive = 1\n', name="bare.toml")
    out, out_bare = tmp / "out", tmp / "bare"
    out.mkdir()
    out_bare.mkdir()
    instrument(lib, spec, out / "libpt.so")
    instrument(lib, bare, out_bare / "libpt.so")
    return dis, check_lines(lib, spec), prog, out, out_bare


def _ptr_expected(n):
    ev, s = [], 0
    for i in range(n):
        target = i & 3
        r = (3 * i, 5 * i, 7 * i, abs(i))[target]
        ev.append(f"E ptr_tail {i}")
        if target in (0, 2):
            name = ("leaf_a", None, "leaf_c")[target]
            ev += [f"E {name} {i}", f"R {name} {i} = {r}"]
        ev.append(f"R ptr_tail {i} = {r}")
        ev += [f"E plt_tail {i}", f"E leaf_a {i + 1}", f"R leaf_a {i + 1} = {3 * (i + 1)}",
               f"R plt_tail {i} = {3 * (i + 1)}"]
        ev += [f"E plt_plain {i}", f"R plt_plain {i} = {5 * (i + 2)}"]
        ev += [f"E libc_tail {i}", f"R libc_tail {i} = {50 - (i & 3)}"]
        s += r + 3 * (i + 1) + 5 * (i + 2) + 50 - (i & 3)
    return ev, s


@x86_only
@pytest.mark.parametrize("plt", [True, False], ids=["plt", "no-plt"])
def test_tail_calls_through_a_pointer_and_the_plt(once, runner, plt):
    dis, lines, prog, out, out_bare = once(_pointer_tails, plt)
    body = lambda f: dis.split(f"<{f}>:")[1].split("\n\n")[0]     # noqa: E731
    # The compiler made the tail calls this test is about.
    assert re.search(r"jmp\s+\*", body("ptr_tail")), body("ptr_tail")
    for f, target in (("plt_tail", "leaf_a"), ("plt_plain", "leaf_b"), ("libc_tail", "strtol")):
        assert re.search(rf"jmp\s+\S+ <{target}@plt>" if plt else r"jmp\s+\*0x[0-9a-f]+\(%rip\)", body(f)), body(f)
    for f in ["ptr_tail", "plt_tail", "plt_plain", "libc_tail"]:
        line = next(l for l in lines if l.startswith(f"{f}+0x0  r  "))
        assert hooked(line) and "(pending or trampoline)" in line, line
    n = 8
    ev, s = _ptr_expected(n)
    r = run(prog, n, runner=runner, libdir=out, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"s={s}\n"
    assert events(r.stderr) == ev
    assert "BAD-IP" not in r.stderr
    prof = profile(r.stderr)
    assert prof["r_ptr_tail_0"] == (n, 0) and prof["r_leaf_a_0"] == (n + n // 4, 0), prof
    n = 2000
    r = run(prog, n, runner=runner, libdir=out_bare, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"s={_ptr_expected(n)[1]}\n"
    prof = profile(r.stderr)
    want = {"r_ptr_tail_0": n, "r_plt_tail_0": n, "r_plt_plain_0": n, "r_libc_tail_0": n,
            "r_leaf_a_0": n + n // 4, "r_leaf_b_0": n + n // 4, "r_leaf_c_0": n // 4}
    assert {k: prof[k] for k in want} == {k: (v, 0) for k, v in want.items()}, prof


OVERRIDE = r"""
#include <kprewrite/kprobes.h>
int plus_thousand(struct kretprobe_instance *ri, struct pt_regs *regs) { regs->ax += 1000; return 0; }
"""


def _override(tmp):
    prog = cc(tmp, "prog", RECURSION, "-O2")
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\n[[kretprobe]]\nsymbol_name = "rec"\nhandler = "plus_thousand"\n',
                      OVERRIDE)
    return instrument(prog, spec)


@x86_only
def test_return_handler_changes_the_return_value(once, runner):
    # As with the kernel's trampoline, registers are restored from pt_regs.
    out = once(_override)
    r = run(out, 2, runner=runner)
    assert r.returncode == 0, r.stderr
    # rec(0) = 1000, rec(1) = 1000 + 1 + 1000, rec(2) = 2001 + 2 + 1000; twice.
    assert r.stdout == f"s={2 * 3003}\n"


STALE_TAIL = r"""
#include <setjmp.h>
#include <stdio.h>
static jmp_buf env;
__attribute__((noinline)) long target(long x)
{
	if (x < 0)
		longjmp(env, 1);
	__asm__ volatile("" : "+r"(x));
	return x * 3;
}
__attribute__((noinline)) long front(long x) { return target(x + 1); }
__attribute__((noinline)) long other(long x) { __asm__ volatile("" : "+r"(x)); return x + 7; }
int main(void)
{
	long s = 0;
	for (long i = 0; i < 3; i++) {
		if (!setjmp(env))
			front(-5);
		s += other(i) + front(i);
	}
	printf("s=%ld\n", s);
	return 0;
}
"""


def _stale_tail(tmp):
    prog = cc(tmp, "prog", STALE_TAIL, "-O2")
    spec = write_spec(tmp, probe_spec("kretprobe", ["front", "target", "other"], **KRET, maxactive=1), HANDLERS)
    return check_lines(prog, spec), instrument(prog, spec)


def test_tail_call_abandoned_by_longjmp_fires_nothing_later(once, runner):
    # front() tail-calls target(), which longjmps out: front's pending instance is
    # stale, and other(), called next on the same slot, must not fire it.
    lines, out = once(_stale_tail)
    assert "(pending)" in lines[0], lines
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    exp = []
    for i in range(3):
        exp += ["E front -5", "E target -4", f"E other {i}", f"R other {i} = {i + 7}",
                f"E front {i}", f"E target {i + 1}", f"R target {i + 1} = {3 * (i + 1)}", f"R front {i} = {3 * (i + 1)}"]
    assert events(r.stderr) == exp
    assert all(m == 0 for _, m in profile(r.stderr).values())


# --- the sample ------------------------------------------------------------------------

def _sample(tmp):
    sample = ROOT / "samples" / "kretprobe_example"
    prog = tmp / "program"
    subprocess.run([CC, "-O2", "-pthread", str(sample / "program.c"), "-o", str(prog)], check=True)
    return check_lines(prog, sample / "probes.toml"), instrument(prog, sample / "probes.toml")


def test_kretprobe_example_sample(once, runner):
    lines, out = once(_sample)
    assert hooked(lines[0], "kernel_clone")
    r = run(out, 3, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == "3 clones, pids sum = 3006\n"
    lines = [l for l in r.stderr.splitlines() if l.startswith("kernel_clone returned")]
    assert len(lines) == 3 and all(re.fullmatch(r"kernel_clone returned 100[1-3] and took \d+ ns to execute", l) for l in lines)
    assert profile(r.stderr) == {"r_kernel_clone_0": (3, 0)}
    # 30 concurrent calls, maxactive = 20: every call either returned through the
    # handler or was counted in nmissed.
    r = run(out, 30, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    returned = sum(1 for l in r.stderr.splitlines() if l.startswith("kernel_clone returned"))
    hits, missed = profile(r.stderr)["r_kernel_clone_0"]
    assert hits == 30 and returned + missed == 30 and returned >= 20


TWO_PROG = r"""
#include <stdio.h>
#include <setjmp.h>
static jmp_buf jb;
__attribute__((noinline)) long twice(long x) { if (x < 0) longjmp(jb, 1); return 2 * x; }
int main(void) {
    long s = 0;
    for (long i = 0; i < 100; i++)
        s += twice(i);
    if (!setjmp(jb))
        twice(-1);              /* abandoned: both instances at that slot are stale */
    for (long i = 0; i < 100; i++)
        s += twice(i);
    printf("%ld\n", s);
    return 0;
}
"""

TWO_HANDLERS = r"""
#include <kprewrite/kprobes.h>
static long sum_a, sum_b;
/* Return handlers run newest instance first: b, then a. */
int ret_b(struct kretprobe_instance *ri, struct pt_regs *regs) { sum_b += regs_return_value(regs); return 0; }
int ret_a(struct kretprobe_instance *ri, struct pt_regs *regs)
{
    sum_a += regs_return_value(regs);
    if (sum_a == 2 * 9900)
        pr_info("a=%ld b=%ld\n", sum_a, sum_b);
    return 0;
}
"""


def _two(tmp):
    prog = cc(tmp, "prog", TWO_PROG, "-O2")
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\n'
                      '[[kretprobe]]\nsymbol_name = "twice"\nhandler = "ret_a"\nmaxactive = 1\nname = "a"\n'
                      '[[kretprobe]]\nsymbol_name = "twice"\nhandler = "ret_b"\nmaxactive = 1\nname = "b"\n',
                      TWO_HANDLERS)
    return instrument(prog, spec)


def test_two_kretprobes_on_one_function(once, runner):
    """Aggregated kretprobes: each gets its own instance and fires once per call
    (the entry of the second must not take the first's fresh instance for a stale one)."""
    out = once(_two)
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == f"{2 * 9900}\n", r.stderr
    assert "a=19800 b=19800" in r.stderr, r.stderr
    prof = profile(r.stderr)
    assert prof["a"] == (201, 0) and prof["b"] == (201, 0), prof


# --- a breakpoint kprobe on a hooked exit keeps the return hook ------------------

EXIT_PROBED = r"""
#include <stdio.h>
__attribute__((noinline)) int f(int x) { return x * 3 + 1; }
int main(int argc, char **argv)
{
	int s = 0;
	for (int i = 0; i < 5; i++)
		s += f(i + argc);
	printf("%d\n", s);
	return 0;
}
"""
EXIT_PROBED_HANDLERS = r"""
#include <kprewrite/kprobes.h>
int ret_h(struct kretprobe_instance *ri, struct pt_regs *regs) { pr_info("R %ld\n", (long)regs_return_value(regs)); return 0; }
int pre_h(struct kprobe *p, struct pt_regs *regs) { pr_info("P\n"); return 0; }
"""


def _exit_probed(tmp):
    prog = cc(tmp, "prog", EXIT_PROBED, "-O2")
    ret = next(off for off, i in insns(prog, "f") if i.mnemonic == "ret")
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\noptimize = false\n'
                      '[[kretprobe]]\nsymbol_name = "f"\nhandler = "ret_h"\n'
                      f'[[kprobe]]\nsymbol_name = "f"\noffset = {ret}\n'
                      'pre_handler = "pre_h"\n', EXIT_PROBED_HANDLERS)
    return instrument(prog, spec)


def test_breakpoint_kprobe_on_a_hooked_exit_keeps_the_return_hook(once, runner):
    """A breakpoint kprobe at a ret that a kretprobe hooks (aggregation at the exit:
    the breakpoint site carries the return hook, as it would without the kprobe):
    every return still reaches the return handler, after the kprobe's pre_handler."""
    out = once(_exit_probed)
    r = run(out, runner=runner)
    assert r.returncode == 0 and r.stdout == "50\n", r.stderr
    got = [l for l in r.stderr.splitlines() if l[:1] in "PR"]
    assert got == [x for v in (4, 7, 10, 13, 16) for x in ("P", f"R {v}")], got


# --- AArch64: a stripped cold part that reloads x30 and leaves ----------------------

aarch64_only = pytest.mark.skipif(ARCH != "aarch64", reason="arm64's hot/cold code (x86-64: test_kretprobe_floor.py)")

# lib_scan's unlikely path (the call of a cold function) is split by GCC -O2 into
# lib_scan.cold, which `strip` leaves unnamed: an FDE of its own whose CIE/FDE rules
# start mid-frame (CFA sp+32, x30 saved at CFA-24).  The part reloads x30 from the
# frame (ldp x29, x30, [sp], #32) and tail-calls lib_fix.  Taken for a tail call,
# the `b` to it would swap x30 for the trampoline, the part would reload the real
# return address over it, and lib_scan's return through lib_fix would be missed.
COLD = r"""
#include <stdio.h>
__attribute__((noinline, cold)) void lib_warn(const char *what, long v) { fprintf(stderr, "warn %s %ld\n", what, v); }
__attribute__((noinline)) long lib_fix(long v) { __asm__ volatile(""); return v * 2 + 1; }
long lib_scan(const long *a, long n)
{
    long s = 0;
    for (long i = 0; i < n; i++) {
        if (__builtin_expect(a[i] < 0, 0)) {
            lib_warn("negative", a[i]);
            return lib_fix(s + i);
        }
        s += a[i] * 3;
    }
    return s;
}
"""
COLD_MAIN = r"""
#include <stdio.h>
long lib_scan(const long *a, long n);
int main(void)
{
    long a[] = { 1, 2, 3, 4 }, b[] = { 5, 6, -7, 8 };
    printf("%ld %ld\n", lib_scan(a, 4), lib_scan(b, 4));
    return 0;
}
"""
COLD_HANDLERS = r"""
#include <kprewrite/kprobes.h>
int on_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	pr_info("R %s = %ld\n", ri->rp->kp.symbol_name, (long)regs_return_value(regs));
	return 0;
}
"""


def _stripped_cold(tmp):
    lib = cc(tmp, "libcs.so", COLD, "-O2", "-fPIC", "-shared", "-freorder-blocks-and-partition")
    syms = subprocess.run([CC.replace("gcc", "nm"), str(lib)], capture_output=True, text=True, check=True).stdout
    assert "lib_scan.cold" in syms, syms      # GCC split the unlikely path
    subprocess.run([CC.replace("gcc", "strip"), str(lib)], check=True)
    prog = cc(tmp, "main", COLD_MAIN, "-O2", f"-L{tmp}", "-lcs")
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\n[[kretprobe]]\nsymbol_name = "*"\nhandler = "on_ret"\n',
                      COLD_HANDLERS)
    outdir = tmp / "out"
    outdir.mkdir()
    return prog, lib, check_lines(lib, spec), instrument(lib, spec, outdir / "libcs.so")


@aarch64_only
def test_stripped_cold_part_reloading_x30_keeps_its_return(once, runner):
    prog, lib, check, out = once(_stripped_cold)
    cold = [l for l in check if re.match(r"sub_[0-9a-f]+\+0x0  r  refused  entry_frame at ", l)]
    assert len(cold) == 1 and "is sp+32, x30 saved at CFA-24" in cold[0], "\n".join(check)
    line = next(l for l in check if l.startswith("lib_scan+0x0  r  "))
    # Followed by its FDE: the part's tail `b` to lib_fix@plt is an exit of lib_scan, every exit hooked.
    start = int(cold[0].split("+")[0][4:], 16)
    tails = [int(a, 16) for a in re.findall(r"(0x[0-9a-f]+) tail->", line)]
    assert hooked(line) and any(start <= a < start + 0x40 for a in tails), line
    want = run(prog, runner=runner, libdir=lib.parent)
    assert want.returncode == 0 and want.stdout == "30 71\n" and "warn negative -7" in want.stderr, want
    r = run(prog, runner=runner, libdir=out.parent)
    assert r.returncode == 0 and r.stdout == want.stdout, r.stderr
    got = [l for l in r.stderr.splitlines() if l.startswith("R lib_")]
    assert got == ["R lib_scan = 30", "R lib_warn = 17", "R lib_fix = 71", "R lib_scan = 71"], r.stderr


UNKNOWN_EXITS_RA = r"""
#include <stdio.h>
/* The return address read at the entry, and an indirect jump whose target the
 * analysis cannot bound (popped): libgcc's _Unwind_RaiseException, whose
 * __builtin_eh_return exit is such a jump, unwinds from its own return address. */
__attribute__((noinline)) void *whence(long x) {
  void *ra = __builtin_return_address(0);
  if (x)
    __asm__ volatile("lea 1f(%%rip), %%rcx; push %%rcx; pop %%rcx; jmp *%%rcx; 1:" ::: "rcx", "memory");
  return ra;
}
__attribute__((noinline)) int caller(long x) {
  char *ra = whence(x);
  return ra > (char *)caller && ra < (char *)caller + 64;
}
int main(int argc, char **argv) { int ok = 0; for (int i = 0; i < 3; i++) ok += caller(argc + i); printf("ra_ok=%d\n", ok); return 0; }
"""


@x86_only
def test_unknown_exits_with_unsafe_trampoline_refused(tmp_path):
    """Exits that cannot all be named leave only the trampoline; a function that reads its
    own return address would see the trampoline there: its kretprobe is refused
    (trampoline_unsafe).  Switched off, the trampoline is taken and the program prints
    ra_ok=0; from a glob the function is skipped and the program runs right."""
    import os
    prog = cc(tmp_path, "whence", UNKNOWN_EXITS_RA, "-O2")
    assert run(prog).stdout == "ra_ok=3\n"
    spec = write_spec(tmp_path, '[[kretprobe]]\nsymbol_name = "whence"\nmaxactive = 20\n')
    r = kprewrite("check", prog, "--spec", spec, check=False)
    lines = r.stdout.splitlines()
    assert r.returncode == 1 and lines[0].startswith("whence+0x0  r  refused  trampoline_unsafe at ") and "pop rcx" in lines[0], lines
    assert kprewrite("instrument", prog, "--spec", spec, "-o", tmp_path / "on", check=False).returncode == 1
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KPREWRITE_UNSAFE_OFF": "trampoline_unsafe"}
    subprocess.run([*__import__("conftest").KPREWRITE, "instrument", prog, "--spec", spec, "-o", tmp_path / "off"],
                   check=True, env=env, capture_output=True)
    assert run(tmp_path / "off").stdout == "ra_ok=0\n"
    glob = write_spec(tmp_path, '[[kretprobe]]\nsymbol_name = "*"\nmaxactive = 20\n', name="glob.toml")
    new = instrument(prog, glob, tmp_path / "glob")
    assert run(new).stdout == "ra_ok=3\n"
