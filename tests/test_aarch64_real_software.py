"""Real AArch64 software no one here wrote: Debian's arm64 static
busybox (busybox-static) and libsqlite3 (libsqlite3-0, loaded by the arm64
sqlite3 shell), each rewritten two ways, a kprobe on every function and a
kretprobe on every function, run under qemu-aarch64: output, errors and exit
code must equal the original's, and the probes must have fired.  And (slow, out of
the default run) libpython3.11, loaded by a small embedding program.

The packages are fetched with `apt-get download` (the arm64 architecture must be
added: `dpkg --add-architecture arm64 && apt-get update`, which .ci/run does)
and extracted with `dpkg-deb -x` into a cache (``$KPREWRITE_ARM64_CACHE``, else
~/.cache/kprewrite/debian-arm64), once.  Without apt lists for arm64 the tests skip."""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import CC, TRIPLES, cc, check_lines, instrument, profile, qemu_command, run, write_spec
from realsoft import KPROBES, KRETPROBES, assert_same_run

ARCHES = ["aarch64"]
VARIANTS = ["kprobe", "kretprobe"]
# sqlite3's shell needs libreadline (and its libtinfo) and libz besides libsqlite3;
# libc and libm come from the cross sysroot (/usr/aarch64-linux-gnu, qemu -L).
# libpython3.11 (loaded by a small embedding program) needs libexpat and its standard library
# (libpython3.11-minimal and -stdlib: PYTHONHOME is the extracted /usr).
PACKAGES = ["busybox-static", "sqlite3", "libsqlite3-0", "libreadline8", "libtinfo6", "zlib1g",
            "libpython3.11", "libpython3.11-minimal", "libpython3.11-stdlib", "libexpat1"]
CACHE = Path(os.environ.get("KPREWRITE_ARM64_CACHE", Path.home() / ".cache" / "kprewrite" / "debian-arm64"))

SQL = """
CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, v REAL);
WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 300)
INSERT INTO t(name, v) SELECT printf('n%05d', x), x * 1.5 FROM c;
CREATE INDEX t_name ON t(name);
SELECT count(*), sum(v), min(name), max(name) FROM t;
SELECT name, v FROM t WHERE name LIKE 'n0012%' ORDER BY v DESC LIMIT 3;
UPDATE t SET v = v * 2 WHERE id % 7 = 0;
DELETE FROM t WHERE id % 11 = 0;
SELECT count(*), round(avg(v), 3), group_concat(id, ',') FILTER (WHERE id < 30) FROM t;
SELECT upper(substr(name, 2)), length(name), hex(zeroblob(2)) FROM t ORDER BY id LIMIT 2;
SELECT no_such_function(1);
"""

# No Python headers for arm64 here: the three calls declared by hand (PyRun_SimpleString is a macro).
EMBED = r"""
int Py_Initialize(void); int PyRun_SimpleStringFlags(const char *, void *); int Py_FinalizeEx(void);
int main(void) {
  Py_Initialize();
  int r = PyRun_SimpleStringFlags(
    "import json, re, collections\n"
    "d = collections.Counter(re.findall(r'\\w+', 'a b a c b a'))\n"
    "print(json.dumps(sorted(d.items())))\n"
    "print(sum(i * i for i in range(2000)), sorted({3, 1, 2}), f'{3.5:.3f}')\n"
    "class E(Exception): pass\n"
    "try:\n    raise E('x')\nexcept E as e:\n    print('caught', e)\n"
    "import sys; sys.stderr.write('to stderr\\n')\n", 0);
  return Py_FinalizeEx() < 0 ? 120 : r;
}
"""

BUSYBOX = [
    ("sort", ["-n", "-r"], "10\n2\n33\n4\n-5\n100\n"),
    ("wc", ["-l", "-w", "-c"], "a b c\nd e\n\nlast line\n"),
    ("md5sum", [], "the quick brown fox\n" * 200),
    ("sed", ["-e", "s/o/0/g; /^q/d; 2,3p"], "one\nquit\ntwo\nthree\nfour\n"),
    ("awk", ["{ s += $2; n[$1]++ } END { for (k in n) c++; printf \"%d %d\\n\", s, c }"], "a 1\nb 2\na 3\nc 4\n"),
    ("tr", ["a-z", "A-Z"], "mixed Case text\n"),
]


def _sysroot() -> Path:
    """The downloaded packages, extracted (once) into CACHE/root; a lock keeps
    pytest-xdist's workers from fetching into the same cache at once."""
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    with open(CACHE.parent / f"{CACHE.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch()


def _fetch() -> Path:
    root, done = CACHE / "root", CACHE / "packages"
    if done.is_file() and done.read_text().split() == PACKAGES:
        return root
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        pytest.skip("apt-get and dpkg-deb needed to fetch Debian's arm64 packages")
    debs = CACHE / "debs"
    shutil.rmtree(CACHE, ignore_errors=True)
    debs.mkdir(parents=True)
    r = subprocess.run(["apt-get", "download", "-q", *(f"{p}:arm64" for p in PACKAGES)], cwd=debs,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"apt-get download of arm64 packages failed (dpkg --add-architecture arm64 && "
                    f"apt-get update: .ci/run): {r.stderr.strip()[-300:]}")
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    done.write_text("\n".join(PACKAGES))
    return root


def _libdirs(root: Path) -> str:
    return f"{root}/usr/lib/aarch64-linux-gnu:{root}/lib/aarch64-linux-gnu"


def _rewrites(tmp: Path, binary: Path) -> dict[str, Path]:
    return {"kprobe": instrument(binary, write_spec(tmp, KPROBES, name="k.toml"), tmp / f"{binary.name}.k"),
            "kretprobe": instrument(binary, write_spec(tmp, KRETPROBES, name="r.toml"), tmp / f"{binary.name}.r")}


def _busybox(tmp):
    return _rewrites(tmp, _sysroot() / "bin" / "busybox")


def _libsqlite3(tmp):
    lib = _sysroot() / "usr" / "lib" / "aarch64-linux-gnu" / "libsqlite3.so.0"
    out = _rewrites(tmp, lib.resolve())
    # Each rewrite in a directory of its own under the soname, first on the library path.
    for variant, path in out.items():
        d = tmp / variant
        d.mkdir()
        shutil.copy(path, d / "libsqlite3.so.0")
        out[variant] = d
    return out


def _libpython(tmp):
    root = _sysroot()
    lib = (root / "usr" / "lib" / "aarch64-linux-gnu" / "libpython3.11.so.1.0").resolve()
    prog = cc(tmp, "embed", EMBED, "-O2", str(lib), f"-Wl,-rpath-link,{_libdirs(root)}")
    out = _rewrites(tmp, lib)
    for variant, path in out.items():
        d = tmp / variant
        d.mkdir()
        shutil.copy(path, d / "libpython3.11.so.1.0")
        out[variant] = d
    return prog, out


def _run(cmd, stdin: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([*qemu_command(), *map(str, cmd)], input=stdin, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def _same(cmd, stdin: str, env_orig: dict, env_new: dict, prof: Path) -> subprocess.CompletedProcess:
    """Runs the original and the rewrite; asserts equal stdout, stderr and exit code,
    and that the probes fired (the profile, KPREWRITE_PROFILE, in a file)."""
    prof.unlink(missing_ok=True)
    a = _run(cmd["orig"], stdin, env_orig)
    b = _run(cmd["new"], stdin, {**env_new, "KPREWRITE_PROFILE": str(prof)})
    assert_same_run(a, b, prof)
    return a


@pytest.mark.parametrize("variant", VARIANTS)
def test_busybox_applets(once, variant, tmp_path):
    new = once(_busybox)[variant]
    orig = _sysroot() / "bin" / "busybox"
    for applet, args, stdin in BUSYBOX:
        r = _same({"orig": [orig, applet, *args], "new": [new, applet, *args]}, stdin, {}, {},
                  tmp_path / f"profile.{applet}")
        assert r.returncode == 0 and r.stdout, (applet, r.stderr)


@pytest.mark.parametrize("variant", VARIANTS)
def test_libsqlite3(once, variant, tmp_path):
    libdir = once(_libsqlite3)[variant]
    root = _sysroot()
    shell = [root / "usr" / "bin" / "sqlite3", ":memory:"]
    # qemu's -E sets the guest's environment: the guest loader reads LD_LIBRARY_PATH there.
    env = lambda first: {"QEMU_SET_ENV": f"LD_LIBRARY_PATH={first}{_libdirs(root)}"}
    r = _same({"orig": shell, "new": shell}, SQL, env(""), env(f"{libdir}:"), tmp_path / "profile")
    assert "300|67725.0|n00001|n00300" in r.stdout, r.stdout + r.stderr
    assert "no such function: no_such_function" in r.stderr, r.stderr


# Two rewrites of libpython's 6,000 functions take about a minute: out of the default run.
@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_libpython(once, variant, tmp_path):
    prog, libdirs = once(_libpython)
    root = _sysroot()
    env = lambda first: {"QEMU_SET_ENV": f"LD_LIBRARY_PATH={first}{_libdirs(root)},PYTHONHOME={root}/usr"}
    r = _same({"orig": [prog], "new": [prog]}, "", env(""), env(f"{libdirs[variant]}:"), tmp_path / "profile")
    assert r.returncode == 0 and r.stdout == ('[["a", 3], ["b", 2], ["c", 1]]\n2664667000 [1, 2, 3] 3.500\n'
                                              'caught x\n'), r.stdout + r.stderr
    assert r.stderr == "to stderr\n", r.stderr


# --- entry_frame on AArch64 (the check the kretprobe runs above needed) ----------------------

def _split(tmp):
    """test_kretprobe_floor.py's hot/cold library, cross-compiled and stripped: its
    cold blocks have FDEs of their own that start mid-frame (CFA sp+N, N > 0)."""
    from test_kretprobe_floor import LIB, MAIN
    (tmp / "lib.c").write_text(LIB)
    lib = tmp / "libhc.so"
    subprocess.run([CC, "-O2", "-fPIC", "-shared", "-freorder-blocks-and-partition", str(tmp / "lib.c"),
                    "-o", str(lib)], check=True)
    subprocess.run([f"{TRIPLES['aarch64']}-strip", str(lib)], check=True)
    prog = cc(tmp, "main", MAIN, "-O2", f"-L{tmp}", "-lhc")
    spec = write_spec(tmp, KRETPROBES)
    (tmp / "opt").mkdir()
    return prog, lib, check_lines(lib, spec), instrument(lib, spec, tmp / "opt" / "libhc.so")


def test_stripped_cold_parts_refused_by_entry_frame(once):
    prog, lib, check, new = once(_split)
    cold = [l for l in check if re.match(r"sub_[0-9a-f]+\+0x0  r  refused  entry_frame at ", l)]
    assert len(cold) == 3 and all("not sp+0" in l for l in cold), "\n".join(check)
    want = run(prog, 200, runner="qemu", libdir=lib.parent)
    got = run(prog, 200, runner="qemu", libdir=new.parent, env={"KPREWRITE_PROFILE": "-"})
    assert want.returncode == 0 and "warn huge" in want.stderr, want.stderr
    assert got.returncode == 0 and got.stdout == want.stdout, got.stdout + got.stderr[-2000:]
    assert profile(got.stderr)["r_lib_classify_0"][0] == 200, got.stderr[-2000:]


EXCEPTIONS = r"""
#include <cstdio>
#include <stdexcept>
#include <string>
__attribute__((noinline)) int parse(const std::string &s) {
  if (s.empty() || s[0] == 'x') throw std::invalid_argument("bad: " + s);
  return std::stoi(s);
}
int main() {
  int c = 0, sum = 0;
  for (int i = 0; i < 40; i++) { try { sum += parse(i % 3 ? std::to_string(i) : "x"); } catch (const std::exception &e) { c++; } }
  std::printf("caught %d sum %d\n", c, sum);
}
"""


@pytest.mark.slow
def test_cxx_libraries_with_kretprobes(tmp_path):
    """The cross sysroot's libstdc++ and libgcc_s, both with a kretprobe on every function,
    under a program that throws and catches: __cxa_end_catch's tail call to
    _Unwind_DeleteException and on to libstdc++'s exception cleanup crosses the two
    runtimes (their trampolines' marks keep the chain), and the output is the original's."""
    sysroot = Path("/usr") / TRIPLES["aarch64"] / "lib"
    libs = [sysroot / n for n in ("libstdc++.so.6", "libgcc_s.so.1")]
    if not all(p.exists() for p in libs):
        pytest.skip("no arm64 libstdc++/libgcc_s in the cross sysroot")
    prog = cc(tmp_path, "exceptions", EXCEPTIONS, "-O2", lang="c++")
    spec = write_spec(tmp_path, KRETPROBES)
    (tmp_path / "lib").mkdir()
    for lib in libs:
        instrument(lib, spec, tmp_path / "lib" / lib.name)
    cmd = [*qemu_command(), str(prog)]
    a = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    prof = tmp_path / "profile"
    b = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "LD_LIBRARY_PATH": str(tmp_path / "lib"), "KPREWRITE_PROFILE": str(prof)})
    assert (a.returncode, a.stdout) == (0, "caught 14 sum 507\n"), a
    assert (b.returncode, b.stdout, b.stderr) == (a.returncode, a.stdout, a.stderr)
    p = profile("\n".join("  " + line.strip() for line in prof.read_text().splitlines()))
    assert p["r__Unwind_DeleteException_0"][0] == 14 and p["r___cxa_end_catch_0"][0] == 14, \
        {k: v for k, v in p.items() if "Unwind" in k or "cxa" in k}
