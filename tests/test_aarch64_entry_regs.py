"""AArch64's templates at a function's entry use x16 and x17 (IP0/IP1, which a veneer
or PLT may write between any call and its target) without saving them
(rewriter/arch/aarch64/optprobe.red_zone_free_at(), the `red_zone` rule's AArch64
half); anywhere else, and in a function that reads them at its entry (ld.so's lazy
binding gets x16 from PLT0), they are saved.  Each program's sum is asserted under
qemu-aarch64, with several threads hitting the probes at once, and the hits exactly."""
from __future__ import annotations

import subprocess

import pytest

from conftest import KPREWRITE, TREE_ENV, cc, instrument, profile, run, write_spec

ARCHES = ["aarch64"]

# keep16: x16 live across +4 (a probe mid-function); reads16: reads x16 at its entry, as
# _dl_runtime_resolve does, set by its caller; plain: an ordinary C entry (x16/x17 free).
PROG = r"""
#include <pthread.h>
#include <stdio.h>
__asm__(".text\n.globl keep16\n.type keep16,%function\nkeep16:\n"
        "  mov x16, x0\n  add x0, x0, #1\n  add x0, x0, x16\n  ret\n.size keep16,.-keep16\n"
        ".globl reads16\n.type reads16,%function\nreads16:\n"
        "  add x0, x0, x16\n  ret\n.size reads16,.-reads16\n");
long keep16(long);
__attribute__((noinline)) long plain(long x, long y) { __asm__ volatile("" : "+r"(x)); return x * 3 + y; }
static long call_reads16(long x)
{
	register long x0 __asm__("x0") = x;
	register long x16 __asm__("x16") = 1000;
	__asm__ volatile("bl reads16" : "+r"(x0) : "r"(x16) : "x30", "memory");
	return x0;
}
#define N 2000
static void *work(void *arg)
{
	long s = 0;
	for (long i = 0; i < N; i++)
		s += keep16(i) + call_reads16(i) + plain(i, 7);
	return (void *)s;
}
int main(void)
{
	pthread_t t[4];
	long s = 0;
	for (int i = 0; i < 4; i++)
		pthread_create(&t[i], 0, work, 0);
	for (int i = 0; i < 4; i++) {
		void *r;
		pthread_join(t[i], &r);
		s += (long)r;
	}
	printf("%ld\n", s);
	return 0;
}
"""

HANDLERS = r"""
#include <kprewrite/kprobes.h>
long seen;
int pre(struct kprobe *p, struct pt_regs *regs) { return 0; }
int pre_regs(struct kprobe *p, struct pt_regs *regs) { __atomic_fetch_add(&seen, regs->regs[0] >= 0, __ATOMIC_RELAXED); return 0; }
"""

LIGHT = """[[kprobe]]\nsymbol_name = "keep16"\noffset = 4\n[[kprobe]]\nsymbol_name = "reads16"\n
[[kprobe]]\nsymbol_name = "plain"\n"""
CLEAN = 'handlers = ["handlers.c"]\n' + LIGHT.replace('offset = 4\n', 'offset = 4\npre_handler = "pre"\n') \
    .replace('"reads16"\n', '"reads16"\npre_handler = "pre_regs"\n').replace('"plain"\n', '"plain"\npre_handler = "pre"\n')


def _build(tmp_path, spec_text, name, off=None):
    prog = cc(tmp_path, "prog", PROG, "-O2", "-pthread")
    spec = write_spec(tmp_path, spec_text, HANDLERS, name=f"{name}.toml")
    if off is None:
        return prog, instrument(prog, spec, tmp_path / name)
    out = tmp_path / f"{name}.off"
    env = {**TREE_ENV, "KPREWRITE_TEST_SUITE": "1", "KPREWRITE_UNSAFE_OFF": off}
    r = subprocess.run([*KPREWRITE, "instrument", str(prog), "--spec", str(spec), "-o", str(out)],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    return prog, out


def _check(prog, new):
    want = run(prog, runner="qemu")
    assert want.returncode == 0 and want.stdout.strip()
    got = run(new, runner="qemu", env={"KPREWRITE_PROFILE": "-"})
    assert (got.returncode, got.stdout) == (0, want.stdout), got.stderr
    prof = profile(got.stderr)
    assert prof == {"p_keep16_4": (8000, 0), "p_reads16_0": (8000, 0), "p_plain_0": (8000, 0)}, prof


def test_light_and_clean_at_entries_and_mid_function(tmp_path):
    """Light hits (no handler anywhere) and templates (clean; a partial pt_regs for
    reads16's): x16 is live mid-function in keep16 and an input of reads16."""
    for name, text in (("light", LIGHT), ("clean", CLEAN)):
        prog, new = _build(tmp_path, text, name)
        _check(prog, new)


def test_red_zone_off_clobbers_x16(tmp_path):
    """With the rule off every site is taken for an entry: keep16's live x16 is
    the detour's scratch, and the sum changes."""
    for name, text in (("light", LIGHT), ("clean", CLEAN)):
        prog, new = _build(tmp_path, text, name, off="red_zone")
        want = run(prog, runner="qemu")
        got = run(new, runner="qemu")
        assert (got.returncode, got.stdout) != (want.returncode, want.stdout), name


DISABLE = r"""
#include <stdio.h>
__attribute__((noinline)) long plain(long x, long y) { __asm__ volatile("" : "+r"(x)); return x * 3 + y; }
int main(void)
{
	long s = 0;
	for (long i = 0; i < 1000; i++)
		s += plain(i, 7);
	printf("%ld\n", s);
	return 0;
}
"""
DISABLE_HANDLERS = r"""
#include <kprewrite/kprobes.h>
static int n;
int pre(struct kprobe *p, struct pt_regs *regs) { if (++n == 100) disable_kprobe(p); return 0; }
int pre_regs(struct kprobe *p, struct pt_regs *regs) { if ((n += regs->regs[1] == 7) == 100) disable_kprobe(p); return 0; }
"""


# 3 MiB of handler data between the detours and the runtime's: kp_fast, the thread table
# and the probe lie beyond an adr's or ldr literal's 1 MiB, so the templates take their
# far stubs (emit._Near).
BIG = "char big[3 << 20] = {1};\n"


@pytest.mark.parametrize("far", [False, True], ids=["near", "far"])
def test_disabled_by_its_handler(tmp_path, far):
    """A probe its handler disables (the template's flags test, one branch with the
    reentry test to the C dispatch) is silent from then on: 100 hits, none missed;
    with the runtime's data near the detours and far from them."""
    prog = cc(tmp_path, "prog", DISABLE, "-O2")
    want = run(prog, runner="qemu")
    for h in ("pre", "pre_regs"):
        spec = write_spec(tmp_path, f'handlers = ["handlers.c"]\n[[kprobe]]\nsymbol_name = "plain"\n'
                                    f'pre_handler = "{h}"\n', DISABLE_HANDLERS + (BIG if far else ""),
                          name=f"{h}.toml")
        new = instrument(prog, spec, tmp_path / h)
        got = run(new, runner="qemu", env={"KPREWRITE_PROFILE": "-"})
        assert (got.returncode, got.stdout) == (0, want.stdout), got.stderr
        assert profile(got.stderr) == {"p_plain_0": (100, 0)}, got.stderr


LOOP = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) long plain(long x, long y) { __asm__ volatile("" : "+r"(x)); return x * 3 + y; }
int main(int argc, char **argv)
{
	long s = 0, n = atol(argv[1]);
	for (long i = 0; i < n; i++)
		s += plain(i, 7);
	printf("%ld\n", s);
	return 0;
}
"""
LOOP_HANDLERS = r"""
#include <kprewrite/kprobes.h>
long seen;
int pre(struct kprobe *p, struct pt_regs *regs) { return 0; }
int pre_regs(struct kprobe *p, struct pt_regs *regs) { seen += regs->regs[1]; return 0; }
"""


def _executed(binary, n: int, log) -> tuple[int, str]:
    """Instructions qemu-aarch64 executed running `binary n` (-singlestep -d exec: one
    Trace line each, as benchmarks/insn_count.py counts), and what it printed."""
    r = run(binary, n, runner="qemu", env={"QEMU_LOG": "exec,nochain", "QEMU_LOG_FILENAME": str(log),
                                           "QEMU_SINGLESTEP": "1"})
    assert r.returncode == 0, r.stderr
    with open(log, "rb") as f:
        count = sum(1 for line in f if line.startswith(b"Trace "))
    log.unlink()
    return count, r.stdout


@pytest.mark.parametrize("far", [False, True], ids=["near", "far"])
def test_templates_take_their_fast_path(tmp_path, far):
    """The inlined dispatch, not the C one, counts each hit whether the runtime's data
    lie within 1 MiB of the detours or beyond (the far stubs): under 50 executed
    instructions a hit (the C dispatch's path takes over 100)."""
    prog = cc(tmp_path, "loop", LOOP, "-O2")
    o1, oo1 = _executed(prog, 200, tmp_path / "log")
    o2, oo2 = _executed(prog, 1200, tmp_path / "log")
    for h in ("pre", "pre_regs"):
        spec = write_spec(tmp_path, f'handlers = ["handlers.c"]\n[[kprobe]]\nsymbol_name = "plain"\n'
                                    f'pre_handler = "{h}"\n', LOOP_HANDLERS + (BIG if far else ""), name=f"{h}.toml")
        new = instrument(prog, spec, tmp_path / h)
        r1, ro1 = _executed(new, 200, tmp_path / "log")
        r2, ro2 = _executed(new, 1200, tmp_path / "log")
        assert (ro1, ro2) == (oo1, oo2)
        per_hit = ((r2 - r1) - (o2 - o1)) / 1000
        assert per_hit < 50, (h, per_hit)
