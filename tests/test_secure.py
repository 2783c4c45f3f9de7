"""Set-user-ID safety: a rewritten program the kernel runs AT_SECURE
(set-user-ID, set-group-ID, file capabilities) ignores every KPREWRITE_*
variable, which its unprivileged caller controls: probes armed as built, trace
lines on standard error, no trace or profile file, no profile signal.  The same
binary without the set-user-ID bit honours them.  Files the runtime creates are
mode 0600.

The suite runs as root: the programs are chowned to root, made set-user-ID and
run as `nobody` through util-linux's setpriv.  Natively only: under qemu-user
the kernel executes QEMU, not the program, so the set-user-ID bit grants nothing
and the program is not AT_SECURE (QEMU passes on its own AT_SECURE); for another
architecture (KPREWRITE_TEST_ARCH) only that qemu-user case runs."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import ALL_ARCHES, CROSS, FACTS, cc, instrument, qemu_command, write_spec

ARCHES = ALL_ARCHES

SETPRIV = shutil.which("setpriv")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None,
                                reason="needs root (to make a set-user-ID program) and setpriv")
# The kernel must execute the program itself (not qemu-user) for it to be AT_SECURE.
native = pytest.mark.skipif(CROSS, reason="runs the program natively")

PROGRAM = r"""
#include <signal.h>
#include <stdio.h>
__attribute__((noinline)) long work(long x) { __asm__ volatile("" ::: "memory"); return x * 3; }
int main(void)
{
    long s = 0;
    for (long i = 0; i < 3; i++)
        s += work(i);
    struct sigaction sa;
    sigaction(SIGUSR2, 0, &sa);
    printf("s=%ld usr2=%s\n", s, sa.sa_handler == SIG_DFL ? "dfl" : "set");
    return 0;
}
"""

LIB = r"""
__attribute__((noinline)) long work(long x) { __asm__ volatile("" ::: "memory"); return x * 3; }
long lib_work(long x) { return work(x); }
"""

LIB_MAIN = r"""
#include <signal.h>
#include <stdio.h>
long lib_work(long x);
int main(void)
{
    long s = 0;
    for (long i = 0; i < 3; i++)
        s += lib_work(i);
    struct sigaction sa;
    sigaction(SIGUSR2, 0, &sa);
    printf("s=%ld usr2=%s\n", s, sa.sa_handler == SIG_DFL ? "dfl" : "set");
    return 0;
}
"""

SPEC = f'events = ["p:w work x={FACTS.ARG_REGS[0]}:s64"]\n'


@pytest.fixture
def dirs():
    """(bin, out, private): programs in `bin` (0755, so nobody reaches them), file
    outputs in `out` (0777: nobody could create files there), and `private`
    (0700, root's): only a privileged program could create a file there."""
    top = Path(tempfile.mkdtemp(prefix="kp-secure-", dir="/tmp"))
    try:
        if os.statvfs(top).f_flag & os.ST_NOSUID:
            pytest.skip("/tmp is mounted nosuid: no set-user-ID program runs there")
        os.chmod(top, 0o755)
        b, o, p = top / "bin", top / "out", top / "private"
        for d, mode in ((b, 0o755), (o, 0o777), (p, 0o700)):
            d.mkdir()
            os.chmod(d, mode)
        yield b, o, p
    finally:
        shutil.rmtree(top)


def as_nobody(binary: Path, env: dict) -> subprocess.CompletedProcess:
    cmd = [SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups", str(binary)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **env})


def setuid_root(path: Path, on: bool):
    os.chown(path, 0, 0)
    os.chmod(path, 0o4755 if on else 0o755)


def variables(out: Path, trace: Path) -> dict:
    return {"KPREWRITE_ENABLED": "0", "KPREWRITE_TRACE": str(trace),
            "KPREWRITE_PROFILE": str(out / "profile"), "KPREWRITE_PROFILE_SIGNAL": "USR2"}


def trace_lines(stderr: str) -> list[str]:
    return [l for l in stderr.splitlines() if " w: (work+0x0/" in l]


def check_ignored(r, out: Path, private: Path):
    """AT_SECURE: every variable ignored."""
    assert r.returncode == 0 and r.stdout == "s=9 usr2=dfl\n", (r.returncode, r.stdout, r.stderr)
    lines = trace_lines(r.stderr)
    assert len(lines) == 3, r.stderr                      # armed as built, traced to standard error
    assert [l.split()[-1] for l in lines] == ["x=0", "x=1", "x=2"]
    assert list(out.iterdir()) == [] and list(private.iterdir()) == []


def check_honoured(r, out: Path):
    """Not privileged: ENABLED=0 silences the probe, the trace file and the profile
    are created (0600), the profile signal is installed."""
    assert r.returncode == 0 and r.stdout == "s=9 usr2=set\n", (r.returncode, r.stdout, r.stderr)
    assert trace_lines(r.stderr) == []
    trace, prof = out / "trace", out / "profile"
    assert trace.read_text() == ""                        # opened at start-up; disarmed: nothing traced
    assert prof.read_text().split() == ["w", "0", "0"]
    for f in (trace, prof):
        st = f.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
        assert st.st_uid == 65534                         # created by nobody


@pytest.fixture
def program(tmp_path, dirs):
    prog = cc(tmp_path, "prog", PROGRAM, "-O2")
    out = instrument(prog, write_spec(tmp_path, SPEC))
    dst = dirs[0] / "prog.kp"
    shutil.copy(out, dst)
    return dst


@native
def test_setuid_ignores_variables(program, dirs):
    """The issue's case: run by nobody, a set-user-ID root program creates no file,
    not even in a directory only root can write, and cannot be silenced."""
    _, out, private = dirs
    setuid_root(program, True)
    check_ignored(as_nobody(program, variables(out, private / "trace")), out, private)


@native
def test_static_setuid_ignores_variables(tmp_path, dirs):
    """A static executable: AT_SECURE from the same initial stack, before the C library runs."""
    bindir, out, private = dirs
    prog = cc(tmp_path, "sprog", PROGRAM, "-O2", "-static", skip_without_static=True)
    dst = bindir / "sprog.kp"
    shutil.copy(instrument(prog, write_spec(tmp_path, SPEC)), dst)
    setuid_root(dst, True)
    check_ignored(as_nobody(dst, variables(out, private / "trace")), out, private)
    setuid_root(dst, False)
    check_honoured(as_nobody(dst, variables(out, out / "trace")), out)


@native
def test_setgid_ignores_variables(program, dirs):
    """Set-group-ID alone makes the program AT_SECURE too."""
    _, out, private = dirs
    os.chown(program, 0, 0)
    os.chmod(program, 0o2755)
    check_ignored(as_nobody(program, variables(out, private / "trace")), out, private)


@native
def test_without_setuid_honours_variables(program, dirs):
    """The same binary without the bit, run by nobody: today's behaviour."""
    _, out, _ = dirs
    setuid_root(program, False)
    check_honoured(as_nobody(program, variables(out, out / "trace")), out)


@native
def test_root_honours_variables(program, dirs):
    """Run by root with the bit set (no change of identity: not AT_SECURE)."""
    _, out, _ = dirs
    setuid_root(program, True)
    r = subprocess.run([str(program)], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", **variables(out, out / "trace")})
    assert r.returncode == 0 and r.stdout == "s=9 usr2=set\n", r.stderr
    assert trace_lines(r.stderr) == []
    for f in (out / "trace", out / "profile"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600


@native
def test_shared_object_in_setuid_program(tmp_path, dirs):
    """A rewritten shared object reads AT_SECURE from the kernel (prctl(PR_GET_AUXV)
    or /proc/self/auxv), not from the environment array its init is given."""
    bindir, out, private = dirs
    lib = cc(tmp_path, "libwork.so", LIB, "-O2", "-fPIC", "-shared")
    kp = instrument(lib, write_spec(tmp_path, SPEC))
    shutil.copy(kp, bindir / "libwork.so")
    os.chmod(bindir / "libwork.so", 0o755)
    # An absolute RUNPATH: a set-user-ID program's loader ignores LD_LIBRARY_PATH.
    main = cc(tmp_path, "main", LIB_MAIN, "-O2", f"-L{bindir}", "-lwork", f"-Wl,-rpath,{bindir}")
    dst = bindir / "main"
    shutil.copy(main, dst)
    setuid_root(dst, True)
    check_ignored(as_nobody(dst, variables(out, private / "trace")), out, private)
    setuid_root(dst, False)
    check_honoured(as_nobody(dst, variables(out, out / "trace")), out)


def test_qemu_grants_nothing(program, dirs):
    """Under qemu-user the kernel executes QEMU (not set-user-ID), so the program
    runs as nobody with nobody's rights, is not AT_SECURE, and honours the variables."""
    _, out, _ = dirs
    setuid_root(program, True)
    cmd = [SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups", *qemu_command(), str(program)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", **variables(out, out / "trace")})
    check_honoured(r, out)


EXEC_PROGRAM = r"""
#include <unistd.h>
__attribute__((noinline)) long work(long x) { __asm__ volatile("" ::: "memory"); return x * 3; }
int main(void)
{
    long s = 0;
    for (long i = 0; i < 3; i++)
        s += work(i);
    execl("/bin/ls", "ls", "-l", "/proc/self/fd", (char *)0);
    return 1;
}
"""


@native
def test_files_close_on_exec(tmp_path):
    """The trace file (opened at start-up) is not inherited by a program the
    probed one executes; the profile is only opened at exit."""
    prog = cc(tmp_path, "execprog", EXEC_PROGRAM, "-O2")
    out = instrument(prog, write_spec(tmp_path, SPEC))
    trace = tmp_path / "trace"
    r = subprocess.run([str(out)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KPREWRITE_TRACE": str(trace)})
    assert r.returncode == 0, r.stderr
    assert len(trace.read_text().splitlines()) == 3
    assert " -> " in r.stdout and str(trace) not in r.stdout, r.stdout
    assert stat.S_IMODE(trace.stat().st_mode) == 0o600
