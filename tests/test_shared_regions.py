"""Probes on consecutive instructions share one detour (planner.sites.share_regions()).

The kernel refuses a second kprobe inside an optimized kprobe's region; here the
region's head takes the jump and every probe inside rides on its detour, its
handlers running just before its own instruction's copy with regs->ip and the
registers as they are at that instruction.  Each program here would break if
that were not so: handlers that write a register the next instruction reads,
post_handlers that read what their own instruction computed, pre_handlers that
move regs->ip onto another probe of the region or onto an unprobed instruction
under the jump, aggregation, a kretprobe on the region's head; and a probe on
every instruction of real functions (jump-table switch, loops, RIP-relative
loads, calls) with every hit count equal to a ptrace oracle."""
from __future__ import annotations

import subprocess

import pytest

from conftest import cc, check_lines, function, insns, instrument, meta, probe_spec, profile, run, write_spec
from test_int3 import EVERY_FUNCS, EVERYWHERE, TRACER

ARCHES = ["x86_64"]      # x86-64 only: x86-64 assembly (consecutive instructions in one 5-byte region)

PROG = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
/* Two-byte instructions, so one 5-byte jump covers three of them. */
#define FN(name) ".globl " #name "\n.type " #name ",@function\n" #name ":\n"
__asm__(".text\n"
FN(s_regs)
"  mov %edi,%eax\n"          /* +0: pre sets regs->di = 5 first */
"  add %eax,%eax\n"          /* +2: pre sees ax 5; post sees ax 10 */
"  inc %eax\n"               /* +4: pre adds 100 to ax */
"  inc %eax\n"
"  ret\n"
".size s_regs,.-s_regs\n"
FN(s_skip)
"  mov %edi,%eax\n"          /* +0 */
"  inc %eax\n"               /* +2: pre skips it: regs->ip = +4, another probe of the region */
"  inc %eax\n"               /* +4 */
"  inc %eax\n"
"  ret\n"
".size s_skip,.-s_skip\n"
FN(s_skip2)
"  mov %edi,%eax\n"          /* +0 */
"  inc %eax\n"               /* +2: pre skips it: regs->ip = +4, unprobed, under the jump */
"  inc %eax\n"               /* +4 */
"  inc %eax\n"
"  ret\n"
".size s_skip2,.-s_skip2\n"
FN(s_agg)
"  mov %edi,%eax\n"          /* +0 */
"  inc %eax\n"               /* +2: a counter and the skip, aggregated */
"  inc %eax\n"               /* +4 */
"  inc %eax\n"
"  ret\n"
".size s_agg,.-s_agg\n"
/* A region never runs into the next function: s_next's entry cannot take a jump
   (its loop starts 2 bytes in), and must not ride on s_prev's region.  Nothing in
   the program names s_next (it is found by dlsym), so its entry is no known jump
   target, as an exported function of a library called by no one inside is not. */
FN(s_prev)
"  mov %edi,%eax\n  inc %eax\n  inc %eax\n  ret\n"
".size s_prev,.-s_prev\n"
FN(s_next)
"  mov %edi,%eax\n"
"1: dec %eax\n  jnz 1b\n  ret\n"
".size s_next,.-s_next\n");
int s_regs(int), s_skip(int), s_skip2(int), s_agg(int), s_prev(int);
int main(void)
{
    int (*s_next)(int) = (int (*)(int))dlsym(RTLD_DEFAULT, "s_next");
    long t = 0;
    for (int i = 0; i < 10; i++)
        t += s_regs(i) + s_skip(i) + s_skip2(i) + s_agg(i) + s_prev(i) + s_next(i + 1);
    printf("%d %d %d %d %ld\n", s_regs(1), s_skip(1), s_skip2(1), s_agg(1), t);
    return 0;
}
"""

HANDLERS = r"""
#include <linux/kprobes.h>
static int bad;
static void check_ip(struct kprobe *p, struct pt_regs *regs)
{
    if (regs->ip != (unsigned long)p->addr + 1 && !bad++)
        pr_err("BAD ip %s+%u\n", p->symbol_name, p->offset);
}
int setdi(struct kprobe *p, struct pt_regs *regs) { check_ip(p, regs); regs->di = 5; return 0; }
int peek(struct kprobe *p, struct pt_regs *regs)
{
    check_ip(p, regs);
    if (regs->ax != 5 && !bad++)
        pr_err("BAD peek ax=%lu\n", regs->ax);
    return 0;
}
void after(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
    if ((regs->ax != 10 || regs->ip != (unsigned long)p->addr + 2) && !bad++)
        pr_err("BAD post ax=%lu\n", regs->ax);
}
int bump(struct kprobe *p, struct pt_regs *regs) { check_ip(p, regs); regs->ax += 100; return 0; }
int skip(struct kprobe *p, struct pt_regs *regs) { regs->ip = (unsigned long)p->addr + 2; return 1; }
int count(struct kprobe *p, struct pt_regs *regs) { check_ip(p, regs); return 0; }
int ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
    if (regs_return_value(regs) != 112 && !bad++)
        pr_err("BAD return %lu\n", regs_return_value(regs));
    return 0;
}
"""

SPEC = """handlers = ["handlers.c"]
[[kprobe]]
symbol_name = "s_regs"
pre_handler = "setdi"
name = "regs0"
[[kprobe]]
symbol_name = "s_regs"
offset = 2
pre_handler = "peek"
post_handler = "after"
name = "regs2"
[[kprobe]]
symbol_name = "s_regs"
offset = 4
pre_handler = "bump"
name = "regs4"
[[kretprobe]]
symbol_name = "s_regs"
handler = "ret"
name = "regs_ret"
[[kprobe]]
symbol_name = "s_skip"
name = "skip0"
[[kprobe]]
symbol_name = "s_skip"
offset = 2
pre_handler = "skip"
name = "skip2"
[[kprobe]]
symbol_name = "s_skip"
offset = 4
pre_handler = "count"
name = "skip4"
[[kprobe]]
symbol_name = "s_skip2"
name = "skip2_0"
[[kprobe]]
symbol_name = "s_skip2"
offset = 2
pre_handler = "skip"
name = "skip2_2"
[[kprobe]]
symbol_name = "s_agg"
name = "agg0"
[[kprobe]]
symbol_name = "s_agg"
offset = 2
pre_handler = "count"
name = "agg2_count"
[[kprobe]]
symbol_name = "s_agg"
offset = 2
pre_handler = "skip"
name = "agg2_skip"
[[kprobe]]
symbol_name = "s_agg"
offset = 4
name = "agg4"
[[kprobe]]
symbol_name = "s_prev"
name = "prev0"
[[kprobe]]
symbol_name = "s_next"
name = "next0"
"""


def _build(tmp):
    prog = cc(tmp, "shared", PROG, "-O1", "-rdynamic")
    spec = write_spec(tmp, SPEC, HANDLERS)
    return prog, check_lines(prog, spec), instrument(prog, spec)


def test_handlers_see_their_own_instruction(once, runner):
    prog, lines, out = once(_build)
    assert run(prog).stdout == "4 4 4 4 400\n"
    # Every probe jump-optimized: the heads at +0, the rest riding on them; but
    # s_next's entry, which no region of its own function can cover, does not ride
    # on s_prev's region: it takes a short jump into an evicted neighbour
    # (planner.short_jumps.evict_neighbour(), tests/test_eviction.py).
    assert all("  optimized" in l for l in lines), lines
    m = {p["name"]: p for p in meta(out)["probes"]}
    assert m["next0"].get("shared_with") is None and m["next0"].get("evicted"), m["next0"]
    assert m["regs2"]["region"][0] == m["regs2"]["addr"] and m["regs0"]["region"][1] >= m["regs4"]["addr"] + 2
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    # s_regs: 5 -> 10 -> 110 -> 111 -> 112 whatever its argument; each skip drops one inc.
    assert r.returncode == 0 and r.stdout == "112 3 3 3 1380\n", r.stderr
    assert "BAD" not in r.stderr, r.stderr
    prof = {k: v[0] for k, v in profile(r.stderr).items()}
    assert prof == {"regs0": 11, "regs2": 11, "regs4": 11, "regs_ret": 11, "skip0": 11, "skip2": 11, "skip4": 11,
                    "skip2_0": 11, "skip2_2": 11, "agg0": 11, "agg2_count": 11, "agg2_skip": 11, "agg4": 11,
                    "prev0": 10, "next0": 10}, r.stderr


@pytest.fixture(scope="module")
def everywhere(tmp_path_factory):
    """EVERYWHERE (test_int3) with a probe on every instruction of its functions,
    and the ptrace oracle's count of each."""
    tmp = tmp_path_factory.mktemp("shared_everywhere")
    prog = cc(tmp, "every", EVERYWHERE, "-O2")
    tracer = cc(tmp, "tracer", TRACER, "-O2")
    probes = [(f, off) for f in EVERY_FUNCS for off, _ in insns(prog, f)]
    start = {f: function(prog, f)[0] for f in EVERY_FUNCS}
    (tmp / "addrs").write_text("".join(f"{start[f] + off:x}\n" for f, off in probes))
    r = subprocess.run([str(tracer), str(tmp / "addrs"), str(tmp / "counts"), str(prog), "37"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    counts = {int(a, 16): int(c) for a, c in (l.split() for l in (tmp / "counts").read_text().splitlines())}
    oracle = {f"p_{f}_{off}": counts[start[f] + off] for f, off in probes}
    return prog, tuple(probes), r.stdout, oracle


CHECK_IP = r"""
#include <linux/kprobes.h>
static int bad;
/* Reads regs: every detour builds struct pt_regs, with ip as at a breakpoint. */
int pre(struct kprobe *p, struct pt_regs *regs)
{
    if (regs->ip != (unsigned long)p->addr + 1 && !bad++)
        pr_err("BAD ip %s+%u\n", p->symbol_name, p->offset);
    return 0;
}
void post(struct kprobe *p, struct pt_regs *regs, unsigned long flags) { }
"""


def _every(tmp, prog, probes, form):
    probes = list(probes)
    keys = {"none": {}, "regs": {"pre_handler": "pre"}, "post": {"pre_handler": "pre", "post_handler": "post"}}[form]
    spec = write_spec(tmp, probe_spec("kprobe", probes, handlers=form != "none", **keys), CHECK_IP)
    return check_lines(prog, spec), instrument(prog, spec, tmp / "every.kp")


@pytest.mark.parametrize("form", ["none", "regs", "post"])
def test_every_instruction_jump_optimized(everywhere, once, runner, form):
    """Every instruction of eight functions probed: at least 95% jump-optimized
    (a post_handler cannot follow a branch in a detour, so fewer there), the
    output unchanged and every hit count the ptrace oracle's."""
    prog, probes, want, oracle = everywhere
    lines, out = once(_every, prog, probes, form)
    optimized = sum("  optimized" in l for l in lines)
    assert len(lines) == len(probes) and optimized >= (0.70 if form == "post" else 0.95) * len(probes), \
        [l for l in lines if "  optimized" not in l]
    r = run(out, "37", runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == want, r.stderr
    assert "BAD" not in r.stderr, r.stderr
    prof = profile(r.stderr)
    assert {k: v[0] for k, v in prof.items()} == oracle
    assert all(v[1] == 0 for v in prof.values())
