"""AArch64 code out of the optimized probe's reach: a `B` spans +-128 MiB, and
the new code goes after the image's last segment.  A program with a function
placed 256 MiB above the rest (a linker script's section start) keeps its
probes on the far side as breakpoints and its kretprobes there on the
trampoline, each with the jump_reach check and address in `check`; the
function near the new code is jump-optimized; the start-up stub reaches the
program's entry through a veneer (adrp, add, br x16)."""
from __future__ import annotations

from conftest import cc, check_lines, function, instrument, profile, run, write_spec

ARCHES = ["aarch64"]

PROGRAM = r"""
#include <stdio.h>
__attribute__((noinline)) int low_fn(int a) { return a * 3 + 1; }
__attribute__((noinline, section(".fartext"))) int high_fn(int a) { return low_fn(a) + 1000; }
int main(void)
{
    long t = 0;
    for (int i = 0; i < 4; i++) t += high_fn(i) + low_fn(i);
    printf("t %ld\n", t);
    return 0;
}
"""

HANDLERS = r"""
#include <linux/kprobes.h>
int pre(struct kprobe *p, struct pt_regs *regs)
{
    if (regs->pc != (unsigned long)p->addr)
        pr_err("BAD pre pc %s\n", p->symbol_name);
    return 0;
}
int ret_handler(struct kretprobe_instance *ri, struct pt_regs *regs)
{
    pr_info("ret %s = %ld\n", ri->rp->kp.symbol_name, (long)regs_return_value(regs));
    return 0;
}
"""

SPEC = "".join(f'[[kprobe]]\nsymbol_name = "{f}"\npre_handler = "pre"\n'
               f'[[kretprobe]]\nsymbol_name = "{f}"\nhandler = "ret_handler"\n' for f in ("low_fn", "high_fn"))


def test_far_code_falls_back_to_breakpoints(tmp_path):
    prog = cc(tmp_path, "far", PROGRAM, "-O2", "-no-pie", "-Wl,--section-start=.fartext=0x10000000")
    want = run(prog, runner="qemu")
    assert want.returncode == 0 and want.stdout == "t 4044\n", want.stdout + want.stderr
    spec = write_spec(tmp_path, 'handlers = ["handlers.c"]\n' + SPEC, HANDLERS)
    low, _ = function(prog, "low_fn")
    plan = {l.split("  ")[0] + l.split("  ")[1]: l for l in check_lines(prog, spec)}
    assert f"int3  jump_reach at {low:#x}" in plan["low_fn+0x0k"] and "128 MiB" in plan["low_fn+0x0k"], plan
    assert "returns: trampoline  jump_reach" in plan["low_fn+0x0r"], plan
    assert plan["high_fn+0x0k"].split("  ")[2] == "optimized", plan
    assert "returns: trampoline" not in plan["high_fn+0x0r"], plan
    out = instrument(prog, spec, tmp_path / "far.kp")
    r = run(out, runner="qemu", env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == want.stdout, r.stdout + r.stderr
    assert "BAD" not in r.stderr, r.stderr
    prof = profile(r.stderr)
    assert prof["p_low_fn_0"][0] == 8 and prof["p_high_fn_0"][0] == 4, r.stderr
    rets = [l for l in r.stderr.splitlines() if l.startswith("ret ")]
    want_rets = []
    for i in range(4):
        want_rets += [f"ret low_fn = {3 * i + 1}", f"ret high_fn = {3 * i + 1001}", f"ret low_fn = {3 * i + 1}"]
    assert rets == want_rets, r.stderr
