"""Real libraries from Debian's packages with a probe on every function entry
(issue 15's table): how many entries are jump-optimized, and how much slower a
real workload runs.

    python3 benchmarks/real_libs.py [NAME ...]      (sqlite3 busybox crypto stdcxx)

Each workload runs on the original and on the rewritten object (a library
through LD_LIBRARY_PATH, busybox itself), 3 interleaved runs each, medians; the
outputs must be equal.  The probes carry no handler (they count hits)."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KPREWRITE = [sys.executable, "-m", "rewriter"]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))
LIBDIR = Path("/usr/lib/x86_64-linux-gnu")

SQL = """
CREATE TABLE t(a INTEGER PRIMARY KEY, b TEXT, c REAL);
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 200000)
INSERT INTO t SELECT i, printf('row %d %x', i, i * 7919), i * 0.5 FROM n;
CREATE INDEX tb ON t(b);
SELECT count(*), sum(c), max(b) FROM t WHERE b LIKE 'row 1%';
SELECT b FROM t ORDER BY b DESC LIMIT 3;
SELECT a % 10, count(*), avg(c) FROM t GROUP BY a % 10;
UPDATE t SET c = c * 2 WHERE a % 3 = 0;
SELECT sum(c) FROM t;
"""

CXX = r"""
#include <algorithm>
#include <iostream>
#include <map>
#include <string>
#include <vector>
int main()
{
    std::vector<std::string> v;
    for (long i = 0; i < 300000; i++)
        v.push_back("item " + std::to_string(i * 7919 % 100003) + " " + std::to_string(i));
    std::sort(v.begin(), v.end());
    std::map<std::string, int> m;
    for (const std::string &x : v)
        m[x.substr(0, 7)]++;
    std::cout << v.front() << " | " << v.back() << " | " << m.size() << std::endl;
    return 0;
}
"""


def check(obj: Path, spec: Path) -> tuple[int, Counter]:
    r = subprocess.run([*KPREWRITE, "check", str(obj), "--spec", str(spec), "--format", "json"],
                       capture_output=True, text=True, env=ENV)
    ps = json.loads(r.stdout)["probes"]
    return len(ps), Counter(p["decision"] for p in ps)


def timed(cmd, env=None, stdin=None) -> tuple[float, bytes]:
    t = time.monotonic()
    r = subprocess.run(cmd, input=stdin, capture_output=True, env={**os.environ, **(env or {})})
    dt = time.monotonic() - t
    if r.returncode:
        raise SystemExit(f"{cmd[0]}: exit {r.returncode}: {r.stderr[-500:]!r}")
    return dt, r.stdout


def measure(name: str, tmp: Path) -> None:
    spec = tmp / "all.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "*"\n')
    work = tmp / name
    work.mkdir()
    if name == "sqlite3":
        obj, cmd, stdin = LIBDIR / "libsqlite3.so.0", ["sqlite3", ":memory:"], SQL.encode()
    elif name == "crypto":
        data = work / "data"
        data.write_bytes(os.urandom(1 << 20) * 48)
        obj, cmd, stdin = LIBDIR / "libcrypto.so.3", ["openssl", "dgst", "-sha256", "-sha1", str(data)], None
    elif name == "stdcxx":
        src = work / "w.cc"
        src.write_text(CXX)
        subprocess.run(["g++", "-O2", "-o", str(work / "w"), str(src)], check=True)
        obj, cmd, stdin = LIBDIR / "libstdc++.so.6", [str(work / "w")], None
    elif name == "busybox":
        lines = work / "lines"
        lines.write_text("".join(f"{i * 7919 % 100003} line {i:x}\n" for i in range(300000)))
        obj, cmd, stdin = Path("/bin/busybox"), ["/bin/busybox", "sort", "-n", str(lines)], None
    else:
        raise SystemExit(f"unknown workload {name}")
    n, decisions = check(obj, spec)
    out = work / obj.name
    t = time.monotonic()
    subprocess.run([*KPREWRITE, "instrument", str(obj), "--spec", str(spec), "-o", str(out)],
                   check=True, env=ENV, capture_output=True)
    rewrite = time.monotonic() - t
    env_new: dict = {"KPREWRITE_PROFILE": str(work / "profile")}
    cmd_new = cmd
    if name == "busybox":
        cmd_new = [str(out), *cmd[1:]]
    else:
        env_new["LD_LIBRARY_PATH"] = str(work)
    a, b = [], []
    for _ in range(3):
        ta, oa = timed(cmd, None, stdin)
        (work / "profile").unlink(missing_ok=True)      # the runtime appends: keep the last run's
        tb, ob = timed(cmd_new, env_new, stdin)
        if oa != ob:
            raise SystemExit(f"{name}: output differs")
        a.append(ta)
        b.append(tb)
    hits = sum(int(l.split()[1]) for l in (work / "profile").read_text().splitlines()
               if len(l.split()) == 3 and l.split()[1].isdigit())
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"{name}: {obj} {n} entries, optimized {decisions['optimized']} "
          f"({100 * decisions['optimized'] / n:.1f}%), int3 {decisions['int3']}, refused {decisions['refused']}; "
          f"rewrite {rewrite:.1f} s; {' '.join(cmd[:2])}: {ma:.2f} s -> {mb:.2f} s ({mb / ma:.2f}x), "
          f"{hits} hits in the last run, output equal", flush=True)


def main() -> None:
    names = sys.argv[1:] or ["sqlite3", "busybox", "crypto", "stdcxx"]
    tmp = Path(tempfile.mkdtemp(prefix="kp-real-"))
    try:
        for name in names:
            measure(name, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
