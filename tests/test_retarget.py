"""Direct branches that enter a detour themselves (Rules.retarget_branches,
planner.retarget.retarget_branches()): a `call`, `jmp` or `jcc` rel32 to the start of a
jump-optimized region names the detour, so a hit through it skips the jump at the
region.  The callee must not tell: its return address, its arguments, its hit
counts and its kretprobe are the same.  Bytes that only look like such a branch
(data in .text that no FDE describes) and branches whose bytes another probe
patches stay as they are.

And a branch copied into a detour (a region ending with a call of a probed
function: Site.branch_to) enters that function's detour too; a jcc back to its
own probed entry counts a hit each time; a second probe inside a function keeps
all its hits (against the same probes as breakpoints)."""
from __future__ import annotations

import pytest

from conftest import cc, function, instrument, meta, profile, read_at, run, symbols, write_spec

ARCHES = ["x86_64"]      # x86-64 only: x86-64 assembly (branches into 5-byte regions)

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


# --- branches copied into detours, branches back to a probed entry ------------------------------

COPIED = r"""
#include <stdio.h>
#include <stdlib.h>
long fast(long *p);
long calls_fast(long *p);
long countdown(long n);
long probed_inside(long n);
__asm__(
".text\n"
".globl fast\n.type fast,@function\nfast:\n"
"  .cfi_startproc\n"
"  mov (%rdi),%rax\n"
"  test %rax,%rax\n"
"  js 1f\n"
"  lea 1(%rax,%rax),%rax\n"
"  ret\n"
"1:\n"
"  neg %rax\n"
"  ret\n"
"  .cfi_endproc\n"
".size fast,.-fast\n"
/* calls_fast: its region ends with the call, whose copy enters fast's detour. */
".globl calls_fast\n.type calls_fast,@function\ncalls_fast:\n"
"  .cfi_startproc\n"
"  sub $8,%rsp\n"
"  .cfi_def_cfa_offset 16\n"
"  {disp32} call fast\n"
"  add $8,%rsp\n"
"  .cfi_def_cfa_offset 8\n"
"  ret\n"
"  .cfi_endproc\n"
".size calls_fast,.-calls_fast\n"
/* countdown: a jg back to the probed entry, sent to its detour: a hit each time. */
".globl countdown\n.type countdown,@function\ncountdown:\n"
"  .cfi_startproc\n"
"  mov %rdi,%rax\n"
"  sub $1,%rdi\n"
"  {disp32} jg countdown\n"
"  ret\n"
"  .cfi_endproc\n"
".size countdown,.-countdown\n"
/* probed_inside: a second probe 7 bytes in. */
".globl probed_inside\n.type probed_inside,@function\nprobed_inside:\n"
"  .cfi_startproc\n"
"  mov %rdi,%rax\n"
"  add $3,%rax\n"
"  add %rax,%rax\n"
"  ret\n"
"  .cfi_endproc\n"
".size probed_inside,.-probed_inside\n"
);
int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 10, s = 0;
    for (long i = 0; i < n; i++) {
        long v = i % 3 ? i : -i;
        s += calls_fast(&v) + countdown(i % 5) + probed_inside(i);
    }
    printf("%ld\n", s);
    return 0;
}
"""

COPIED_SPEC = """
[[kprobe]]
symbol_name = "fast"
[[kprobe]]
symbol_name = "calls_fast"
[[kprobe]]
symbol_name = "countdown"
[[kprobe]]
symbol_name = "probed_inside"
[[kprobe]]
symbol_name = "probed_inside"
offset = 7
"""


@pytest.mark.parametrize("pie", ["-pie", "-no-pie"])
def test_copied_branches_and_loops(tmp_path, runner, pie):
    import capstone
    prog = cc(tmp_path, "copied", COPIED, "-O2", "-fcf-protection=none", pie)
    spec = write_spec(tmp_path, COPIED_SPEC)
    out = instrument(prog, spec, tmp_path / "copied.kp")
    oracle = instrument(prog, spec, tmp_path / "copied.int3", "--no-optimize")
    sym = symbols(prog)
    probes = {p["name"]: p for p in meta(out)["probes"]}
    assert probes["p_calls_fast_0"]["region"] == [sym["calls_fast"], sym["calls_fast"] + 9]
    # The copied call jumps to fast's detour (its return address pushed by hand), not to fast.
    d = probes["p_calls_fast_0"]["detour"]
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    jumps = [int(i.op_str, 16) for i in md.disasm(read_at(out, d, 256), d) if i.mnemonic == "jmp"
             and i.op_str.startswith("0x")]
    assert probes["p_fast_0"]["detour"] in jumps and sym["fast"] not in jumps, [hex(j) for j in jumps]
    # countdown's jg names its own detour.
    assert [sym["countdown"] + 7, 6, sym["countdown"]] in meta(out)["branches"]
    want = run(prog, N)
    got = run(out, N, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    ref = run(oracle, N, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert got.returncode == 0 and got.stdout == want.stdout == ref.stdout, got.stderr
    hits = profile(got.stderr)
    assert hits == profile(ref.stderr) and hits["p_countdown_0"][0] > N and hits["p_probed_inside_7"] == (N, 0), hits
    assert hits["p_fast_0"] == (N, 0), hits
