"""AArch64's light hits and light kretprobes choose their increment at start-up, as the
kernel's alternatives do: a light detour is written with an LDXR/STXR loop (ARMv8.0),
and where AT_HWCAP has HWCAP_ATOMICS the runtime rewrites two of its words into
`cbz` and `stadd` (runtime/arch/aarch64/linux_user/kp_alternatives.c,
emit.light_detour()).  Each program runs under `QEMU_CPU=max` (LSE atomics: the
rewritten words) and `QEMU_CPU=cortex-a72` (none: the words as written), four threads
hitting an entry probe, a mid-function probe (x0-x2 saved) and a kretprobe at once, the
hits counted exactly, with the runtime's data near the detours and beyond 1 MiB (the far
stubs); the executed instructions a hit are 8 with LSE and 13 without
(benchmarks/insn_count.py's count), so a patch that is not applied, or applied where it
must not be, fails; the output is the same bytes rewritten twice; and the running
program, patched, maps no page writable and executable, and a BTI-guarded image's
rewritten pages stay guarded."""
from __future__ import annotations

import pytest

from conftest import cc, instrument, profile, run, write_spec

ARCHES = ["aarch64"]

CPUS = ["max", "cortex-a72"]        # LSE atomics (ARMv8.1+), none (ARMv8.0)

PROG = r"""
#include <pthread.h>
#include <stdio.h>
__asm__(".text\n.globl keep16\n.type keep16,%function\nkeep16:\n"
        "  mov x16, x0\n  add x0, x0, #1\n  add x0, x0, x16\n  ret\n.size keep16,.-keep16\n");
long keep16(long);
__attribute__((noinline)) long plain(long x, long y) { __asm__ volatile("" : "+r"(x)); return x * 3 + y; }
__attribute__((noinline)) long twice(long x) { __asm__ volatile("" : "+r"(x)); return 2 * x; }
#define N 3000
static void *work(void *arg)
{
	long s = 0;
	for (long i = 0; i < N; i++)
		s += keep16(i) + plain(i, 7) + twice(i);
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

# No handler anywhere: every probe is light (keep16+4 mid-function: x16 is live there).
SPEC = """[[kprobe]]\nsymbol_name = "keep16"\noffset = 4\n[[kprobe]]\nsymbol_name = "plain"\n
[[kretprobe]]\nsymbol_name = "twice"\n"""
# 3 MiB of data between the detours and the runtime's: kp_fast and the counters lie
# beyond an adr's or ldr literal's 1 MiB (emit._Near's far stubs).
BIG = "char big[3 << 20] = {1};\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lse")
    prog = cc(tmp, "prog", PROG, "-O2", "-pthread")
    out = {}
    for far in (False, True):
        spec = write_spec(tmp, ('handlers = ["handlers.c"]\n' if far else "") + SPEC, BIG if far else None,
                          name=f"far{far}.toml")
        out[far] = instrument(prog, spec, tmp / f"prog.far{far}")
        if not far:
            again = instrument(prog, spec, tmp / "prog.again")
            assert again.read_bytes() == out[far].read_bytes()      # patched at run time only
    return prog, out


@pytest.mark.parametrize("far", [False, True], ids=["near", "far"])
@pytest.mark.parametrize("cpu", CPUS)
def test_light_counts_exact_across_threads(built, cpu, far):
    prog, out = built
    want = run(prog, runner="qemu", env={"QEMU_CPU": cpu})
    assert want.returncode == 0 and want.stdout.strip()
    got = run(out[far], runner="qemu", env={"QEMU_CPU": cpu, "KPREWRITE_PROFILE": "-"})
    assert (got.returncode, got.stdout) == (0, want.stdout), got.stderr
    assert profile(got.stderr) == {"p_keep16_4": (12000, 0), "p_plain_0": (12000, 0), "r_twice_0": (12000, 0)}, \
        got.stderr


# 150 probed functions before `target`: its detour lies pages after the first, which the
# runtime rewrites too.
FILLERS = "".join(f'__attribute__((noinline)) long f{i}(long x) {{ __asm__ volatile("" : "+r"(x)); return x + {i}; }}\n'
                  for i in range(150))
LOOP = r"""
#include <stdio.h>
#include <stdlib.h>
""" + FILLERS + r"""
__attribute__((noinline)) long target(long x) { __asm__ volatile("" : "+r"(x)); return x + 1; }
int main(int argc, char **argv)
{
	long n = atol(argv[1]), s = 0;
	for (long i = 0; i < n; i++)
		s += target(i);
	printf("%ld\n", s);
	return 0;
}
"""


def _executed(binary, n: int, log, cpu: str) -> tuple[int, str]:
    """Instructions qemu-aarch64 executed running `binary n` (-singlestep -d exec: one
    Trace line each, as benchmarks/insn_count.py counts), and what it printed."""
    r = run(binary, n, runner="qemu", env={"QEMU_LOG": "exec,nochain", "QEMU_LOG_FILENAME": str(log),
                                           "QEMU_SINGLESTEP": "1", "QEMU_CPU": cpu})
    assert r.returncode == 0, r.stderr
    with open(log, "rb") as f:
        count = sum(1 for line in f if line.startswith(b"Trace "))
    log.unlink()
    return count, r.stdout


@pytest.mark.parametrize("cpu,want", [("max", 8), ("cortex-a72", 13)])
def test_light_instructions_a_hit(tmp_path, cpu, want):
    """benchmarks/insn_count.py's light and kret rows: 8 executed instructions a hit
    with LSE atomics (stadd), 13 without (the LDXR/STXR loop and its saved register), at
    a detour pages after the first (151 light sites)."""
    prog = cc(tmp_path, "loop", LOOP, "-O2")
    o1, oo1 = _executed(prog, 200, tmp_path / "log", cpu)
    o2, oo2 = _executed(prog, 1200, tmp_path / "log", cpu)
    for kind in ("kprobe", "kretprobe"):
        spec = write_spec(tmp_path, "".join(f'[[{kind}]]\nsymbol_name = "{f}"\n'
                                            for f in [f"f{i}" for i in range(150)] + ["target"]),
                          name=f"{kind}.toml")
        new = instrument(prog, spec, tmp_path / kind)
        r1, ro1 = _executed(new, 200, tmp_path / "log", cpu)
        r2, ro2 = _executed(new, 1200, tmp_path / "log", cpu)
        assert (ro1, ro2) == (oo1, oo2)
        # The C library's printf of a longer sum takes a path that depends a little on
        # where the stack lies (the program's name): a few dozen instructions in all.
        per_hit = ((r2 - r1) - (o2 - o1)) / 1000
        assert abs(per_hit - want) < 0.05, (kind, cpu, per_hit)


MAPS = r"""
#include <stdio.h>
#include <string.h>
__attribute__((noinline)) long plain(long x) { __asm__ volatile("" : "+r"(x)); return x * 3; }
int main(void)
{
	long s = 0;
	for (long i = 0; i < 100; i++)
		s += plain(i);
	char line[512];
	FILE *f = fopen("/proc/self/maps", "r");
	while (f && fgets(line, sizeof(line), f))
		if (strstr(line, " rwx") || strstr(line, " -wx"))
			printf("wx: %s", line);
	printf("%ld\n", s);
	return 0;
}
"""


@pytest.mark.parametrize("cpu", CPUS)
def test_patched_program_maps_no_wx_page(tmp_path, cpu):
    """The pages the runtime rewrote (a copy moved over each with mremap) are read-only
    and executable, as every other page of code: none is writable and executable."""
    prog = cc(tmp_path, "maps", MAPS, "-O2")
    new = instrument(prog, write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "plain"\n'), tmp_path / "maps.kp")
    r = run(new, runner="qemu", env={"QEMU_CPU": cpu, "KPREWRITE_PROFILE": "-"})
    assert (r.returncode, r.stdout) == (0, "14850\n"), (r.stdout, r.stderr)
    assert profile(r.stderr) == {"p_plain_0": (100, 0)}, r.stderr


# Freestanding (Debian's crt files carry no BTI note): `leaf` is light-probed; then the
# program branches through a register to its detour's first word, no landing pad, which
# a BTI-guarded page refuses with SIGILL.
BTI_PROGRAM = r"""
static long sys3(long n, long a, long b, long c) {
    register long x8 __asm__("x8") = n, x0 __asm__("x0") = a, x1 __asm__("x1") = b, x2 __asm__("x2") = c;
    __asm__ volatile("svc #0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2) : "memory");
    return x0;
}
__attribute__((noinline)) long leaf(long a) { __asm__ volatile("" : "+r"(a)); return a * 3; }
void _start(void) {
    long t = 0;
    for (int i = 0; i < 10; i++) t += leaf(i);
    const unsigned int *w = (const unsigned int *)leaf;
    if (*w == 0xd503245f)       /* bti c: the probe is on the next word */
        w++;
    if ((*w & 0xfc000000u) != 0x14000000u)
        sys3(93, 3, 0, 0);      /* not a B: not jump-optimized */
    long target = (long)w + ((long)((int)(*w << 6)) >> 4);
    long (*detour)(long) = (long (*)(long))target;
    t += detour(1);
    sys3(64, 1, (long)"unguarded\n", 10);
    sys3(93, t == 135 + 3 ? 0 : 4, 0, 0);
}
"""


def test_patched_pages_stay_bti_guarded(tmp_path):
    """Under `max` (LSE and BTI) the pages rewritten at start-up are guarded as the
    loader guarded them (PROT_BTI on the copy): the branch to a detour's first word,
    no landing pad, raises SIGILL; under `cortex-a72` (no BTI) it runs."""
    prog = cc(tmp_path, "bti", BTI_PROGRAM, "-O2", "-static", "-nostdlib", "-mbranch-protection=bti",
              "-Wl,-z,force-bti")
    new = instrument(prog, write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "leaf"\n'), tmp_path / "bti.kp")
    r = run(new, runner="qemu", env={"QEMU_CPU": "cortex-a72"})
    assert (r.returncode, r.stdout) == (0, "unguarded\n"), r.stderr
    r = run(new, runner="qemu", env={"QEMU_CPU": "max"})
    assert r.returncode == -4 and "unguarded" not in r.stdout, (r.returncode, r.stdout, r.stderr)
