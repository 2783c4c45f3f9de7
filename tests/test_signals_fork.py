"""Signals, fork, vfork+exec, sigaltstack, coroutines and threads in a program with a
kretprobe (and, separately, an INT3 kprobe) on every function:
the output equals the original's, and each function's return handler ran exactly as
often as it returned, per process.

- a probed signal handler interrupting a probed function (raise() inside it);
- fork() inside a return-probed function: the child returns through its own copy of the
  pending instances and writes its own profile (counters per process);
- vfork()+exec from a return-probed function;
- a SA_ONSTACK handler on a sigaltstack above the interrupted frames (a local array of
  main), calling return-probed functions while instances of the deeper frames are pending;
- a ucontext coroutine on a heap stack, suspended inside a return-probed function while
  the main stack calls return-probed functions;
- threads created and ending while probes fire.

Under qemu-x86_64 the sigaltstack part is left out: QEMU 7.2 crashes the original
program there too (SIGSEGV), so it tells nothing about the rewrite."""
from __future__ import annotations

import re

import pytest

from conftest import ALL_ARCHES, cc, instrument, profile, run, write_spec

ARCHES = ALL_ARCHES
CRT_EXIT = {"__do_global_dtors_aux", "deregister_tm_clones"}

PROGRAM = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <ucontext.h>
#include <unistd.h>

static volatile long acc;
__attribute__((noinline)) long leaf(long x) { acc += x; return x * 3 + 1; }
__attribute__((noinline)) void on_sig(int s) { acc += leaf(s); }
__attribute__((noinline)) void on_alt(int s) { volatile char b[256]; memset((void *)b, s, sizeof b); acc += leaf(b[3]); }
__attribute__((noinline)) long interrupted(long n) { long r = leaf(n); raise(SIGUSR1); return r + leaf(n + 1); }
__attribute__((noinline)) long on_alt_stack(long n) { long r = leaf(n); raise(SIGUSR2); return r + leaf(n + 1); }
__attribute__((noinline)) long deep(long n) { volatile long pad = n; return n ? deep(n - 1) + pad : on_alt_stack(5); }

__attribute__((noinline)) int forked(void) {
  fflush(stdout);
  pid_t p = fork();
  if (p == 0) { long r = leaf(7) + interrupted(3); printf("child %ld\n", r); exit(0); }
  int st; waitpid(p, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 100 + WTERMSIG(st);
}
__attribute__((noinline)) int vforked(void) {
  fflush(stdout);
  pid_t p = vfork();
  if (p == 0) { execl("/bin/echo", "echo", "exec'd", (char *)0); _exit(127); }
  int st; waitpid(p, &st, 0);
  return WEXITSTATUS(st);
}

static ucontext_t main_ctx, co_ctx;
__attribute__((noinline)) long co_step(long x) { long r = leaf(x); swapcontext(&co_ctx, &main_ctx); return r + leaf(x); }
__attribute__((noinline)) void co_body(void) { for (int i = 0; i < 3; i++) acc += co_step(i); }

__attribute__((noinline)) void *worker(void *a) { long t = 0; for (long i = 0; i < 2000; i++) t += leaf(i + (long)a); return (void *)t; }

int main(int argc, char **argv) {
  signal(SIGUSR1, on_sig);
  long t = 0;
  for (int i = 0; i < 10; i++) t += interrupted(i);
  printf("signals %ld\n", t);
  printf("fork %d\n", forked());
  printf("vfork %d\n", vforked());
  if (argc < 2) {
    char altstack[65536];
    stack_t ss = { .ss_sp = altstack, .ss_size = sizeof altstack };
    sigaltstack(&ss, 0);
    struct sigaction sa = { .sa_handler = on_alt, .sa_flags = SA_ONSTACK };
    sigaction(SIGUSR2, &sa, 0);
    t = 0;
    for (int i = 0; i < 5; i++) t += deep(4);
    printf("sigaltstack %ld\n", t);
    ss.ss_flags = SS_DISABLE;
    sigaltstack(&ss, 0);
  }
  getcontext(&co_ctx);
  co_ctx.uc_stack.ss_sp = malloc(1 << 16); co_ctx.uc_stack.ss_size = 1 << 16; co_ctx.uc_link = &main_ctx;
  makecontext(&co_ctx, co_body, 0);
  for (int i = 0; i < 4; i++) { swapcontext(&main_ctx, &co_ctx); acc += leaf(100 + i); }
  printf("coroutine %ld\n", acc);
  pthread_t ts[4];
  for (long i = 0; i < 4; i++) pthread_create(&ts[i], 0, worker, (void *)i);
  t = 0;
  for (int i = 0; i < 4; i++) { void *r; pthread_join(ts[i], &r); t += (long)r; }
  printf("threads %ld\n", t);
  return 0;
}
"""

# The kretprobe's trace line ("(CALLER <- FUNC) ret=...") is written by its return
# handler: the lines, per pid, count the return handlers that ran.
SPECS = {"kretprobe": '[[kretprobe]]\nsymbol_name = "*"\nfetch = "ret=$retval:s64"\n',
         "kprobe-int3": '[[kprobe]]\nsymbol_name = "*"\n'}


def _build(tmp, kind):
    prog = cc(tmp, "sigfork", PROGRAM, "-O2", "-pthread")
    extra = ["--no-optimize"] if kind == "kprobe-int3" else []
    return prog, instrument(prog, write_spec(tmp, SPECS[kind]), tmp / f"sigfork.{kind}", *extra)


def _profiles(text: str) -> list[dict]:
    """The profile file holds one block per process that exited (the child's first)."""
    blocks, cur = [], []
    for line in text.splitlines():
        if cur and line.split()[0] in ("p_main_0", "r_main_0") and any(l.split()[0] == line.split()[0] for l in cur):
            blocks.append(cur)
            cur = []
        cur.append(line)
    blocks.append(cur)
    return [profile("\n".join(b)) for b in blocks]


@pytest.mark.parametrize("kind", ["kretprobe", "kprobe-int3"])
def test_signals_fork_exec_altstack_coroutines_threads(once, runner, kind, tmp_path):
    prog, new = once(_build, kind)
    args = [] if runner == "native" else ["no-altstack"]
    a = run(prog, *args, runner=runner)
    prof, trace = tmp_path / "profile", tmp_path / "trace"
    b = run(new, *args, runner=runner, env={"KPREWRITE_PROFILE": str(prof), "KPREWRITE_TRACE": str(trace)})
    assert (b.returncode, b.stdout, b.stderr) == (a.returncode, a.stdout, a.stderr)
    assert "fork 0\n" in b.stdout and "exec'd\n" in b.stdout and "child " in b.stdout
    child, parent = _profiles(prof.read_text())
    p = "r" if kind == "kretprobe" else "p"
    hits = lambda prof, f: prof[f"{p}_{f}_0"][0]
    assert all(missed == 0 for _, missed in parent.values()), parent
    # Per process: the child made its own calls after the fork, and its counters started
    # from the parent's at the fork (the parent's 10 interrupted() calls and 10 handlers).
    assert hits(child, "interrupted") == 10 + 1 and hits(child, "on_sig") == 10 + 1
    assert hits(parent, "interrupted") == 10 and hits(parent, "on_sig") == 10
    assert hits(parent, "forked") == 1 and hits(parent, "vforked") == 1
    assert hits(parent, "co_step") == 3 and hits(parent, "co_body") == 1 and hits(parent, "worker") == 4
    if runner == "native":
        assert hits(parent, "on_alt") == 5 and hits(parent, "on_alt_stack") == 5
    if kind == "kretprobe":
        rets = _returns(trace.read_text())                       # by thread id
        parent_pid = next(tid for tid, d in rets.items() if d.get("main"))
        child_pid = next(tid for tid, d in rets.items() if d.get("interrupted") and tid != parent_pid)
        workers = [d for tid, d in rets.items() if tid not in (parent_pid, child_pid)]
        # The child returns through the instances it inherited at the fork (interrupted(),
        # on_sig() run in it after the fork; it leaves forked() by exit()).
        # (The C runtime's own functions on exit() differ by architecture: aarch64's
        # crtstuff returns from __do_global_dtors_aux and deregister_tm_clones there.)
        child = {f: n for f, n in rets[child_pid].items() if f not in CRT_EXIT}
        assert child == {"interrupted": 1, "on_sig": 1, "leaf": 4}, rets[child_pid]
        assert rets[parent_pid].get("interrupted") == 10 and rets[parent_pid].get("on_sig") == 10
        assert rets[parent_pid].get("forked") == 1 and rets[parent_pid].get("vforked") == 1
        assert [d.get("worker") for d in workers] == [1, 1, 1, 1] and all(d.get("leaf") == 2000 for d in workers)
        if runner == "native":
            assert rets[parent_pid].get("on_alt") == 5


def _returns(text: str) -> dict[int, dict[str, int]]:
    """thread id -> function -> return handlers run, from the kretprobes' trace lines."""
    out: dict[int, dict[str, int]] = {}
    for line in text.splitlines():
        m = re.search(r"-(\d+)\s+\[\d+\].*\(.* <- (\w+)\) ret=", line)
        if m:
            d = out.setdefault(int(m.group(1)), {})
            d[m.group(2)] = d.get(m.group(2), 0) + 1
    return out


@pytest.mark.parametrize("part", ["sigaltstack", "coroutine"])
def test_return_handlers_of_frames_on_another_stack(once, runner, part, tmp_path):
    """on_alt_stack() is interrupted by a SA_ONSTACK handler running on a sigaltstack above
    it; co_step() is suspended on a coroutine's heap stack while main calls leaf() on the
    main stack above it.  Each returns later, and its return handler runs each time: a
    probe firing above an instance's slot no longer takes it as left behind (only an
    instance at the slot itself, or the return of an older frame, proves that).  Under
    QEMU only the coroutine (QEMU 7.2 crashes the original program on the sigaltstack)."""
    if runner != "native" and part == "sigaltstack":
        pytest.skip("QEMU 7.2 crashes the original program on the sigaltstack")
    prog, new = once(_build, "kretprobe")
    args = [] if runner == "native" else ["no-altstack"]
    a = run(prog, *args, runner=runner)
    trace, prof = tmp_path / "trace", tmp_path / "profile"
    b = run(new, *args, runner=runner, env={"KPREWRITE_TRACE": str(trace), "KPREWRITE_PROFILE": str(prof)})
    assert (b.returncode, b.stdout, b.stderr) == (a.returncode, a.stdout, a.stderr)
    rets = _returns(trace.read_text())
    parent = next(d for d in rets.values() if d.get("main"))
    fn, n = {"sigaltstack": ("on_alt_stack", 5), "coroutine": ("co_step", 3)}[part]
    assert parent.get(fn) == n, parent
    # Every call of it in the parent found an instance and returned through its handler.
    assert _profiles(prof.read_text())[-1][f"r_{fn}_0"] == (n, 0)


TRAMPOLINE = r"""
#include <signal.h>
#include <stdio.h>
static volatile long acc;
__attribute__((noinline)) long leaf(long x) { acc += x; return x * 3 + 1; }
long (*volatile fptr)(long) = leaf;
__attribute__((noinline)) void on_alt(int s) { acc += leaf(s); }
/* A computed goto whose labels are stored code addresses: a jump through a stored
 * pointer may land inside the function, so its exits cannot all be named and the
 * kretprobe takes the kernel's way, the return address swapped for the trampoline. */
__attribute__((noinline)) long tramp_fn(long n) {
  static void *const k[] = {&&even, &&odd};
  long r = leaf(n);
  goto *k[n & 1];
even: raise(SIGUSR2); return fptr(r);
odd: raise(SIGUSR2); return fptr(r) + 0 * acc;
}
int main(void) {
  char altstack[65536];                    /* above tramp_fn's frame */
  stack_t ss = { .ss_sp = altstack, .ss_size = sizeof altstack };
  sigaltstack(&ss, 0);
  struct sigaction sa = { .sa_handler = on_alt, .sa_flags = SA_ONSTACK };
  sigaction(SIGUSR2, &sa, 0);
  long t = 0;
  for (int i = 0; i < 5; i++) t += tramp_fn(i);
  printf("%ld %ld\n", t, acc);
  return 0;
}
"""


def _tramp(tmp):
    prog = cc(tmp, "tramp_alt", TRAMPOLINE, "-O2")
    return prog, instrument(prog, write_spec(tmp, SPECS["kretprobe"]), tmp / "tramp_alt.r")


def test_trampoline_kretprobe_under_a_sigaltstack_handler(once, runner, tmp_path):
    """A kretprobe by the trampoline (the slot swapped) whose function is interrupted by a
    SA_ONSTACK handler on a stack above it: the handler's probes took the instance as left
    behind, and the function's return into the trampoline died ("kretprobe trampoline
    lost the return address", SIGILL).  Such an instance is now kept aside (a short
    per-thread list of swapped slots) and the trampoline finds it: the return address and
    the return handler, each of the 5 times."""
    prog, new = once(_tramp)
    from conftest import check_lines
    assert any(l.startswith("tramp_fn+0x0  r  optimized  returns: trampoline")
               for l in check_lines(prog, write_spec(tmp_path, SPECS["kretprobe"])))
    a = run(prog, runner=runner)
    trace = tmp_path / "trace"
    b = run(new, runner=runner, env={"KPREWRITE_TRACE": str(trace)})
    assert (b.returncode, b.stdout, b.stderr) == (a.returncode, a.stdout, a.stderr) == (0, "110 290\n", "")
    rets = next(iter(_returns(trace.read_text()).values()))
    assert rets.get("tramp_fn") == 5 and rets.get("on_alt") == 5, rets
