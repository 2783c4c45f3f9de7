"""Real software no one here wrote, rewritten and run: Debian's sqlite3
shell on a SQL script, busybox applets (the static busybox of busybox-static),
gzip round trips, and a C++ program with exceptions and threads (libstdc++).
Each is rewritten three ways: a kprobe on every function (jump-optimized where the
checks allow, INT3 elsewhere), the same with --no-optimize (every probe an INT3),
and a kretprobe on every function.  Each output must equal the original's, natively
and under qemu-x86_64, the probes must have fired, and a second rewrite must give
the same bytes."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from conftest import QEMU, cc, instrument, run, write_spec
from realsoft import KPROBES, KRETPROBES, assert_same_run

ARCHES = ["x86_64"]      # x86-64 only: Debian's x86-64 packages; AArch64's: test_aarch64_real_software.py
VARIANTS = ["kprobe", "no-optimize", "kretprobe"]

SQL = """
CREATE TABLE t(id INTEGER PRIMARY KEY, name TEXT, v REAL);
WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 2000)
INSERT INTO t(name, v) SELECT printf('n%05d', x), x * 1.5 FROM c;
CREATE INDEX t_name ON t(name);
SELECT count(*), sum(v), min(name), max(name) FROM t;
SELECT name, v FROM t WHERE name LIKE 'n0012%' ORDER BY v DESC LIMIT 3;
UPDATE t SET v = v * 2 WHERE id % 7 = 0;
DELETE FROM t WHERE id % 11 = 0;
SELECT count(*), round(avg(v), 3), group_concat(id, ',') FILTER (WHERE id < 30) FROM t;
SELECT upper(substr(name, 2)), length(name) FROM t ORDER BY id LIMIT 2;
"""

CXX = r"""
#include <atomic>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>
#include <map>

static std::mutex m;
static std::map<int, std::string> results;

__attribute__((noinline)) int parse(const std::string &s) {
  if (s.empty() || s[0] == 'x') throw std::invalid_argument("bad: " + s);
  return std::stoi(s);
}

__attribute__((noinline)) int work(int id) {
  int sum = 0, caught = 0;
  for (int i = 0; i < 400; i++) {
    std::string s = (i % 13 == 0) ? "x" + std::to_string(i) : std::to_string(i * id);
    try { sum += parse(s) % 1000; }
    catch (const std::invalid_argument &e) { caught++; }
  }
  std::lock_guard<std::mutex> g(m);
  results[id] = std::to_string(sum) + "/" + std::to_string(caught);
  return sum;
}

int main() {
  std::vector<std::thread> ts;
  std::atomic<long> total{0};
  for (int i = 1; i <= 4; i++) ts.emplace_back([i, &total] { total += work(i); });
  for (auto &t : ts) t.join();
  for (auto &[k, v] : results) std::printf("%d %s\n", k, v.c_str());
  try { parse(""); } catch (const std::exception &e) { std::printf("main caught: %s\n", e.what()); }
  std::printf("total %ld\n", total.load());
  return 0;
}
"""


def _debian(path: str) -> Path:
    p = shutil.which(path) if "/" not in path else path
    if not p or not Path(p).exists():
        pytest.skip(f"{path} not installed (Debian package; .ci/run installs it)")
    return Path(p)


def _rewrites(tmp: Path, binary: Path) -> dict[str, Path]:
    """The three rewrites, plus the determinism check of the first."""
    spec_k = write_spec(tmp, KPROBES, name="k.toml")
    spec_r = write_spec(tmp, KRETPROBES, name="r.toml")
    out = {"kprobe": instrument(binary, spec_k, tmp / f"{binary.name}.k"),
           "no-optimize": instrument(binary, spec_k, tmp / f"{binary.name}.int3", "--no-optimize"),
           "kretprobe": instrument(binary, spec_r, tmp / f"{binary.name}.r")}
    again = instrument(binary, spec_k, tmp / f"{binary.name}.k2")
    assert hashlib.sha256(again.read_bytes()).digest() == hashlib.sha256(out["kprobe"].read_bytes()).digest(), \
        "a second rewrite gave different bytes"
    return out


def _same(orig: Path, new: Path, runner: str, *args, stdin: str | None = None, cwd=None, env=None,
          profiled=True):
    """Runs both; asserts equal stdout, stderr and exit code, and that the probes fired
    (the profile goes to a file, not to the program's stderr; `profiled=False`: a program
    that leaves by _exit(), as busybox's ash does, writes none, as no atexit work runs)."""
    prof = new.parent / f"profile.{new.name}.{runner}"
    prof.unlink(missing_ok=True)
    a = _run(orig, runner, args, stdin, cwd, env)
    b = _run(new, runner, args, stdin, cwd, {**(env or {}), "KPREWRITE_PROFILE": str(prof)})
    assert_same_run(a, b, prof if profiled else None)
    return a


def _run(binary, runner, args, stdin, cwd, env):
    import os
    import subprocess

    cmd = [str(binary), *map(str, args)]
    if runner == "qemu":
        if not QEMU:
            pytest.skip("qemu-x86_64 not installed")
        cmd = [QEMU, *cmd]
    # Bytes: gzip writes binary output.
    r = subprocess.run(cmd, input=stdin.encode() if isinstance(stdin, str) else stdin, capture_output=True,
                       cwd=cwd, env={**os.environ, **(env or {})}, timeout=300)
    r.text = r.stdout.decode("utf-8", "replace")
    return r


def _sqlite3(tmp):
    return _rewrites(tmp, _debian("sqlite3"))


def _gzip(tmp):
    return _rewrites(tmp, _debian("gzip"))


def _busybox(tmp):
    return _rewrites(tmp, _debian("/bin/busybox"))


def _cxx(tmp):
    prog = cc(tmp, "threads_exceptions", CXX, "-O2", "-pthread", lang="c++")
    return prog, _rewrites(tmp, prog)


@pytest.mark.parametrize("variant", VARIANTS)
def test_sqlite3(once, runner, variant, tmp_path):
    new = once(_sqlite3)[variant]
    r = _same(_debian("sqlite3"), new, runner, ":memory:", stdin=SQL)
    assert r.returncode == 0 and "2000|3001500.0|n00001|n02000" in r.text, r.text


@pytest.mark.parametrize("variant", VARIANTS)
def test_gzip_round_trip(once, runner, variant, tmp_path):
    new = once(_gzip)[variant]
    data = tmp_path / "data"
    # Text that compresses (repeats) and bytes that do not, 1.5 MB.
    chunk = b"".join(b"line %d of kprewrite's gzip test\n" % i for i in range(20000))
    data.write_bytes(chunk + hashlib.sha512(chunk).digest() * 8192 + chunk[:300000])
    orig = _debian("gzip")
    for level in ("-1", "-9"):
        r = _same(orig, new, runner, level, "-c", data, cwd=tmp_path)
        assert len(r.stdout) > 10000
    # The rewritten gzip compresses, the rewritten gzip decompresses, the original checks.
    import subprocess
    gz = tmp_path / "data.gz"
    prefix = [] if runner == "native" else [QEMU]
    with open(gz, "wb") as f:
        subprocess.run(prefix + [str(new), "-6", "-c", str(data)], stdout=f, check=True)
    back = subprocess.run(prefix + [str(new), "-d", "-c", str(gz)], capture_output=True, check=True).stdout
    assert back == data.read_bytes()
    assert subprocess.run([str(orig), "-t", str(gz)]).returncode == 0


BUSYBOX = [
    ("sort", ["-n", "-r"], "10\n2\n33\n4\n-5\n100\n"),
    ("wc", ["-l", "-w", "-c"], "a b c\nd e\n\nlast line\n"),
    ("md5sum", [], "the quick brown fox\n" * 1000),
    ("sed", ["-e", "s/o/0/g; /^q/d; 2,3p"], "one\nquit\ntwo\nthree\nfour\n"),
    ("awk", ["{ s += $2; n[$1]++ } END { for (k in n) c++; printf \"%d %d\\n\", s, c }"], "a 1\nb 2\na 3\nc 4\n"),
    ("sh", ["-c", "i=0; while [ $i -lt 50 ]; do i=$((i+1)); done; echo $i; for w in x y z; do printf '%s-' $w; done; echo; "
                  "f() { return 3; }; f; echo rc=$?; echo $(echo nested $(echo deep))"], None),
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_busybox_applets(once, runner, variant, tmp_path):
    new = once(_busybox)[variant]
    orig = _debian("/bin/busybox")
    for applet, args, stdin in BUSYBOX:
        _same(orig, new, runner, applet, *args, stdin=stdin, profiled=applet != "sh")


@pytest.mark.parametrize("variant", VARIANTS)
def test_cxx_exceptions_and_threads(once, runner, variant):
    prog, rewrites = once(_cxx)
    r = _same(prog, rewrites[variant], runner)
    assert "main caught: bad: " in r.text and r.text.count("/31\n") == 4, r.text


SIGNALS = r"""
#include <signal.h>
#include <stdio.h>
#include <unistd.h>
static volatile int got;
__attribute__((noinline)) static void on_usr1(int sig) { got += sig; }
int main(void) {
  signal(SIGUSR1, on_usr1);
  for (int i = 0; i < 3; i++) raise(SIGUSR1);
  printf("got %d\n", got);
  return 0;
}
"""


def test_sigreturn_trampoline_is_blacklisted(tmp_path, runner):
    """glibc's FDE of __restore_rt (CIE augmentation 'S') starts one byte early, in the
    padding: a jump laid there overwrote `mov $15, %rax` and the first signal handler's
    return died of SIGILL (found with busybox sh's $(...) and its SIGCHLD)."""
    from conftest import kprewrite
    prog = cc(tmp_path, "signals", SIGNALS, "-O2", "-static", skip_without_static=True)
    lines = kprewrite("blacklist", prog).stdout.splitlines()
    assert sum(l.endswith("  signal return trampoline") for l in lines) == 1, lines
    new = instrument(prog, write_spec(tmp_path, KPROBES), tmp_path / "signals.k")
    r = _same(prog, new, runner)
    assert r.text == "got 30\n"
