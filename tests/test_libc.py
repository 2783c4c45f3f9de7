"""The distribution's own C library, rewritten (issue 41): Debian's libc.so.6, and the
libraries every C++ program loads with it (libm, libstdc++, libgcc_s), with a probe on
every function (jump-optimized where the checks allow, breakpoints elsewhere), the same
with --no-optimize (every probe a breakpoint) and a kretprobe on every function, loaded
by real programs through LD_LIBRARY_PATH: the same output and exit status as with the
originals, and the probes fired.  Exact counts for a program calling puts 3 times,
with every run-time variable (KPREWRITE_PROFILE, KPREWRITE_TRACE, KPREWRITE_ENABLED).
Small shared objects built here check each start-up path libc needs on its own: a
PT_INTERP (a library that can run as a program), DT_RELR-relocated init arrays, no
DT_FINI*; the dynamic loader is refused in one line."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import cc, kprewrite, profile, write_spec
from realsoft import KPROBES, KRETPROBES

ARCHES = ["x86_64"]      # x86-64 only: Debian's x86-64 libc.so.6; AArch64's real software: test_aarch64_real_software.py

LIBDIR = Path("/lib/x86_64-linux-gnu")
LIBC = LIBDIR / "libc.so.6"
LD_SO = LIBDIR / "ld-linux-x86-64.so.2"
VARIANTS = {"kprobe": (KPROBES, ()), "no-optimize": (KPROBES, ("--no-optimize",)), "kretprobe": (KRETPROBES, ())}

pytestmark = pytest.mark.skipif(not LIBC.exists(), reason="no Debian x86-64 libc.so.6")


def _rewrite(lib: Path, spec: Path, out: Path, *extra) -> Path:
    """`kprewrite instrument` (no `diff` here: test_diff_explains_libc does it once)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    kprewrite("instrument", lib, "--spec", spec, "-o", out, "-q", *extra)
    return out


@pytest.fixture(scope="module")
def libc_dirs(tmp_path_factory) -> dict[str, Path]:
    """A folder per variant holding libc.so.6 rewritten with a probe on every function."""
    tmp = tmp_path_factory.mktemp("libc")
    out = {}
    for name, (text, extra) in VARIANTS.items():
        spec = write_spec(tmp, text, name=f"{name}.toml")
        out[name] = _rewrite(LIBC, spec, tmp / name / "libc.so.6", *extra).parent
    return out


def _run(cmd, libdir: Path | None, env=None, cwd=None, stdin=None):
    e = {**os.environ, **(env or {})}
    if libdir is not None:
        e["LD_LIBRARY_PATH"] = str(libdir)
    return subprocess.run([str(c) for c in cmd], capture_output=True, env=e, cwd=cwd, input=stdin, timeout=300)


def _same(cmd, libdir: Path, tmp: Path, **kw) -> dict[str, tuple[int, int]]:
    """The program run with the original libraries and with those of libdir: the same
    stdout, stderr and exit status; returns the rewrite's profile (KPREWRITE_PROFILE=FILE)."""
    prof = tmp / "profile"
    prof.unlink(missing_ok=True)
    a = _run(cmd, None, **kw)
    b = _run(cmd, libdir, env={"KPREWRITE_PROFILE": str(prof), **kw.pop("env", {})}, **kw)
    assert (b.returncode, b.stdout, b.stderr) == (a.returncode, a.stdout, a.stderr), (cmd, b.stderr[-2000:])
    return profile("\n".join("  " + line.strip() for line in prof.read_text().splitlines()))


def _python() -> Path:
    for p in ("/usr/bin/python3", "/usr/bin/python3.11"):
        if Path(p).exists():
            return Path(p)
    pytest.skip("no Debian python3")


def _programs(tmp: Path) -> list[tuple[list, dict]]:
    """Real programs on real input: (command, extra keywords for _run)."""
    data = tmp / "numbers.txt"
    if not data.exists():
        # 100,000 lines in an order of their own: sort's threads and gzip's blocks work.
        data.write_text("".join(f"{(i * 7919) % 100003}\n" for i in range(100000)))
    tree = Path(__file__).resolve().parent.parent / "runtime"
    return [
        (["/bin/echo", "hello", "world"], {}),
        (["ls", "-la", "--time-style=+", str(tree)], {}),
        (["find", str(tree), "-name", "*.h", "-exec", "wc", "-l", "{}", "+"], {}),
        (["gzip", "-9", "-c", str(data)], {}),
        (["sort", "--parallel=4", "-S", "1M", "-n", str(data)], {}),        # threads: pthread_create blocks every signal
        ([_python(), "-c", "import json, math, subprocess; print(json.dumps([math.sin(1), 2 ** 70])); "
          "print(subprocess.run(['echo', 'child'], capture_output=True).stdout)"], {}),   # posix_spawn / vfork
    ]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_real_programs_on_rewritten_libc(libc_dirs, variant, tmp_path):
    """echo, ls, find -exec, gzip, sort with 4 threads and python3 starting a child, on
    libc.so.6 with a probe on every function: each prints and returns what it does on
    the original, and the probes fired."""
    for cmd, kw in _programs(tmp_path):
        p = _same(cmd, libc_dirs[variant], tmp_path, **kw)
        assert sum(h for h, _ in p.values()) > 0, cmd


PUTS = r"""
#include <stdio.h>
int main(void) { puts("one"); puts("two"); puts("three"); return 3; }
"""


@pytest.fixture(scope="module")
def puts_setup(tmp_path_factory):
    """A program calling puts 3 times; libc with a kprobe (optimized and breakpoint), a
    kretprobe and a trace event on puts."""
    tmp = tmp_path_factory.mktemp("puts")
    prog = cc(tmp, "puts3", PUTS, "-O2", "-fno-builtin")
    k = write_spec(tmp, '[[kprobe]]\nsymbol_name = "puts"\n', name="k.toml")
    r = write_spec(tmp, '[[kretprobe]]\nsymbol_name = "puts"\n', name="r.toml")
    e = write_spec(tmp, 'events = ["p:myputs puts s=+0(%di):string"]\n', name="e.toml")
    libs = {"optimized": _rewrite(LIBC, k, tmp / "opt" / "libc.so.6").parent,
            "int3": _rewrite(LIBC, k, tmp / "int3" / "libc.so.6", "--no-optimize").parent,
            "kretprobe": _rewrite(LIBC, r, tmp / "ret" / "libc.so.6").parent,
            "event-int3": _rewrite(LIBC, e, tmp / "event" / "libc.so.6", "--no-optimize").parent,
            "event-optimized": _rewrite(LIBC, e, tmp / "event-opt" / "libc.so.6").parent}
    return prog, libs


@pytest.mark.parametrize("kind", ["optimized", "int3", "kretprobe"])
def test_puts_counted_exactly(puts_setup, kind, tmp_path):
    """KPREWRITE_PROFILE=- prints the row with 3 hits; KPREWRITE_ENABLED=0 counts none;
    the output and the exit status are the original's."""
    prog, libs = puts_setup
    orig = _run([prog], None)
    assert orig.stdout == b"one\ntwo\nthree\n" and orig.returncode == 3
    name = "r_puts_0" if kind == "kretprobe" else "p_puts_0"
    r = _run([prog], libs[kind], env={"KPREWRITE_PROFILE": "-"})
    assert (r.returncode, r.stdout) == (3, orig.stdout)
    assert profile(r.stderr.decode()) == {name: (3, 0)}, r.stderr
    off = _run([prog], libs[kind], env={"KPREWRITE_PROFILE": "-", "KPREWRITE_ENABLED": "0"})
    assert (off.returncode, off.stdout) == (3, orig.stdout)
    assert profile(off.stderr.decode()) == {name: (0, 0)}, off.stderr


@pytest.mark.parametrize("form", ["optimized", "int3"])
def test_puts_trace_file(puts_setup, tmp_path, form):
    """KPREWRITE_TRACE=FILE: the 3 trace lines go to FILE, nothing to stderr."""
    prog, libs = puts_setup
    trace = tmp_path / "trace.txt"
    r = _run([prog], libs[f"event-{form}"], env={"KPREWRITE_TRACE": str(trace), "KPREWRITE_PROFILE": str(tmp_path / "p")})
    assert (r.returncode, r.stdout, r.stderr) == (3, b"one\ntwo\nthree\n", b"")
    lines = trace.read_text().splitlines()
    assert [line.split("myputs: (puts+0x0/")[1].split(" ", 1)[1] for line in lines] == \
        ['s="one"', 's="two"', 's="three"'], lines
    assert "myputs" in (tmp_path / "p").read_text()


def test_dynamic_loader_refused(tmp_path):
    """ld.so: one line saying why, for instrument and check; nothing written."""
    if not LD_SO.exists():
        pytest.skip("no ld-linux-x86-64.so.2")
    spec = write_spec(tmp_path, KPROBES)
    for args in (["instrument", LD_SO, "--spec", spec, "-o", tmp_path / "ld.so"], ["check", LD_SO, "--spec", spec]):
        r = kprewrite(*args, check=False)
        assert r.returncode == 1 and not (tmp_path / "ld.so").exists()
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and "the dynamic loader cannot be rewritten" in lines[0], r.stderr


# --- the start-up paths, each in a small library --------------------------------------------

LIB = r"""
#include <unistd.h>
static int calls;
__attribute__((noinline)) int twice(int x) { calls++; return 2 * x; }
__attribute__((constructor)) static void ctor(void) { calls = 0; }
/* A PT_INTERP and an entry point: the library runs as a program too, as libc.so.6 does. */
const char interp[] __attribute__((section(".interp"))) = "/lib64/ld-linux-x86-64.so.2";
void entry(void) { write(1, "run as a program\n", 17); _exit(0); }
"""
MAIN = r"""
#include <stdio.h>
int twice(int);
int main(void) { int s = 0; for (int i = 0; i < 3; i++) s += twice(i); printf("s=%d\n", s); return 0; }
"""


@pytest.mark.parametrize("how", ["relr+interp", "no-fini"])
@pytest.mark.parametrize("optimize", [True, False])
def test_library_start_up(tmp_path, how, optimize):
    """A library with a PT_INTERP (run as a program too), whose DT_INIT_ARRAY DT_RELR
    relocates (ld -z pack-relative-relocs, as glibc 2.36's libc), with DT_FINI (crti)
    or with neither DT_FINI nor DT_FINI_ARRAY (-nostartfiles: a DT_FINI of ours writes
    the profile): the probe fires, counted exactly, and every variable is honoured."""
    flags = ["-O2", "-shared", "-fPIC", "-Wl,-z,pack-relative-relocs", "-Wl,-e,entry"]
    if how == "no-fini":
        flags.append("-nostartfiles")
    lib = cc(tmp_path, "libt.so", LIB, *flags)
    dyn = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "(RELR)" in dyn and ("(FINI" not in dyn) == (how == "no-fini"), dyn
    prog = cc(tmp_path, "main", MAIN, "-O2", f"-L{tmp_path}", "-l:libt.so")
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "twice"\n')
    new = _rewrite(lib, spec, tmp_path / "new" / "libt.so", *(() if optimize else ("--no-optimize",)))
    r = _run([prog], new.parent, env={"KPREWRITE_PROFILE": "-"})
    assert (r.returncode, r.stdout) == (0, b"s=6\n") and profile(r.stderr.decode()) == {"p_twice_0": (3, 0)}, r.stderr
    off = _run([prog], new.parent, env={"KPREWRITE_PROFILE": str(tmp_path / "p"), "KPREWRITE_ENABLED": "0"})
    assert (off.returncode, off.stdout, off.stderr) == (0, b"s=6\n", b"")
    assert profile("  " + (tmp_path / "p").read_text().strip()) == {"p_twice_0": (0, 0)}
    ran = _run([new], None)
    assert (ran.returncode, ran.stdout) == (0, b"run as a program\n"), ran.stderr


# --- libm, libstdc++ and libgcc_s beside libc ------------------------------------------------

CXX_LIBS = ["libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1"]
MATH = r"""
#include <math.h>
#include <stdio.h>
int main(int argc, char **argv) {
  double s = 0;
  for (int i = 1; i <= 40 + argc; i++) s += sqrt(i) * sin(i) + pow(1.5, i % 9) + log(i) + cbrt(i);
  printf("%.9f\n", s);
  return 0;
}
"""


@pytest.fixture(scope="module")
def cxx_dirs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("cxxlibs")
    out = {}
    for name, (text, extra) in VARIANTS.items():
        spec = write_spec(tmp, text, name=f"{name}.toml")
        for lib in CXX_LIBS:
            if not (LIBDIR / lib).exists():
                pytest.skip(f"no {lib}")
            _rewrite(LIBDIR / lib, spec, tmp / name / lib, *extra)
        out[name] = tmp / name
    return out


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cxx_program_on_rewritten_libraries(cxx_dirs, variant, tmp_path):
    """A C++ program with 4 threads and exceptions (test_real_software's), and a libm
    program, on libc, libm, libstdc++ and libgcc_s all rewritten: the same output, and
    the probes of each library fired (kretprobes: exceptions unwind through frames
    whose instances two runtimes' trampolines chain)."""
    import test_real_software as rs
    prog = cc(tmp_path, "threads_exceptions", rs.CXX, "-O2", "-pthread", lang="c++")
    p = _same([prog], cxx_dirs[variant], tmp_path)
    assert sum(h for h, _ in p.values()) > 0
    math = cc(tmp_path, "math", MATH, "-O2", "-fno-builtin", "-lm")
    p = _same([math], cxx_dirs[variant], tmp_path)
    assert sum(h for n, (h, _) in p.items() if "cbrt" in n) > 0, sorted(p)[:20]


@pytest.mark.slow
def test_diff_explains_libc(libc_dirs):
    """`kprewrite diff` attributes every byte the rewrite changed in libc.so.6: the probe
    sites, the init/fini hooks (DT_RELR-relocated), the DT_FINI of ours, the IFUNC
    resolvers' chains and the signal system calls' jumps."""
    from conftest import attributed
    for name in ("kprobe", "no-optimize"):
        attributed(LIBC, libc_dirs[name] / "libc.so.6")


def test_deterministic(libc_dirs, tmp_path):
    """A second rewrite of libc.so.6 gives the same bytes."""
    spec = write_spec(tmp_path, KPROBES)
    again = _rewrite(LIBC, spec, tmp_path / "again" / "libc.so.6", "--no-optimize")
    assert hashlib.sha256(again.read_bytes()).digest() == \
        hashlib.sha256((libc_dirs["no-optimize"] / "libc.so.6").read_bytes()).digest()
