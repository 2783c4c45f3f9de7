"""Real libraries from Debian's packages with a probe on every function entry
(issue 15's table): how many entries are jump-optimized, and how much slower a
real workload runs.

    python3 benchmarks/real_libs.py [--runs N] [--compare TREE] [NAME ...]   (sqlite3 busybox crypto stdcxx)

Each workload runs on the original and on the rewritten object (a library
through LD_LIBRARY_PATH, busybox itself), 3 interleaved runs each, medians of
wall time and of CPU time (user + sys); the outputs must be equal.  The probes
carry no handler (they count hits).  --compare TREE (repeatable) also rewrites
the object with the kprewrite of another source tree (another branch's
checkout) and runs it in the same rounds.  The load average is printed before and after: the
machine may be shared."""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import subprocess
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


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(cmd, env=None, stdin=None) -> tuple[float, float, bytes]:
    """(wall seconds, user + sys seconds, stdout) of one run."""
    t, c = time.monotonic(), _cpu()
    r = subprocess.run(cmd, input=stdin, capture_output=True, env={**os.environ, **(env or {})})
    dt, dc = time.monotonic() - t, _cpu() - c
    if r.returncode:
        raise SystemExit(f"{cmd[0]}: exit {r.returncode}: {r.stderr[-500:]!r}")
    return dt, dc, r.stdout


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def measure(name: str, tmp: Path, runs: int = 3, compare: list[Path] = ()) -> None:
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
    trees = {"this": ROOT, **{f"{i + 1}:{t.name}": t for i, t in enumerate(compare)}}
    variants = {}                   # label -> (cmd, env, profile)
    rewrite = 0.0
    for label, tree in trees.items():
        d = work / label.replace(":", "-")
        d.mkdir()
        out = d / obj.name
        t = time.monotonic()
        subprocess.run([*KPREWRITE, "instrument", str(obj), "--spec", str(spec), "-o", str(out)],
                       check=True, env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True, cwd=tree)
        if tree == ROOT:
            rewrite = time.monotonic() - t
        env_new: dict = {"KPREWRITE_PROFILE": str(d / "profile")}
        cmd_new = cmd
        if name == "busybox":
            cmd_new = [str(out), *cmd[1:]]
        else:
            env_new["LD_LIBRARY_PATH"] = str(d)
        variants[label] = (cmd_new, env_new, d / "profile")
    wall = {k: [] for k in ["orig", *variants]}
    cpu = {k: [] for k in wall}
    before = load()
    for _ in range(runs):
        ta, ca, oa = timed(cmd, None, stdin)
        wall["orig"].append(ta)
        cpu["orig"].append(ca)
        for label, (cmd_new, env_new, profile) in variants.items():
            profile.unlink(missing_ok=True)      # the runtime appends: keep the last run's
            tb, cb, ob = timed(cmd_new, env_new, stdin)
            if oa != ob:
                raise SystemExit(f"{name}: output differs ({label})")
            wall[label].append(tb)
            cpu[label].append(cb)
    hits = {label: sum(int(l.split()[1]) for l in profile.read_text().splitlines()
                       if len(l.split()) == 3 and l.split()[1].isdigit())
            for label, (_, _, profile) in variants.items()}
    med = lambda xs: statistics.median(xs)  # noqa: E731
    wa, ca = med(wall["orig"]), med(cpu["orig"])
    print(f"{name}: {obj} {n} entries, optimized {decisions['optimized']} "
          f"({100 * decisions['optimized'] / n:.1f}%), int3 {decisions['int3']}, refused {decisions['refused']}; "
          f"rewrite {rewrite:.1f} s; {' '.join(cmd[:2])}, load {before} -> {load()}, output equal", flush=True)
    for label in variants:
        wb, cb = med(wall[label]), med(cpu[label])
        per_hit = lambda a, b: 1e9 * (b - a) / hits[label] if hits[label] else 0.0  # noqa: E731
        print(f"  {label:12} wall {wa:.2f} s -> {wb:.2f} s ({wb / wa:.2f}x, {per_hit(wa, wb):.1f} ns/hit); "
              f"user+sys {ca:.2f} s -> {cb:.2f} s ({cb / ca:.2f}x, {per_hit(ca, cb):.1f} ns/hit); "
              f"{hits[label]} hits in the last run; best user+sys {min(cpu['orig']):.2f} s -> "
              f"{min(cpu[label]):.2f} s ({min(cpu[label]) / min(cpu['orig']):.2f}x)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=["sqlite3", "busybox", "crypto", "stdcxx"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--compare", type=Path, action="append", default=[],
                    help="another kprewrite source tree, run in the same rounds (repeatable)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kp-real-"))
    try:
        for name in args.names:
            measure(name, tmp, args.runs, [t.resolve() for t in args.compare])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
