"""Direct branches that enter a detour themselves (issue 15; Rules.retarget_branches,
planner._retarget_branches()): a `call`, `jmp` or `jcc` rel32 to the start of a
jump-optimized region names the detour, so a hit through it skips the jump at the
region.  The callee must not tell: its return address, its arguments, its hit
counts and its kretprobe are the same.  Bytes that only look like such a branch
(data in .text that no FDE describes) and branches whose bytes another probe
patches stay as they are.

And a detour's copy that runs on past its region to the function's next exit
(Rules.run_on, planner._run_on()): a leaf's fast path returns from the detour,
a branch in the copy back to the probed entry still counts a hit, and the copy
stops before another probe's bytes, whose hits must all be counted (against
the same probes as breakpoints)."""
from __future__ import annotations

import pytest

from conftest import cc, function, instrument, meta, profile, read_at, run, symbols, write_spec

N = 2000

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
long work(long a);
/* blob: a `call work` in .text that is data (no FDE describes it): printed, never run. */
__asm__(
".text\n"
".globl blob\n.type blob,@function\nblob:\n"
"  .byte 0xe8\n  .long work - (blob + 5)\n  .byte 0xc3\n"
".size blob,.-blob\n"
/* tail_work: a tail call through jmp rel32. */
".globl tail_work\n.type tail_work,@function\ntail_work:\n"
"  .cfi_startproc\n"
"  add $1,%rdi\n"
"  {disp32} jmp work\n"
"  .cfi_endproc\n"
".size tail_work,.-tail_work\n"
/* cond_work: a conditional tail call through jne rel32. */
".globl cond_work\n.type cond_work,@function\ncond_work:\n"
"  .cfi_startproc\n"
"  test %rdi,%rdi\n"
"  {disp32} jne work\n"
"  mov $-1,%rax\n"
"  ret\n"
"  .cfi_endproc\n"
".size cond_work,.-cond_work\n"
);
extern const unsigned char blob[];
long tail_work(long a);
long cond_work(long a);
static unsigned long ra_min = ~0UL, ra_max;
__attribute__((noinline)) long work(long a)
{
    unsigned long ra = (unsigned long)__builtin_return_address(0);
    if (ra < ra_min) ra_min = ra;
    if (ra > ra_max) ra_max = ra;
    long s = 0;
    for (long i = 0; i < a % 50; i++)
        s += (i * 7) ^ (s >> 2);
    return s;
}
long (*volatile indirect)(long) = work;
int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 10, s = 0;
    for (long i = 0; i < n; i++)
        s += work(i) + tail_work(i) + cond_work(i) + indirect(i);
    printf("%ld %lx %lx", s, ra_min - (unsigned long)main, ra_max - (unsigned long)main);
    for (int i = 0; i < 6; i++)
        printf(" %02x", blob[i]);
    printf("\n");
    return 0;
}
"""

HANDLERS = r"""
#include <linux/kprobes.h>
static int bad;
int entered(struct kprobe *p, struct pt_regs *regs)
{
    /* Every way in shows the probe's own address and the caller's frame. */
    if (regs->ip != (unsigned long)p->addr + 1 && !bad++)
        pr_err("BAD ip %lx\n", regs->ip);
    return 0;
}
static long seen;
int returned(struct kretprobe_instance *ri, struct pt_regs *regs)
{
    seen++;
    return 0;
}
"""

SPEC = f"""handlers = ["handlers.c"]
[[kprobe]]
symbol_name = "work"
pre_handler = "entered"
[[kretprobe]]
symbol_name = "work"
handler = "returned"
"""

LIGHT = """
[[kprobe]]
symbol_name = "work"
[[kprobe]]
symbol_name = "tail_work"
"""


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    d = tmp_path_factory.mktemp("retarget")
    prog = cc(d, "prog", PROGRAM, "-O2", "-fcf-protection=none")
    return d, prog


def _branches(binary):
    return {src: (size, target) for src, size, target in meta(binary).get("branches", [])}


def test_branches_enter_detours(program, runner):
    d, prog = program
    out = instrument(prog, write_spec(d, SPEC, HANDLERS), d / "prog.kp")
    sym = symbols(prog)
    branches = _branches(out)
    # main's call, tail_work's jmp and cond_work's jne name the detour; blob's bytes do not.
    lo, hi = function(prog, "main")
    assert any(lo <= s < hi and t == sym["work"] for s, (_, t) in branches.items()), branches
    assert sym["tail_work"] + 4 in branches and branches[sym["tail_work"] + 4] == (5, sym["work"])
    assert sym["cond_work"] + 3 in branches and branches[sym["cond_work"] + 3] == (6, sym["work"])
    assert sym["blob"] not in branches
    assert read_at(out, sym["blob"], 6) == read_at(prog, sym["blob"], 6)
    # The rel32 really changed (the branch goes to the detour, not to work).
    assert read_at(out, sym["tail_work"] + 4, 5) != read_at(prog, sym["tail_work"] + 4, 5)
    want = run(prog, N)
    got = run(out, N, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert got.returncode == 0 and got.stdout == want.stdout, got.stderr
    assert "BAD" not in got.stderr
    hits = profile(got.stderr)
    calls = 4 * N - 1                   # cond_work(0) does not call work
    assert hits["p_work_0"] == (calls, 0) and hits["r_work_0"] == (calls, 0), hits


def test_light_hits_through_branches(program, runner):
    d, prog = program
    out = instrument(prog, write_spec(d, LIGHT, name="light.toml"), d / "prog.light")
    sym = symbols(prog)
    branches = _branches(out)
    # tail_work's own jmp lies in tail_work's probed region: it is copied, not retargeted.
    assert sym["tail_work"] + 4 not in branches
    assert sym["cond_work"] + 3 in branches
    got = run(out, N, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert got.returncode == 0 and got.stdout == run(prog, N).stdout, got.stderr
    hits = profile(got.stderr)
    assert hits["p_work_0"] == (4 * N - 1, 0) and hits["p_tail_work_0"] == (N, 0), hits


def test_no_retarget_without_optimization(program):
    d, prog = program
    out = instrument(prog, write_spec(d, SPEC, HANDLERS, name="noopt.toml"), d / "prog.noopt", "--no-optimize")
    assert _branches(out) == {}
    assert run(out, N).stdout == run(prog, N).stdout


# --- a detour's copy runs on past its region (Rules.run_on, planner._run_on()) ----------------

RUN_ON = r"""
#include <stdio.h>
#include <stdlib.h>
long slow(long *p);
long fast(long *p);
long countdown(long n);
long probed_inside(long n);
__asm__(
".text\n"
/* fast: the fast path returns 8 bytes past the region; the slow one tail-calls. */
".globl fast\n.type fast,@function\nfast:\n"
"  .cfi_startproc\n"
"  mov (%rdi),%rax\n"
"  test %rax,%rax\n"
"  js 1f\n"
"  lea 1(%rax,%rax),%rax\n"
"  ret\n"
"1:\n"
"  jmp slow\n"
"  .cfi_endproc\n"
".size fast,.-fast\n"
/* countdown: the run-on copy branches back to the probed entry: a hit each time. */
".globl countdown\n.type countdown,@function\ncountdown:\n"
"  .cfi_startproc\n"
"  mov %rdi,%rax\n"
"  sub $1,%rdi\n"
"  {disp32} jg countdown\n"
"  ret\n"
"  .cfi_endproc\n"
".size countdown,.-countdown\n"
/* probed_inside: a second probe 7 bytes in, where a run-on copy would skip it. */
".globl probed_inside\n.type probed_inside,@function\nprobed_inside:\n"
"  .cfi_startproc\n"
"  mov %rdi,%rax\n"
"  add $3,%rax\n"
"  .globl probed_inside_second\n"
"probed_inside_second:\n"
"  add %rax,%rax\n"
"  ret\n"
"  .cfi_endproc\n"
".size probed_inside,.-probed_inside\n"
);
long slow(long *p) { return -*p; }
int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 10, s = 0;
    for (long i = 0; i < n; i++) {
        long v = i % 3 ? i : -i;
        s += fast(&v) + countdown(i % 5) + probed_inside(i);
    }
    printf("%ld\n", s);
    return 0;
}
"""

RUN_ON_SPEC = """
[[kprobe]]
symbol_name = "fast"
[[kprobe]]
symbol_name = "countdown"
[[kprobe]]
symbol_name = "probed_inside"
[[kprobe]]
symbol_name = "probed_inside"
offset = 7
"""


@pytest.mark.parametrize("pie", ["-pie", "-no-pie"])
def test_run_on_copies(tmp_path, runner, pie):
    prog = cc(tmp_path, "runon", RUN_ON, "-O2", "-fcf-protection=none", pie)
    spec = write_spec(tmp_path, RUN_ON_SPEC)
    out = instrument(prog, spec, tmp_path / "runon.kp")
    oracle = instrument(prog, spec, tmp_path / "runon.int3", "--no-optimize")
    sym = symbols(prog)
    probes = {p["name"]: p for p in meta(out)["probes"]}
    # fast's copy runs on to its ret (the region is mov+test, 6 bytes; the ret ends at +14).
    assert probes["p_fast_0"]["run_on"] == [sym["fast"] + 6, sym["fast"] + 14], probes["p_fast_0"]
    # countdown's copy runs on through its jg (which names the detour) to its ret.
    assert probes["p_countdown_0"]["run_on"][1] == sym["countdown"] + 14
    # probed_inside's copy stops where the second probe sits: no run-on past it.
    assert "run_on" not in probes["p_probed_inside_0"]
    want = run(prog, N)
    got = run(out, N, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    ref = run(oracle, N, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert got.returncode == 0 and got.stdout == want.stdout == ref.stdout, got.stderr
    hits = profile(got.stderr)
    assert hits == profile(ref.stderr) and hits["p_countdown_0"][0] > N and hits["p_probed_inside_7"] == (N, 0), hits
