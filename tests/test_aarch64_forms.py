"""AArch64's cheap forms, chosen by what the handlers' code reads
(rewriter/arch/aarch64/handler_abi.py), as on x86-64 (tests/test_clean_call.py,
tests/test_light_hits.py): a light hit in an image without handlers (an exclusive
increment of a sharded counter, no pt_regs), the clean template for a handler that
never reads regs (the dispatch inlined, only the call-clobbered registers the
template and the handler write saved), the whole pt_regs for a handler that reads
them, and the clean return hook.  `live` holds a known value in every register
x1-x18, x30 (its return address) and the flags of a `cmp` across its probes, and
four threads run `quiet` at once: the program's output, each probe's hits and the
values a regs-reading handler sees are asserted exactly under qemu-aarch64."""
from __future__ import annotations

import pytest

from conftest import cc, instrument, meta, profile, run, write_spec

ARCHES = ["aarch64"]

PROG = r"""
#include <pthread.h>
#include <stdio.h>
/* live(x) = x + 158 + 100 * (x > 1): x1..x18 hold 1..18, x2 becomes 5 at +84
   (a probe, the flags of the cmp live across it), the cset at +88 reads them. */
__asm__(
".text\n.globl live\n.type live,%function\nlive:\n"
"  stp x29, x30, [sp, #-16]!\n  mov x29, sp\n"
"  mov x1, #1\n  mov x2, #2\n  mov x3, #3\n  mov x4, #4\n  mov x5, #5\n  mov x6, #6\n"
"  mov x7, #7\n  mov x8, #8\n  mov x9, #9\n  mov x10, #10\n  mov x11, #11\n  mov x12, #12\n"
"  mov x13, #13\n  mov x14, #14\n  mov x15, #15\n  mov x16, #16\n  mov x17, #17\n  mov x18, #18\n"
"  cmp x0, x1\n"
"  add x2, x2, x3\n"               /* +84 */
"  cset x16, gt\n"                 /* +88 */
"  add x0, x0, x1\n  add x0, x0, x2\n  add x0, x0, x3\n  add x0, x0, x4\n  add x0, x0, x5\n"
"  add x0, x0, x6\n  add x0, x0, x7\n  add x0, x0, x8\n  add x0, x0, x9\n  add x0, x0, x10\n"
"  add x0, x0, x11\n  add x0, x0, x12\n  add x0, x0, x13\n  add x0, x0, x14\n  add x0, x0, x15\n"
"  add x0, x0, x17\n  add x0, x0, x18\n  mov x1, #100\n  madd x0, x16, x1, x0\n"
"  ldp x29, x30, [sp], #16\n  ret\n"
".size live,.-live\n");
long live(long);
__attribute__((noinline)) long reads(long x) { __asm__ volatile("" : "+r"(x)); return x * 3; }
__attribute__((noinline)) long quiet(long x) { __asm__ volatile("" : "+r"(x)); return x + 2; }
__attribute__((noinline)) long ret_twice(long x) { __asm__ volatile("" : "+r"(x)); return x * 2; }
__attribute__((noinline)) long off(long x) { __asm__ volatile("" : "+r"(x)); return x ^ 1; }
static void *worker(void *arg)
{
    long s = 0;
    for (long i = 0; i < 2000; i++)
        s += quiet(i);
    *(long *)arg = s;
    return 0;
}
int main(void) {
    long l = 0, s = 0, t[4];
    pthread_t th[4];
    for (long i = 0; i < 12; i++)
        l = l * 3 + live(i % 3 == 0 ? 0 : i % 3 == 1 ? 5 : 1);
    for (int i = 0; i < 4; i++)
        pthread_create(&th[i], 0, worker, &t[i]);
    for (long i = 0; i < 1000; i++)
        s += reads(i) + ret_twice(i) + off(i);
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], 0);
        s += t[i];
    }
    printf("%ld %ld\n", l, s);
    return 0;
}
"""


def _expected() -> str:
    lv = 0
    for i in range(12):
        x = [0, 5, 1][i % 3]
        lv = lv * 3 + x + 158 + (100 if x > 1 else 0)
    s = sum(i * 3 + i * 2 + (i ^ 1) for i in range(1000)) + 4 * sum(i + 2 for i in range(2000))
    return f"{lv} {s}\n"


EXPECTED = _expected()

HANDLERS = r"""
#include <kprewrite/kprobes.h>
/* Never reads regs; calls C and wrecks every call-clobbered register and the flags. */
int clobber(struct kprobe *p, struct pt_regs *regs)
{
    pr_info("hit %s\n", p->symbol_name);
    __asm__ volatile("mov x0, #-1; mov x1, #-1; mov x2, #-1; mov x3, #-1; mov x4, #-1; mov x5, #-1;"
                     "mov x6, #-1; mov x7, #-1; mov x8, #-1; mov x9, #-1; mov x10, #-1; mov x11, #-1;"
                     "mov x12, #-1; mov x13, #-1; mov x14, #-1; mov x15, #-1; mov x16, #-1; mov x17, #-1;"
                     "mov x18, #-1; cmn x0, #1"
                     ::: "x0", "x1", "x2", "x3", "x4", "x5", "x6", "x7", "x8", "x9", "x10", "x11", "x12",
                         "x13", "x14", "x15", "x16", "x17", "x18", "cc");
    return 0;
}
/* A leaf: kprewrite reads that it writes x9, x10, x17 and the flags (and x0 for its result). */
static unsigned long n_leaf;
int leaf(struct kprobe *p, struct pt_regs *regs)
{
    __asm__ volatile("mov x9, #-1; mov x10, #-1; mov x17, #-1; cmn x9, #1" ::: "x9", "x10", "x17", "cc");
    n_leaf++;
    return 0;
}
/* Only loads from regs (no call while x1 holds them): a partial pt_regs, as at the hit. */
static long seen, bad;
int uses_regs(struct kprobe *p, struct pt_regs *regs)
{
    seen += regs->regs[0];
    bad |= regs->pc != (unsigned long)p->addr;
    return 0;
}
/* Not an atomic add: GCC's outline atomics call a helper, and a call may take regs. */
static long n_quiet;
int count_pre(struct kprobe *p, struct pt_regs *regs) { n_quiet++; return 0; }
/* A return handler that never reads regs, and one that reads the return value. */
static long n_ret, rv, n_rv;
int quiet_ret(struct kretprobe_instance *ri, struct pt_regs *regs) { n_ret++; return 0; }
int value_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
    rv += regs_return_value(regs);
    if (++n_rv == 1000)
        pr_info("rv %ld n_ret %ld seen %ld bad %ld\n", rv, n_ret, seen, bad);
    return 0;
}
"""

SPEC = """
handlers = ["handlers.c"]
[[kprobe]]
symbol_name = "live"
offset = 84
pre_handler = "clobber"
[[kprobe]]
symbol_name = "live"
offset = 88
pre_handler = "leaf"
[[kprobe]]
symbol_name = "reads"
pre_handler = "uses_regs"
[[kprobe]]
symbol_name = "quiet"
pre_handler = "count_pre"
[[kprobe]]
symbol_name = "off"
pre_handler = "clobber"
disabled = true
[[kretprobe]]
symbol_name = "live"
handler = "quiet_ret"
[[kretprobe]]
symbol_name = "ret_twice"
handler = "value_ret"
"""

LIGHT_SPEC = """
[[kprobe]]
symbol_name = "live"
offset = 84
[[kprobe]]
symbol_name = "live"
offset = 88
[[kprobe]]
symbol_name = "quiet"
[[kretprobe]]
symbol_name = "reads"
"""


def _build(tmp):
    prog = cc(tmp, "prog", PROG, "-O2", "-pthread")
    r = run(prog, runner="qemu")
    assert r.returncode == 0 and r.stdout == EXPECTED, r.stdout + r.stderr
    out = instrument(prog, write_spec(tmp, SPEC, HANDLERS))
    light = instrument(prog, write_spec(tmp, LIGHT_SPEC, name="light.toml"), tmp / "prog.light")
    return out, light


def _forms(out) -> dict:
    return {(p["symbol"], p["offset"]): (p.get("call"), p.get("inline_dispatch"), p.get("light", False))
            for p in meta(out)["probes"] if p["kind"] == "k"}


def test_forms_follow_handler_code(once):
    out, light = once(_build)
    assert _forms(out) == {("live", 84): ("clean", True, False), ("live", 88): ("clean", True, False),
                           ("reads", 0): ("pt_regs", True, False), ("quiet", 0): ("clean", True, False),
                           ("off", 0): ("clean", True, False)}
    # uses_regs only loads regs->regs[0] and regs->pc: a partial pt_regs of those two.
    assert [p.get("regs_fields") for p in meta(out)["probes"] if p["symbol"] == "reads"] == [[0, 256]]
    assert _forms(light) == {("live", 84): ("clean", True, True), ("live", 88): ("clean", True, True),
                             ("quiet", 0): ("clean", True, True)}


def test_clean_template_keeps_registers_and_flags(once):
    out, _ = once(_build)
    r = run(out, runner="qemu", env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == EXPECTED, r.stdout + r.stderr
    assert r.stderr.count("hit live\n") == 12 and "hit off" not in r.stderr and "BAD" not in r.stderr
    # The regs-reading handlers see the argument and the return value as they are.
    assert f"rv {sum(2 * i for i in range(1000))} n_ret 12 seen {sum(range(1000))} bad 0\n" in r.stderr
    prof = profile(r.stderr)
    assert prof["p_live_84"] == (12, 0) and prof["p_live_88"] == (12, 0)
    assert prof["p_quiet_0"] == (8000, 0) and prof["p_reads_0"] == (1000, 0)
    assert prof["p_off_0"] == (0, 0)           # disabled: silent, not counted


def test_light_hits_exact_across_threads(once):
    _, light = once(_build)
    r = run(light, runner="qemu", env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == EXPECTED, r.stdout + r.stderr
    prof = profile(r.stderr)
    assert prof["p_live_84"] == (12, 0) and prof["p_live_88"] == (12, 0)
    assert prof["p_quiet_0"] == (8000, 0)
    assert prof["r_reads_0"] == (1000, 0)


@pytest.mark.parametrize("which", ["handlers", "light"])
def test_disarmed(once, which):
    out, light = once(_build)
    r = run(out if which == "handlers" else light, runner="qemu",
            env={"KPREWRITE_ENABLED": "0", "KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == EXPECTED, r.stdout + r.stderr
    assert "hit" not in r.stderr and profile(r.stderr)["p_quiet_0"] == (0, 0)


# The pt_regs template (emit.full_detour): pre_handlers that write regs.  fl(x) is
# x + 1 if entered with "eq", else x; spw(x) calls spf with x1 = its sp, and spf returns
# how far below that sp its first instruction ran (spf puts sp back).
PT_PROG = r"""
#include <stdio.h>
__asm__(".text\n"
	".globl fl\n.type fl,%function\nfl:\n  cinc x0, x0, eq\n  ret\n.size fl,.-fl\n"
	".globl spw\n.type spw,%function\nspw:\n  mov x1, sp\n  b spf\n.size spw,.-spw\n"
	".globl spf\n.type spf,%function\nspf:\n  mov x9, sp\n  sub x0, x1, x9\n  mov sp, x1\n  ret\n"
	".size spf,.-spf\n");
long fl(long), spw(long);
__attribute__((noinline)) long off(long x) { __asm__ volatile("" : "+r"(x)); return x ^ 1; }
int main(void)
{
	long a = 0, b = 0, c = 0;
	for (long i = 0; i < 100; i++) {
		a += fl(i);
		b += spw(i);
		c += off(i);
	}
	printf("%ld %ld %ld\n", a, b, c);
	return 0;
}
"""

PT_HANDLERS = r"""
#include <kprewrite/kprobes.h>
/* x0 + 1000 and, for even x0, Z set: the probed cinc sees both. */
int wr(struct kprobe *p, struct pt_regs *regs)
{
	long x = regs->regs[0];
	regs->regs[0] = x + 1000;
	regs->pstate = (regs->pstate & ~0xf0000000UL) | (x % 2 ? 0 : 0x40000000UL);
	return 0;
}
/* For odd x0, sp 16 lower: the copied instruction runs on it (resume_regs). */
int sp_pre(struct kprobe *p, struct pt_regs *regs)
{
	if (regs->regs[0] & 1)
		regs->sp -= 16;
	return 0;
}
int never(struct kprobe *p, struct pt_regs *regs) { regs->regs[0] = 0; return 0; }
"""

PT_SPEC = """
handlers = ["handlers.c"]
[[kprobe]]
symbol_name = "fl"
pre_handler = "wr"
[[kprobe]]
symbol_name = "spf"
pre_handler = "sp_pre"
[[kprobe]]
symbol_name = "off"
pre_handler = "never"
disabled = true
"""


def test_pt_regs_template(tmp_path):
    """Writes to x0 and NZCV take effect on the fast path; a changed sp resumes through
    kp_optprobe_resume_regs on it; a disabled probe is silent and not counted."""
    prog = cc(tmp_path, "pt", PT_PROG, "-O2")
    out = instrument(prog, write_spec(tmp_path, PT_SPEC, PT_HANDLERS))
    assert _forms(out) == {("fl", 0): ("pt_regs", True, False), ("spf", 0): ("pt_regs", True, False),
                           ("off", 0): ("pt_regs", True, False)}
    r = run(out, runner="qemu", env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stdout + r.stderr
    a = sum(i + 1000 + (i % 2 == 0) for i in range(100))
    assert r.stdout == f"{a} {16 * 50} {sum(i ^ 1 for i in range(100))}\n", r.stdout + r.stderr
    prof = profile(r.stderr)
    assert prof["p_fl_0"] == (100, 0) and prof["p_spf_0"] == (100, 0) and prof["p_off_0"] == (0, 0)
