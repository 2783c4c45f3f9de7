"""Programs that handle SIGTRAP themselves while a rewritten object has breakpoint probes
(issue 41, section 3).  The runtime keeps the SIGTRAP handler its probes need and chains
the program's own to it: sigaction/signal on SIGTRAP are recorded (the program's
traps, raise(SIGTRAP) and its own int3, still reach its handler), and masks lose the
SIGTRAP bit (blocked, an int3 would kill the process).  Each way the program's call
can reach the kernel is tested:

- through the GOT of the executable, when only a library is rewritten (the runtime
  hooks every loaded object's GOT, lazily bound or not, and dlopen()ed ones);
- inside a C library that is itself rewritten, or linked into a static program (the
  rt_sigaction/rt_sigprocmask system calls go through the runtime);
- a raw rt_sigaction system call in an object that is not rewritten: not intercepted,
  but said at exit, on stderr and in the profile.

In each, the output and exit status are the original's and the probe's count exact
(3), or, for the raw call, the line is there."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import ALL_ARCHES, ARCH, CROSS, cc, instrument, profile, qemu_command, write_spec

# The library cases run on every architecture (cross-built: under qemu-<arch>); the rest
# are x86-64's: its own int3, the system call stubs (a static program, a rewritten libc).
ARCHES = ALL_ARCHES
x86_only = pytest.mark.skipif(ARCH != "x86_64", reason="x86-64's system call stubs")

LINE = ("kprewrite: the program replaced the SIGTRAP handler of the breakpoint probes "
        "(a sigaction the runtime did not see): their traps went to its handler")

LIBS = "int add(int a, int b) { return a + b; }\n"
INSTALL = r"""
#include <signal.h>
#include <string.h>
void install(void (*h)(int)) { struct sigaction sa; memset(&sa, 0, sizeof sa); sa.sa_handler = h; sigaction(SIGTRAP, &sa, 0); }
"""
MAIN = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int add(int, int);
static volatile int traps;
static void on_trap(int sig) { (void)sig; traps++; }
struct ksa { void *h; unsigned long flags; void *restorer; unsigned long mask; };
int main(int argc, char **argv) {
  const char *m = argc > 1 ? argv[1] : "sigaction";
  if (!strcmp(m, "sigaction") || !strcmp(m, "int3")) {
    struct sigaction sa; memset(&sa, 0, sizeof sa); sa.sa_handler = on_trap;
    sigaction(SIGTRAP, &sa, 0);
  } else if (!strcmp(m, "signal")) {
    signal(SIGTRAP, on_trap);
  } else if (!strcmp(m, "block")) {
    sigset_t all; sigfillset(&all); sigprocmask(SIG_BLOCK, &all, 0);
  } else if (!strcmp(m, "raw")) {
    struct sigaction sa, cur; memset(&sa, 0, sizeof sa); sa.sa_handler = on_trap;
    sigaction(SIGUSR1, &sa, 0);
    sigaction(SIGUSR1, 0, &cur);          /* libc's restorer, borrowed */
    struct ksa k = { (void *)on_trap, 0x04000000 /* SA_RESTORER */, (void *)cur.sa_restorer, 0 };
    syscall(SYS_rt_sigaction, SIGTRAP, &k, 0, 8);
  } else if (!strcmp(m, "vfork")) {      /* a child sharing our memory resets SIGTRAP, then leaves */
    struct sigaction sa; memset(&sa, 0, sizeof sa); sa.sa_handler = on_trap;
    sigaction(SIGTRAP, &sa, 0);
    if (vfork() == 0) { signal(SIGTRAP, SIG_DFL); _exit(0); }
  } else if (!strcmp(m, "dlopen")) {
    void *h = dlopen(argv[2], RTLD_NOW);
    ((void (*)(void (*)(int)))dlsym(h, "install"))(on_trap);
  }
  if (strcmp(m, "block")) raise(SIGTRAP);
#ifdef __x86_64__
  if (!strcmp(m, "int3")) __asm__ volatile("int3");
#endif
  int s = 0;
  for (int i = 1; i <= 3; i++) s = add(s, i);
  printf("s=%d traps=%d\n", s, traps);
  return 0;
}
"""
EXPECTED = {"sigaction": "s=6 traps=1\n", "signal": "s=6 traps=1\n", "block": "s=6 traps=0\n",
            "int3": "s=6 traps=2\n", "dlopen": "s=6 traps=1\n", "raw": "s=6 traps=1\n", "vfork": "s=6 traps=1\n"}
SPEC = '[[kprobe]]\nsymbol_name = "add"\n'


def _run(cmd, env=None, libdir=None):
    e = {**os.environ, **(env or {})}
    if libdir is not None:
        e["LD_LIBRARY_PATH"] = str(libdir)
    prefix = qemu_command() if CROSS else []
    return subprocess.run([*prefix, *map(str, cmd)], capture_output=True, text=True, env=e, timeout=60)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """libs.so (add) and its rewrite with a breakpoint probe on add; the program linked
    lazily and with -z now; inst.so, which a dlopen() brings in to install a handler."""
    tmp = tmp_path_factory.mktemp("sigtrap")
    (tmp / "orig").mkdir()
    (tmp / "new").mkdir()
    lib = cc(tmp / "orig", "libs.so", LIBS, "-O2", "-shared", "-fPIC")
    inst = cc(tmp, "inst.so", INSTALL, "-O2", "-shared", "-fPIC")
    progs = {how: cc(tmp, f"main_{how}", MAIN, "-O2", f"-L{tmp / 'orig'}", "-l:libs.so", "-ldl", *flags)
             for how, flags in (("lazy", ["-Wl,-z,lazy"]), ("now", ["-Wl,-z,now,-z,relro"]))}
    instrument(lib, write_spec(tmp, SPEC), tmp / "new" / "libs.so", "--no-optimize")
    return tmp, progs, inst


@pytest.mark.parametrize("binding", ["lazy", "now"])
@pytest.mark.parametrize("mode", ["sigaction", "signal", "block", "int3", "dlopen", "vfork"])
def test_library_probe_and_program_handler(built, mode, binding):
    if mode == "int3" and ARCH != "x86_64":
        pytest.skip("the program's own trap is x86-64's int3")
    """Only the library is rewritten; the program's sigaction/signal(SIGTRAP) (through
    its own GOT, or an object it dlopen()s; a vfork() child's, which shares the
    parent's memory, leaves the parent's alone), its blocking of every signal, its own int3:
    the program's handler sees its own traps, the probe fires 3 times, output and exit
    status are the original's."""
    tmp, progs, inst = built
    args = [progs[binding], mode] + ([inst] if mode == "dlopen" else [])
    a = _run(args, libdir=tmp / "orig")
    assert (a.returncode, a.stdout) == (0, EXPECTED[mode])
    b = _run(args, libdir=tmp / "new", env={"KPREWRITE_PROFILE": "-"})
    assert (b.returncode, b.stdout) == (0, EXPECTED[mode]), b.stderr
    assert profile(b.stderr) == {"p_add_0": (3, 0)} and LINE not in b.stderr, b.stderr


@x86_only
def test_raw_system_call_is_said(built, tmp_path):
    """A raw rt_sigaction(SIGTRAP) in the (not rewritten) executable replaces the handler
    behind the runtime's back: one line on stderr at exit, and the same line in the
    profile file after the rows."""
    tmp, progs, _ = built
    prof = tmp_path / "profile"
    b = _run([progs["now"], "raw"], libdir=tmp / "new", env={"KPREWRITE_PROFILE": str(prof)})
    assert b.returncode == 0
    assert b.stderr.splitlines() == [LINE], b.stderr
    rows = prof.read_text().splitlines()
    assert rows[-1] == LINE and profile("\n".join(rows[:-1]))["p_add_0"][0] < 3, rows


STATIC = MAIN.replace("int add(int, int);", "__attribute__((noinline)) int add(int a, int b) { return a + b; }")


@x86_only
@pytest.mark.parametrize("mode", ["sigaction", "signal", "block", "int3", "vfork"])
def test_static_program(tmp_path, mode):
    """A static program with a breakpoint probe: its sigaction, signal and sigprocmask are
    its own libc's, no GOT to hook; their system calls go to the runtime."""
    prog = cc(tmp_path, "static", STATIC, "-O2", "-static", skip_without_static=True)
    new = instrument(prog, write_spec(tmp_path, SPEC), tmp_path / "static.kp", "--no-optimize")
    b = _run([new, mode], env={"KPREWRITE_PROFILE": "-"})
    assert (b.returncode, b.stdout) == (0, EXPECTED[mode]), b.stderr
    assert profile(b.stderr) == {"p_add_0": (3, 0)}, b.stderr


LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")
PUTS = r"""
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
static volatile int traps;
static void on_trap(int sig) { (void)sig; traps++; }
struct ksa { void *h; unsigned long flags; void *restorer; unsigned long mask; };
int main(int argc, char **argv) {
  struct sigaction sa, old; memset(&sa, 0, sizeof sa); sa.sa_handler = on_trap;
  if (argc > 1) {      /* through syscall(2): libc's wrapper, the number in a register */
    sigaction(SIGUSR1, &sa, 0);
    sigaction(SIGUSR1, 0, &old);
    struct ksa k = { (void *)on_trap, 0x04000000 /* SA_RESTORER */, (void *)old.sa_restorer, 0 };
    syscall(SYS_rt_sigaction, SIGTRAP, &k, 0, 8);
  } else
    sigaction(SIGTRAP, &sa, 0);
  raise(SIGTRAP);
  __asm__ volatile("int3");
  sigaction(SIGTRAP, 0, &old);
  sigset_t all; sigfillset(&all); sigprocmask(SIG_BLOCK, &all, 0);
  puts("one"); puts("two"); puts("three");
  printf("traps=%d own=%d\n", traps, old.sa_handler == on_trap);
  return 0;
}
"""


@pytest.fixture(scope="module")
def libc_puts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("libc_puts")
    (tmp / "lib").mkdir()
    from conftest import kprewrite
    kprewrite("instrument", LIBC, "--spec", write_spec(tmp, '[[kprobe]]\nsymbol_name = "puts"\n'),
              "-o", tmp / "lib" / "libc.so.6", "--no-optimize", "-q")
    return tmp / "lib"


@x86_only
@pytest.mark.skipif(not LIBC.exists(), reason="no Debian x86-64 libc.so.6")
@pytest.mark.parametrize("how", ["sigaction", "syscall"])
def test_rewritten_libc(tmp_path, libc_puts, how):
    """libc.so.6 with a breakpoint probe on puts: the program's sigaction(SIGTRAP) (or
    its rt_sigaction through syscall(2)) and its blocking of every signal are libc's
    own system calls, sent to the runtime."""
    prog = cc(tmp_path, "puts", PUTS, "-O2", "-fno-builtin")
    args = [prog] + (["raw"] if how == "syscall" else [])
    a = _run(args)
    assert a.stdout == "one\ntwo\nthree\ntraps=2 own=1\n"
    b = _run(args, libdir=libc_puts, env={"KPREWRITE_PROFILE": "-"})
    assert (b.returncode, b.stdout) == (0, a.stdout), b.stderr
    assert profile(b.stderr) == {"p_puts_0": (3, 0)} and LINE not in b.stderr, b.stderr
