"""AArch64 probes on real cross-compiled programs, run under qemu-aarch64
(KPREWRITE_TEST_ARCH=aarch64): breakpoint probes (brk #0x004; PC-relative
instructions simulated, the rest single-stepped out of line) and optimized
probes (one B to a detour; PC-relative displaced instructions relocated) on
every instruction of functions full of PC-relative instructions, in non-PIE,
PIE, static and static-PIE executables and a shared object; the program's output must not change, every hit must be
counted, and each pre_handler must see pc at the probed address.  And the
kernel's refusals (exclusive sequences, svc, msr, autiasp) with their reasons."""
from __future__ import annotations

import pytest

from conftest import cc, check_lines, function, instrument, kprewrite, profile, run, write_spec

ARCHES = ["aarch64"]

# adr, adrp + add, ldr/ldrsw literal (x and w), cbz, tbnz, b.cond, bl, b (a tail
# call), br/blr through a register and ret: every class simulate-insn.c has.
PROGRAM = r"""
#include <stdio.h>
long helper(long x);
long pcrel(long x);
long table_sum(long n);
__asm__(
".section .rodata\n"
".p2align 3\n"
"lit: .quad 1000\n"
"litw: .word -7\n"
".text\n"
".globl helper\n.type helper,%function\nhelper:\n"
"  add x0, x0, #100\n"
"  ret\n"
".size helper,.-helper\n"
".globl pcrel\n.type pcrel,%function\npcrel:\n"
"  stp x29, x30, [sp, #-16]!\n"
"  mov x29, sp\n"
"  adr x1, lit\n"
"  ldr x2, lit\n"
"  ldrsw x3, litw\n"
"  ldr w4, litw\n"
"  adrp x6, lit\n"
"  add x6, x6, :lo12:lit\n"
"  cbz x0, 1f\n"
"  add x2, x2, #1\n"
"1: tbnz x0, #1, 2f\n"
"  add x2, x2, #2\n"
"2: cmp x0, #2\n"
"  b.ge 3f\n"
"  add x2, x2, #4\n"
"3: bl helper\n"
"  add x0, x0, x2\n"
"  add x0, x0, x3\n"
"  add x0, x0, x4\n"
"  ldr x5, [x1]\n"
"  add x0, x0, x5\n"
"  ldr x5, [x6]\n"
"  add x0, x0, x5\n"
"  adr x7, helper\n"
"  blr x7\n"
"  ldp x29, x30, [sp], #16\n"
"  ret\n"
".size pcrel,.-pcrel\n"
".globl tail\n.type tail,%function\ntail:\n"
"  add x0, x0, #1\n"
"  b helper\n"
".size tail,.-tail\n");
long tail(long x);
static int table[4] = {3, 5, 7, 11};
__attribute__((noinline)) long table_sum(long n) {
    long s = 0;
    for (long i = 0; i < n; i++) s += table[i & 3] * i;
    return s;
}
int main(void) {
    long t = 0;
    for (long i = 0; i < 4; i++) {
        long v = pcrel(i);
        printf("pcrel(%ld) = %ld\n", i, v);
        t += v + tail(i);
    }
    printf("table_sum %ld\n", table_sum(10));
    printf("total %ld\n", t);
    return 0;
}
"""

HANDLERS = r"""
#include <linux/kprobes.h>
int pre(struct kprobe *p, struct pt_regs *regs)
{
    if (regs->pc != (unsigned long)p->addr)
        pr_err("BAD pre pc %s+%u\n", p->symbol_name, p->offset);
    return 0;
}
"""

FUNCS = ("pcrel", "tail", "helper", "table_sum")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The programs (non-PIE, PIE) with their expected output, and a spec with a
    probe on every instruction of FUNCS."""
    tmp = tmp_path_factory.mktemp("aarch64")
    progs = {"nopie": cc(tmp, "nopie", PROGRAM, "-O2", "-no-pie"), "pie": cc(tmp, "pie", PROGRAM, "-O2", "-pie", "-fPIE"),
             "static": cc(tmp, "static", PROGRAM, "-O2", "-static", skip_without_static=True),
             "static-pie": cc(tmp, "static-pie", PROGRAM, "-O2", "-static-pie", skip_without_static=True)}
    expected = {k: run(p, runner="qemu") for k, p in progs.items()}
    for r in expected.values():
        assert r.returncode == 0 and "total" in r.stdout, r.stdout + r.stderr
    lines = ['handlers = ["handlers.c"]']
    counts = {}
    for f in FUNCS:
        start, end = function(progs["nopie"], f)
        for off in range(0, end - start, 4):
            lines += ["[[kprobe]]", f'symbol_name = "{f}"', f"offset = {off}", 'pre_handler = "pre"']
            counts[(f, off)] = None
    spec = write_spec(tmp, "\n".join(lines) + "\n", HANDLERS)
    return tmp, progs, expected, spec


@pytest.mark.parametrize("mode", ["brk", "optimized"])
@pytest.mark.parametrize("kind", ["nopie", "pie", "static", "static-pie"])
def test_every_instruction_probed(built, kind, mode):
    tmp, progs, expected, spec = built
    extra = ("--no-optimize",) if mode == "brk" else ()
    decisions = [l.split("  ")[2] for l in check_lines(progs[kind], spec, *extra)]
    assert set(decisions) == ({"int3"} if mode == "brk" else {"optimized"}), decisions
    out = instrument(progs[kind], spec, tmp / f"{kind}-{mode}", *extra)
    r = run(out, runner="qemu", env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout == expected[kind].stdout
    assert "BAD" not in r.stderr, r.stderr
    prof = profile(r.stderr)
    # pcrel runs 4 times; its first instruction, helper's (4 direct + 4 by blr
    # + 4 by tail's b) and table_sum's entry counted exactly.
    assert prof["p_pcrel_0"][0] == 4 and prof["p_tail_0"][0] == 4
    assert prof["p_helper_0"][0] == 12 and prof["p_table_sum_0"][0] == 1
    # The branches' both ways: the add after cbz runs for x != 0 (3 times), after
    # tbnz for x & 2 == 0 (2 times), after b.ge for x < 2 (2 times).
    start, _ = function(progs[kind], "pcrel")
    assert sorted(v[0] for k, v in prof.items() if k.startswith("p_pcrel_")).count(3) >= 1


REFUSED = r"""
#include <stdio.h>
long counter;
long bump(void);
long sys_getpid(void);
__asm__(
".text\n"
".globl bump\n.type bump,%function\nbump:\n"
"  adrp x1, counter\n"
"  add x1, x1, :lo12:counter\n"
"1: ldxr x0, [x1]\n"
"  add x0, x0, #1\n"
"  stxr w2, x0, [x1]\n"
"  cbnz w2, 1b\n"
"  ret\n"
".size bump,.-bump\n"
".globl sys_getpid\n.type sys_getpid,%function\nsys_getpid:\n"
"  hint #25\n"              /* paciasp */
"  mov x8, #172\n"
"  svc #0\n"
"  msr nzcv, x8\n"
"  hint #29\n"              /* autiasp */
"  ret\n"
".size sys_getpid,.-sys_getpid\n");
int main(void) { bump(); printf("%ld %d\n", counter, sys_getpid() > 0); return 0; }
"""


def test_refusals_name_the_check_and_address(tmp_path):
    prog = cc(tmp_path, "refused", REFUSED, "-O2")
    lines = ['handlers = ["handlers.c"]']
    for f, n in (("bump", 7), ("sys_getpid", 6)):
        for i in range(n):
            lines += ["[[kprobe]]", f'symbol_name = "{f}"', f"offset = {4 * i}", 'pre_handler = "pre"']
    spec = write_spec(tmp_path, "\n".join(lines) + "\n", HANDLERS)
    # Explicit probes the kernel refuses are errors (register_kprobe()), one line each.
    r = kprewrite("check", prog, "--spec", spec, check=False)
    assert r.returncode != 0
    got = {line.split("(")[1].split(")")[0]: line for line in r.stderr.splitlines() if "[[kprobe]]" in line}
    bump, _ = function(prog, "bump")
    sysc, _ = function(prog, "sys_getpid")
    assert set(got) == {"bump+0x8", "bump+0xc", "bump+0x10", "sys_getpid+0x8", "sys_getpid+0xc",
                        "sys_getpid+0x10"}, r.stderr
    assert f"can_probe at {bump + 8:#x}" in got["bump+0x8"] and "exclusive load/store" in got["bump+0x8"]
    assert f"can_probe at {bump + 12:#x}" in got["bump+0xc"] and f"the ldxr at {bump + 8:#x}" in got["bump+0xc"]
    assert "exclusive load/store" in got["bump+0x10"]
    assert f"can_probe at {sysc + 8:#x}" in got["sys_getpid+0x8"] and "svc" in got["sys_getpid+0x8"]
    assert "msr" in got["sys_getpid+0xc"] and "autiasp" in got["sys_getpid+0x10"]
    # The rest (paciasp, the cbnz after the stxr, ret...) are jump-optimized.
    ok = write_spec(tmp_path, "\n".join(l for l in _spec_lines(((f, o) for f, o in
                    [("bump", 0), ("bump", 4), ("bump", 20), ("bump", 24), ("sys_getpid", 0), ("sys_getpid", 4),
                     ("sys_getpid", 20)]))) + "\n", HANDLERS, name="ok.toml")
    assert {l.split("  ")[2] for l in check_lines(prog, ok)} == {"optimized"}
    out = instrument(prog, ok, tmp_path / "ok")
    assert run(out, runner="qemu").stdout == run(prog, runner="qemu").stdout == "1 1\n"


def _spec_lines(targets):
    yield 'handlers = ["handlers.c"]'
    for f, off in targets:
        yield from ("[[kprobe]]", f'symbol_name = "{f}"', f"offset = {off}", 'pre_handler = "pre"')


@pytest.mark.parametrize("mode", ["brk", "optimized"])
def test_events_fetch_arm64_registers(built, mode):
    """kprobe_events lines with arm64 names: %x0, $arg1 (x0 at an entry), %sp;
    an x86 name is refused with the arm64 hint."""
    tmp, progs, expected, _ = built
    spec = write_spec(tmp, 'events = [\n  "p:pe pcrel x=%x0:s64 a=$arg1:s64 sp=%sp:x64",\n'
                           '  "p:pt tail+4 y=%x0:s64",\n]\n', name=f"events-{mode}.toml")
    extra = ("--no-optimize",) if mode == "brk" else ()
    out = instrument(progs["pie"], spec, tmp / f"events-{mode}", *extra)
    r = run(out, runner="qemu", env={"KPREWRITE_TRACE": "-"})
    assert r.returncode == 0 and expected["pie"].stdout in r.stdout, r.stdout + r.stderr
    lines = (r.stdout + r.stderr).splitlines()
    pe = [l.split("(pcrel+0x0/")[1] for l in lines if " pe: " in l]
    assert [l.split(") ")[1].split(" sp=")[0] for l in pe] == [f"x={i} a={i}" for i in range(4)], r.stdout
    assert all(" sp=0x" in l for l in pe)
    pt = [l.split(") ")[1] for l in lines if " pt: " in l]
    assert pt == [f"y={i + 1}" for i in range(4)], r.stdout
    bad = write_spec(tmp, 'events = ["p:pb pcrel x=%di"]\n', name="bad.toml")
    r = kprewrite("check", progs["pie"], "--spec", bad, check=False)
    assert r.returncode != 0 and "x0-x30" in r.stderr, r.stderr


LIBRARY = r"""
static int tab[3] = {2, 4, 6};
__attribute__((noinline)) int libwork(int n) { int s = 0; for (int i = 0; i < n; i++) s += tab[i % 3]; return s; }
"""
LIB_MAIN = r"""
#include <stdio.h>
int libwork(int);
int main(void) { int t = 0; for (int i = 0; i < 5; i++) t += libwork(i); printf("lib total %d\n", t); return 0; }
"""


@pytest.mark.parametrize("mode", ["brk", "optimized"])
def test_shared_object(tmp_path, mode):
    """Every instruction of a shared object's function probed; the runtime starts
    from the library's init array (chain_stub)."""
    lib = cc(tmp_path, "libw.so", LIBRARY, "-O2", "-shared", "-fPIC")
    main = cc(tmp_path, "main", LIB_MAIN, "-O2", f"-L{tmp_path}", "-lw")
    start, end = function(lib, "libwork")
    spec = write_spec(tmp_path, "\n".join(_spec_lines(("libwork", o) for o in range(0, end - start, 4))) + "\n",
                      HANDLERS)
    extra = ("--no-optimize",) if mode == "brk" else ()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    instrument(lib, spec, out_dir / "libw.so", *extra)
    want = run(main, runner="qemu", env={"LD_LIBRARY_PATH": str(tmp_path)})
    assert want.stdout == "lib total 34\n", want.stdout + want.stderr
    r = run(main, runner="qemu", env={"LD_LIBRARY_PATH": str(out_dir), "KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == want.stdout, r.stdout + r.stderr
    assert "BAD" not in r.stderr
    prof = profile(r.stderr)
    assert prof["p_libwork_0"][0] == 5 and len(prof) == (end - start) // 4


KRET_PROGRAM = r"""
#include <stdio.h>
__attribute__((noinline)) int leaf(int a) { return a * 3; }
__attribute__((noinline)) int tailer(int a) { return leaf(a + 1); }
__attribute__((noinline)) int unhooked(int a) { return a - 5; }
__attribute__((noinline)) int tail_out(int a) { return unhooked(a * 2); }
__attribute__((noinline)) int cg(int x) {
    static void *t[] = {&&a, &&b, &&c};
    goto *t[x % 3];
a: return x + 100;
b: return x + 200;
c: return x + 300;
}
int main(void) {
    long t = 0;
    for (int i = 0; i < 6; i++) t += tailer(i) + tail_out(i) + cg(i);
    printf("t %ld\n", t);
    return 0;
}
"""

KRET_HANDLERS = r"""
#include <linux/kprobes.h>
int entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
    *(long *)ri->data = (long)regs->regs[0];
    return 0;
}
int ret_handler(struct kretprobe_instance *ri, struct pt_regs *regs)
{
    pr_info("ret %s(%ld) = %ld\n", ri->rp->kp.symbol_name, *(long *)ri->data, (long)(int)regs_return_value(regs));
    return 0;
}
"""


@pytest.mark.parametrize("mode", ["exits", "kprobes_on_exits"])
def test_kretprobes(tmp_path, mode):
    """Every exit hooked: ret (leaf), a tail call to a hooked function (pending:
    tailer's fires at leaf's ret), a tail call to an unhooked one (x30 swapped
    for the trampoline on that path), and the trampoline for a function whose
    br leaves its exits unknown; entry_handler and ri->data, $retval in x0.
    kprobes_on_exits: a kprobe's detour holds leaf's ret and tailer's tail b,
    whose copies call the return hooks (retprobe.hook_copy())."""
    prog = cc(tmp_path, "kret", KRET_PROGRAM, "-O2")
    want = run(prog, runner="qemu")
    lines = ['handlers = ["handlers.c"]']
    for f in ("leaf", "tailer", "tail_out", "cg"):
        lines += ["[[kretprobe]]", f'symbol_name = "{f}"', 'handler = "ret_handler"', 'entry_handler = "entry"',
                  "data_size = 8"]
    if mode == "kprobes_on_exits":
        lines += ["[[kprobe]]", 'symbol_name = "leaf"', "offset = 4", "[[kprobe]]", 'symbol_name = "tailer"', "offset = 4"]
    spec = write_spec(tmp_path, "\n".join(lines) + "\n", KRET_HANDLERS)
    extra = ()
    plan = {l.split("  ")[0].split("+")[0]: l for l in check_lines(prog, spec, *extra) if " r " in l}
    assert "(pending)" in plan["tailer"] and "(trampoline)" in plan["tail_out"], plan
    assert "returns: trampoline" in plan["cg"] and "indirect_jump" in plan["cg"], plan
    out = instrument(prog, spec, tmp_path / "out", *extra)
    r = run(out, runner="qemu", env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == want.stdout, r.stdout + r.stderr
    got = [l for l in r.stderr.splitlines() if l.startswith("ret ")]
    expect = []
    for i in range(6):
        expect += [f"ret leaf({i + 1}) = {3 * (i + 1)}", f"ret tailer({i}) = {3 * (i + 1)}",
                   f"ret tail_out({i}) = {2 * i - 5}", f"ret cg({i}) = {i + 100 * (i % 3 + 1)}"]
    assert got == expect, r.stderr
    if mode == "kprobes_on_exits":
        prof = profile(r.stderr)
        assert prof["p_leaf_4"][0] == prof["p_tailer_4"][0] == 6, r.stderr


SKIP_HANDLERS = r"""
#include <linux/kprobes.h>
int skip(struct kprobe *p, struct pt_regs *regs)
{
    regs->regs[0] = 42;                 /* the return value */
    regs->pc = regs->regs[30];          /* return at once: the path changes */
    return 1;
}
int twice(struct kprobe *p, struct pt_regs *regs)
{
    regs->regs[0] *= 2;                 /* a register write the probed code sees */
    return 0;
}
"""


@pytest.mark.parametrize("mode", ["brk", "optimized"])
def test_handler_changes_registers_and_path(tmp_path, mode):
    """A pre_handler that returns from leaf() at once (pc = x30: the detour's slow
    resume, a brk the SIGTRAP handler turns into the whole register state), and
    one that doubles tail_out()'s argument (the fast path restores x0 from pt_regs)."""
    prog = cc(tmp_path, "kret", KRET_PROGRAM, "-O2")
    spec = write_spec(tmp_path, "\n".join(_spec_lines([])) + "\n"
                      + '[[kprobe]]\nsymbol_name = "leaf"\npre_handler = "skip"\n'
                      + '[[kprobe]]\nsymbol_name = "tail_out"\npre_handler = "twice"\n', SKIP_HANDLERS)
    extra = ("--no-optimize",) if mode == "brk" else ()
    out = instrument(prog, spec, tmp_path / "out", *extra)
    r = run(out, runner="qemu")
    # tailer(i) = leaf(i + 1) = 42; tail_out(i) = 2 * (2 * i) - 5; cg(i) = i + 100 * (i % 3 + 1).
    want = sum(42 + (4 * i - 5) + i + 100 * (i % 3 + 1) for i in range(6))
    assert r.returncode == 0 and r.stdout == f"t {want}\n", r.stdout + r.stderr


POST_HANDLERS = r"""
#include <linux/kprobes.h>
void post(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
    pr_info("post %s+%u d=%ld x0=%ld\n", p->symbol_name, p->offset,
            (long)(regs->pc - (unsigned long)p->addr), (long)regs->regs[0]);
}
"""


@pytest.mark.parametrize("mode", ["brk", "optimized"])
def test_post_handlers(tmp_path, mode):
    """post_handlers after a single-stepped (or detoured) add and after a
    simulated tail b: regs->pc is where execution resumes, x0 the add's result.
    A post_handler after a branch keeps the site a breakpoint, with the reason."""
    prog = cc(tmp_path, "kret", KRET_PROGRAM, "-O2")
    tailer, _ = function(prog, "tailer")
    leaf, _ = function(prog, "leaf")
    spec = write_spec(tmp_path, "\n".join(_spec_lines([])) + "\n"
                      + '[[kprobe]]\nsymbol_name = "tailer"\npost_handler = "post"\n'
                      + '[[kprobe]]\nsymbol_name = "tailer"\noffset = 4\npost_handler = "post"\n', POST_HANDLERS)
    extra = ("--no-optimize",) if mode == "brk" else ()
    plan = check_lines(prog, spec, *extra)
    if mode == "optimized":
        assert "optimized" in plan[0] and f"post_handler at {tailer + 4:#x}" in plan[1], plan
    out = instrument(prog, spec, tmp_path / "out", *extra)
    r = run(out, runner="qemu")
    assert r.returncode == 0, r.stdout + r.stderr
    posts = [l for l in r.stderr.splitlines() if l.startswith("post ")]
    want = []
    for i in range(6):
        want += [f"post tailer+0 d=4 x0={i + 1}", f"post tailer+4 d={leaf - tailer - 4} x0={i + 1}"]
    assert posts == want, r.stderr


SIGTRAP_PROGRAM = r"""
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <string.h>
static volatile int mine;
__attribute__((noinline)) int work(int x) { return x * 3 + 1; }
static void on_trap(int sig, siginfo_t *si, void *uc) { mine += si->si_signo == SIGTRAP; }
int main(void)
{
    int t = work(1);
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_trap;
    sa.sa_flags = SA_SIGINFO;
    sigfillset(&sa.sa_mask);                 /* would block SIGTRAP during the handler */
    sigaction(SIGTRAP, &sa, &old);
    t += work(2);
    raise(SIGTRAP);                          /* sent: goes to the program */
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, 0);         /* blocks SIGTRAP too */
    t += work(3);
    sigprocmask(SIG_UNBLOCK, &all, 0);
    sigaction(SIGTRAP, 0, &old);
    printf("reads back its own handler: %d\n", old.sa_sigaction == on_trap);
    printf("t=%d mine=%d\n", t, mine);
    return 0;
}
"""


def test_program_with_its_own_sigtrap_handler(tmp_path):
    """A program that installs its own SIGTRAP handler and blocks SIGTRAP, with a
    brk probe on work(): the runtime's hooks of its GOT slots (R_AARCH64_GLOB_DAT,
    R_AARCH64_JUMP_SLOT) keep our handler, so every hit is counted, and the
    program's raise() still reaches its own handler."""
    prog = cc(tmp_path, "trap", SIGTRAP_PROGRAM, "-O2")
    want = run(prog, runner="qemu")
    assert want.returncode == 0 and want.stdout.endswith("t=21 mine=1\n"), want
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n')
    out = instrument(prog, spec, tmp_path / "out", "--no-optimize")
    r = run(out, runner="qemu", env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == want.stdout, r.stdout + r.stderr
    assert "reads back its own handler: 1" in r.stdout
    assert [v[0] for v in profile(r.stderr).values()] == [3], r.stderr
