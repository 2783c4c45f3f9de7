"""Light hits (planner.forms.choose_forms()'s Site.light, emit.light_detour):
in an image with no handler at all, a jump-optimized probe only counts its hit,
in sharded counters bumped with a locked increment, and at a function entry
keeps its one saved register in the red zone instead of moving %rsp.

The program runs four threads through three probed functions at once (the
counts must stay exact), a signal handler that calls one of them, a profiling
timer's signals all along (their frames must not land in the red zone where an
entry's detour keeps %rax: `rax_in` reads %rax at its entry), and a probe
inside a function where %rax and the flags are live across the probe (the
light detour must keep both).  Hit counts are asserted exactly, natively and
under QEMU; KPREWRITE_ENABLED=0 disarms them; one handler anywhere in the spec
turns the light form off.  A static build probes glibc's start-up functions,
which run before the thread pointer exists (the slow path through C), and must
count what the same probes count as breakpoints."""
from __future__ import annotations

import capstone
import pytest

from conftest import cc, instrument, meta, profile, read_at, run, write_spec

ARCHES = ["x86_64"]      # x86-64 only: x86-64 assembly; AArch64's light hits: test_aarch64_forms.py

PROGRAM = r"""
/* flagsy(a, b): (2a + 1) if a < b, else -(2a + 1): %rax and the flags of the cmp
   are live across the two leas at flagsy+6 (the probe there is no entry). */
__asm__(
".text\n"
".globl flagsy\n.type flagsy,@function\nflagsy:\n"
"  mov %rdi,%rax\n"
"  cmp %rsi,%rdi\n"
"  lea (%rax,%rax),%rax\n"
"  lea 1(%rax),%rax\n"
"  jl 1f\n"
"  neg %rax\n"
"1: ret\n"
".size flagsy,.-flagsy\n"
/* rax_in reads %rax at its entry, where the light detour keeps %rax in the red zone. */
".globl rax_in\n.type rax_in,@function\nrax_in:\n"
"  lea 1(%rax),%rax\n"
"  ret\n"
".size rax_in,.-rax_in\n"
".globl call_rax_in\n.type call_rax_in,@function\ncall_rax_in:\n"
"  mov %rdi,%rax\n"
"  call rax_in\n"
"  ret\n"
".size call_rax_in,.-call_rax_in\n"
/* A .cold part is jumped into with its function's frame (and red zone) live. */
".globl call_cold\n.type call_cold,@function\ncall_cold:\n"
"  mov %rdi,%rax\n"
"  call cold_part.cold\n"
"  ret\n"
".size call_cold,.-call_cold\n"
".type cold_part.cold,@function\ncold_part.cold:\n"
"  lea 2(%rax),%rax\n"
"  ret\n"
".size cold_part.cold,.-cold_part.cold\n"
);
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
long flagsy(long, long), call_rax_in(long), call_cold(long);
__attribute__((noinline)) long work(long x) { __asm__ volatile(""); return x * 3 + 1; }
static volatile long sig_total;
static void on_usr1(int sig) { sig_total += work(sig); }
/* Asynchronous signals all along: each frame is built below the red zone, never in it. */
static void on_prof(int sig)
{
    volatile char scratch[2048];
    memset((char *)scratch, sig, sizeof scratch);
}
static long n;
static void *thread(void *arg)
{
    long s = 0, id = (long)arg;
    for (long i = 0; i < n; i++)
        s += work(i) + flagsy(i % 7, id) + call_rax_in(i) + call_cold(i);
    return (void *)s;
}
int main(int argc, char **argv)
{
    n = atol(argv[1]);
    signal(SIGUSR1, on_usr1);
    signal(SIGPROF, on_prof);
    struct sigevent ev = { .sigev_notify = SIGEV_SIGNAL, .sigev_signo = SIGPROF };
    timer_t timer;
    struct itimerspec every = { { 0, 50000 }, { 0, 50000 } };
    timer_create(CLOCK_MONOTONIC, &ev, &timer);
    timer_settime(timer, 0, &every, 0);
    pthread_t t[4];
    for (long i = 0; i < 4; i++)
        pthread_create(&t[i], 0, thread, (void *)i);
    long total = 0;
    for (int i = 0; i < 4; i++) {
        void *r;
        pthread_join(t[i], &r);
        total += (long)r;
    }
    timer_delete(timer);
    for (int i = 0; i < 10; i++)
        raise(SIGUSR1);
    printf("%ld %ld\n", total, sig_total);
    return 0;
}
"""

SPEC = """[[kprobe]]
symbol_name = "work"
[[kprobe]]
symbol_name = "rax_in"
[[kprobe]]
symbol_name = "cold_part.cold"
name = "cold"
[[kprobe]]
symbol_name = "flagsy"
[[kprobe]]
symbol_name = "flagsy"
offset = 6
name = "flagsy_inside"
"""
# glibc's start-up in a static program: these run before its thread pointer is set.
STARTUP = "".join(f'[[kprobe]]\nsymbol_name = "{f}*"\n' for f in ("__libc_setup_tls", "_dl_aux_init",
                                                                    "_dl_relocate_static_pie", "__tunables_init"))
HANDLER = "#include <kprewrite/kprobes.h>\nint count(struct kprobe *p, struct pt_regs *regs) { return 0; }\n"
N = 20000


def _build(tmp, kind):
    prog = cc(tmp, f"light_{kind}", PROGRAM, "-O2", "-pthread", *(["-static"] if kind == "static" else []),
              skip_without_static=kind == "static")
    light = instrument(prog, write_spec(tmp, SPEC + (STARTUP if kind == "static" else ""), name="light.toml"),
                       tmp / "light")
    if kind == "static":        # the oracle: the same probes as breakpoints
        other = instrument(prog, write_spec(tmp, SPEC + STARTUP, name="int3.toml"), tmp / "int3", "--no-optimize")
    else:                       # one handler, on a probe of its own, turns the light form off
        other = instrument(prog, write_spec(tmp, 'handlers = ["handlers.c"]\n' + SPEC + '[[kprobe]]\nsymbol_name = "main"\n'
                                            'pre_handler = "count"\n', HANDLER, name="handler.toml"), tmp / "handler")
    return prog, light, other


@pytest.mark.parametrize("kind", ["pie", "static"])
def test_light_hits_exact_across_threads(once, runner, kind):
    prog, light, other = once(_build, kind)
    probes = {p["name"]: p for p in meta(light)["probes"]}
    for name in ("p_work_0", "p_flagsy_0", "flagsy_inside", "p_rax_in_0", "cold"):
        assert probes[name]["optimized"] and probes[name].get("light"), probes[name]
    want = run(prog, N, runner=runner)
    assert want.returncode == 0, want.stderr
    got = run(light, N, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert got.returncode == 0 and got.stdout == want.stdout, got.stdout + got.stderr[-2000:]
    hits = profile(got.stderr)
    assert hits["p_work_0"] == (4 * N + 10, 0) and hits["p_flagsy_0"] == (4 * N, 0), hits
    assert hits["flagsy_inside"] == hits["p_rax_in_0"] == hits["cold"] == (4 * N, 0), hits
    off = run(light, N, runner=runner, env={"KPREWRITE_PROFILE": "-", "KPREWRITE_ENABLED": "0"})
    assert off.returncode == 0 and off.stdout == want.stdout, off.stderr[-2000:]
    assert set(profile(off.stderr).values()) == {(0, 0)}, off.stderr
    ref = run(other, N, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert ref.returncode == 0 and ref.stdout == want.stdout, ref.stderr[-2000:]
    if kind == "static":
        # Start-up hits (before the thread pointer) take the slow path and still count.
        assert any(name.startswith("p___libc_setup_tls") for name in hits), hits
        assert hits == profile(ref.stderr), (hits, profile(ref.stderr))
    else:
        assert not any(p.get("light") for p in meta(other)["probes"]), meta(other)["probes"]
        assert {k: v for k, v in profile(ref.stderr).items() if k in hits} == hits


def test_light_detour_keeps_the_stack_pointer_at_an_entry(once):
    """At a function entry the detour saves %rax in the red zone: up to the copy
    of the probed instructions, no instruction writes %rsp; inside a function,
    and at the entry of a .cold part, it steps over the red zone first."""
    prog, light, _ = once(_build, "pie")
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True

    def fast_path(p):
        out = []
        for i in md.disasm(read_at(light, p["detour"], 96), p["detour"]):
            out.append(i)
            if i.mnemonic == "lock inc":
                return out
            if i.mnemonic == "inc" and i.prefix[0] == 0xF0:
                return out
        raise AssertionError(f"no locked increment in {[(i.mnemonic, i.op_str) for i in out]}")

    probes = {p["name"]: p for p in meta(light)["probes"]}
    entry = fast_path(probes["p_work_0"])
    assert (entry[0].mnemonic, entry[0].op_str) == ("mov", "qword ptr [rsp - 8], rax"), entry[0]
    writes_rsp = [i for i in entry if capstone.x86.X86_REG_RSP in i.regs_access()[1]]
    assert not writes_rsp, [(i.mnemonic, i.op_str) for i in writes_rsp]
    for name in ("flagsy_inside", "cold"):
        inside = fast_path(probes[name])
        assert (inside[0].mnemonic, inside[0].op_str) == ("lea", "rsp, [rsp - 0x90]"), (name, inside[0])
