"""The clean call and the inlined dispatch template: sites whose handlers never
read pt_regs (kprewrite reads the handlers' code) save only what a C call
clobbers.  These programs check that what the probed code can observe is still
intact, and that the choice follows the handlers' code."""
from __future__ import annotations

import subprocess

from conftest import cc, instrument, kprewrite, meta, profile, run, write_spec

ARCHES = ["x86_64"]      # x86-64 only: x86-64 assembly (the registers and flags the clean call keeps)

PROG = r"""
#include <stdio.h>
/* live(x): every scratch register holds a known value and the flags of
   `cmp %rdi,%rax` are live across the probe at +48 (seta reads them); the
   stack is misaligned there (one push after entry). */
__asm__(
".text\n.globl live\n.type live,@function\nlive:\n"
"  push %rbx\n"
"  mov $1,%eax\n  mov $2,%ecx\n  mov $3,%edx\n  mov $4,%esi\n"
"  mov $5,%r8d\n  mov $6,%r9d\n  mov $7,%r10d\n  mov $8,%r11d\n"
"  cmp %rdi,%rax\n"
"  seta %bl\n"                    /* +48: the probe */
"  movzbl %bl,%ebx\n"
"  imul $100,%rbx,%rbx\n"
"  add %rcx,%rax\n  add %rdx,%rax\n  add %rsi,%rax\n  add %r8,%rax\n  add %r9,%rax\n"
"  add %r10,%rax\n  add %r11,%rax\n  add %rdi,%rax\n  add %rbx,%rax\n"
"  pop %rbx\n  ret\n"
".size live,.-live\n");
long live(long);
__attribute__((noinline)) long reads(long x) { return x * 3; }
__attribute__((noinline)) long quiet(long x) { return x + 2; }
__attribute__((noinline)) long both(long x) { return x - 1; }
__attribute__((noinline)) long off(long x) { return x ^ 1; }
int main(void) {
    long l = 0;
    for (long i = 0; i < 12; i++)
        l = l * 3 + live(i % 3 == 0 ? 0 : i % 3 == 1 ? 5 : 1);   /* a, not a, equal */
    printf("%ld\n", l);
    long s = 0;
    for (long i = 0; i < 1000; i++)
        s += reads(i) + quiet(i) + both(i) + off(i);
    printf("%ld\n", s);
    return 0;
}
"""

HANDLERS = r"""
#include <kprewrite/kprobes.h>
/* Never reads regs, and wrecks every scratch register and the flags. */
int clobber(struct kprobe *p, struct pt_regs *regs)
{
    pr_info("hit %s\n", p->symbol_name);
    __asm__ volatile("mov $-1,%%rax; mov $-1,%%rcx; mov $-1,%%rdx; mov $-1,%%rsi; mov $-1,%%rdi;"
                     "mov $-1,%%r8; mov $-1,%%r9; mov $-1,%%r10; mov $-1,%%r11; cmp %%rax,%%rax"
                     ::: "rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11", "cc");
    return 0;
}
static unsigned long seen;
int uses_regs(struct kprobe *p, struct pt_regs *regs) { seen += regs->di; return 0; }
static long n_pre, n_post;
int count_pre(struct kprobe *p, struct pt_regs *regs) { n_pre++; return 0; }
void count_post(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
    if (++n_post == 1000)
        pr_info("pre=%ld post=%ld\n", n_pre, n_post);
}
"""

SPEC = """
handlers = ["handlers.c"]
[[kprobe]]
symbol_name = "live"
offset = 48
pre_handler = "clobber"
[[kprobe]]
symbol_name = "reads"
pre_handler = "uses_regs"
[[kprobe]]
symbol_name = "quiet"
[[kprobe]]
symbol_name = "both"
pre_handler = "count_pre"
[[kprobe]]
symbol_name = "both"
post_handler = "count_post"
[[kprobe]]
symbol_name = "off"
pre_handler = "clobber"
disabled = true
"""

def _live(x):
    return 36 + x + (100 if 1 > x else 0)


def _lives():
    v = 0
    for i in range(12):
        v = v * 3 + _live([0, 5, 1][i % 3])
    return v


EXPECTED = f"{_lives()}\n{sum(i * 3 + i + 2 + i - 1 + (i ^ 1) for i in range(1000))}\n"


def _prog(tmp):
    prog = cc(tmp, "prog", PROG, "-O2")
    return prog, instrument(prog, write_spec(tmp, SPEC, HANDLERS))


def test_call_kind_follows_handler_code(once):
    prog, out = once(_prog)
    call = {p["symbol"]: (p["call"], p["inline_dispatch"]) for p in meta(out)["probes"]}
    assert call == {"live": ("clean", True), "reads": ("pt_regs", True), "quiet": ("clean", True),
                    "both": ("clean", False), "off": ("clean", True)}


def test_clean_call_keeps_registers_and_flags(once, runner):
    prog, out = once(_prog)
    assert run(prog).stdout == EXPECTED
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == EXPECTED, r.stderr
    assert r.stderr.count("hit live\n") == 12 and "hit off" not in r.stderr
    assert "pre=1000 post=1000" in r.stderr
    prof = profile(r.stderr)
    assert prof["p_live_48"] == (12, 0)
    assert prof["p_quiet_0"] == (1000, 0) and prof["p_reads_0"] == (1000, 0)
    assert prof["p_off_0"] == (0, 0)           # disabled: silent, not counted


def test_disarmed_template(once, runner):
    prog, out = once(_prog)
    r = run(out, runner=runner, env={"KPREWRITE_ENABLED": "0", "KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == EXPECTED
    assert "hit" not in r.stderr and profile(r.stderr)["p_quiet_0"] == (0, 0)


def test_prebuilt_handler_with_sse_is_refused(tmp_path):
    prog = cc(tmp_path, "prog", PROG, "-O2")
    (tmp_path / "fp.c").write_text("struct kprobe; struct pt_regs;\nvolatile double acc;\n"
                                   "int fp_pre(struct kprobe *p, struct pt_regs *r) { acc = acc * 1.5 + 1; return 0; }\n")
    subprocess.run(["gcc", "-O2", "-fPIC", "-c", str(tmp_path / "fp.c"), "-o", str(tmp_path / "fp.o")], check=True)
    spec = write_spec(tmp_path, 'handlers = ["fp.o"]\n[[kprobe]]\nsymbol_name = "quiet"\npre_handler = "fp_pre"\n')
    r = kprewrite("instrument", prog, "--spec", spec, "-o", tmp_path / "out", check=False)
    assert r.returncode != 0 and not (tmp_path / "out").exists()
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "fp.o uses SSE/AVX/x87 registers" in lines[0] and "Traceback" not in r.stderr


FULL_PROG = r"""
#include <stdio.h>
/* Reads EFLAGS.ID (bit 21) as the probed code sees it. */
__asm__(
".text\n.globl id_flag\n.type id_flag,@function\nid_flag:\n"
"  pushf\n  pop %rax\n  shr $21,%rax\n  and $1,%eax\n  ret\n"
".size id_flag,.-id_flag\n");
long id_flag(void);
__attribute__((noinline)) long twice(long x) { return 2 * x; }
int main(void) {
    long s = 0;
    for (long i = 0; i < 100; i++)
        s += twice(i);
    printf("%ld %ld\n", s, id_flag());
    return 0;
}
"""

FULL_HANDLERS = r"""
#include <kprewrite/kprobes.h>
/* One probe each, reading and writing pt_regs: the full inlined template. */
int set_di(struct kprobe *p, struct pt_regs *regs) { if (regs->di == 7) regs->di = 1000; return 0; }
int set_id(struct kprobe *p, struct pt_regs *regs) { regs->flags |= 1UL << 21; return 0; }
"""

FULL_SPEC = """
handlers = ["handlers.c"]
[[kprobe]]
symbol_name = "twice"
pre_handler = "set_di"
[[kprobe]]
symbol_name = "id_flag"
pre_handler = "set_id"
"""


def _full(tmp):
    prog = cc(tmp, "prog", FULL_PROG, "-O2")
    return prog, instrument(prog, write_spec(tmp, FULL_SPEC, FULL_HANDLERS))


def test_full_template_writes_registers_and_flags(once, runner):
    prog, out = once(_full)
    assert run(prog).stdout == f"{sum(2 * i for i in range(100))} 0\n"
    call = {p["symbol"]: (p["call"], p["inline_dispatch"]) for p in meta(out)["probes"]}
    assert call == {"twice": ("pt_regs", True), "id_flag": ("pt_regs", True)}
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    # regs->di written for one call; the ID flag (not arithmetic) set through popfq.
    assert r.returncode == 0 and r.stdout == f"{sum(2 * i for i in range(100)) - 14 + 2000} 1\n", r.stderr
    assert profile(r.stderr)["p_twice_0"] == (100, 0)


LEAF_HANDLERS = r"""
#include <kprewrite/kprobes.h>
/* A leaf: no call, so kprewrite knows exactly which scratch registers it writes
   (rcx r8 r11 and the flags) and the template saves only those and its own. */
static unsigned long n;
int leaf(struct kprobe *p, struct pt_regs *regs)
{
    __asm__ volatile("mov $-1,%%rcx; mov $-1,%%r8; mov $-1,%%r11; cmp %%rcx,%%rcx" ::: "rcx", "r8", "r11", "cc");
    n++;
    return 0;
}
"""


def _leaf(tmp):
    prog = cc(tmp, "prog", PROG, "-O2")
    spec = write_spec(tmp, 'handlers = ["handlers.c"]\n[[kprobe]]\nsymbol_name = "live"\noffset = 48\n'
                      'pre_handler = "leaf"\n', LEAF_HANDLERS)
    return instrument(prog, spec)


def test_template_saves_what_a_leaf_handler_writes(once, runner):
    out = once(_leaf)
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    # The first hit of the thread takes the slow path (the C callback clobbers every
    # scratch register), the others the fast path: both keep every live value.
    assert r.returncode == 0 and r.stdout == EXPECTED, r.stderr
    assert profile(r.stderr)["p_live_48"] == (12, 0)
