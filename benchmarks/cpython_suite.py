#!/usr/bin/env python3
"""CPython's whole regression suite on a rewritten libpython.

Runs `python -m test -j2` (every test module; only --exclude left out; a per-test
timeout) with the interpreter that runs this script, against
  - original:  its own libpython3.11.so, unchanged;
  - entry:     libpython rewritten with a kprobe on every function entry
               (jump-optimized, INT3 where the optimizer refuses);
  - kretprobe: libpython rewritten with a kretprobe on every function,
one configuration after another (never in parallel: the machine is shared).
The rewritten library is loaded through LD_LIBRARY_PATH (the interpreter's
RUNPATH comes after it), which the suite's worker processes and most of its
subprocesses inherit; before each run the script checks that the interpreter
really maps the rewritten file and that its probes fire (KPREWRITE_PROFILE).

For each configuration it records the wall time, the suite's result line and
the sets it prints (failed, failed with an environment change, skipped, run no
tests, ...), and writes RESULTS/cpython_suite.json and RESULTS/cpython_suite.md:
the set of failing tests per configuration, whether it equals the original
library's, wall times and the slowdown.  A configuration killed by
--budget (or by hand) is written as such, with the time it ran: a partial
run is never reported as the whole.

Not part of CI: the whole suite takes from tens of minutes (original) to hours
(a kretprobe on every function).  Run it niced:

    nice -n 10 python3 benchmarks/cpython_suite.py [--configs original,entry,kretprobe]
        [--jobs 2] [--timeout 600] [--exclude T1,T2] [--budget SECONDS] [--stop-at HH:MM] [--start TEST] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KPREWRITE = [sys.executable, "-m", "rewriter"]
TREE_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
LIBPYTHON = (Path(sysconfig.get_config_var("LIBDIR")) / (sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY"))
             if sysconfig.get_config_var("Py_ENABLE_SHARED") else None)
SPECS = {"entry": '[[kprobe]]\nsymbol_name = "*"\n',
         "kretprobe": '[[kretprobe]]\nsymbol_name = "*"\n'}
# The suite's summary: "N tests failed:" (or "1 test failed:") then indented names.
SECTION = re.compile(r"^(\d+) tests? (.+?):$")
PROGRESS_FAIL = re.compile(r"^\d+:\d\d:\d\d load avg: [\d.]+ \[[ \d/]+\] (\S+) "
                           r"((?:failed|crashed|worker non-zero exit code|timed out).*?)(?: -- running.*)?$", re.M)


def rewrite(config: str, work: Path) -> tuple[Path, float]:
    """libpython rewritten for `config` into work/config/lib: (that folder, seconds)."""
    d = work / config
    lib = d / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    spec = d / "probes.toml"
    spec.write_text(SPECS[config])
    t = time.monotonic()
    r = subprocess.run([*KPREWRITE, "instrument", str(LIBPYTHON), "--spec", str(spec), "-o", str(lib / LIBPYTHON.name)],
                       capture_output=True, text=True, env=TREE_ENV)
    if r.returncode != 0:
        sys.exit(f"cpython_suite: rewriting {LIBPYTHON} for {config} failed:\n{r.stderr}")
    (d / "instrument.txt").write_text(r.stderr)
    return lib, time.monotonic() - t


def check_loaded(lib: Path, work: Path) -> int:
    """The interpreter maps lib's libpython and its probes fire: the number of profile rows."""
    prof = work / "loaded.prof"
    prof.unlink(missing_ok=True)
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib), KPREWRITE_PROFILE=str(prof))
    r = subprocess.run([sys.executable, "-c", "print(open('/proc/self/maps').read())"],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0 or str(lib / LIBPYTHON.name) not in r.stdout:
        sys.exit(f"cpython_suite: {sys.executable} does not load {lib / LIBPYTHON.name} "
                 f"(LD_LIBRARY_PATH): {r.stderr[-500:]}")
    rows = [l.split() for l in prof.read_text().splitlines()] if prof.exists() else []
    if not rows or sum(int(x[1]) for x in rows) == 0:
        sys.exit(f"cpython_suite: the probes of {lib / LIBPYTHON.name} did not fire")
    return len(rows)


def parse(stdout: str) -> dict:
    """The suite's summary: its result line and each section's test names."""
    out: dict = {"result": None, "sections": {}, "total_duration": None,
                 # Each test that did not pass, as its progress line says (also for a run stopped early).
                 "not_passed": {m.group(1): m.group(2).strip() for m in PROGRESS_FAIL.finditer(stdout)}}
    lines = stdout.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^Tests? result: (.+)$", line.strip("= "))
        if m:
            out["result"] = m.group(1)
        m = re.match(r"^Total duration: (.+)$", line)
        if m:
            out["total_duration"] = m.group(1)
        m = SECTION.match(line)
        if m and i + 1 < len(lines) and lines[i + 1].startswith("    "):
            names = []
            i += 1
            while i < len(lines) and lines[i].startswith("    "):
                names += lines[i].split()
                i += 1
            out["sections"][m.group(2)] = sorted(names)
            continue
        m = re.match(r"^(All )?(\d+) tests? OK\.?$", line)
        if m:
            out["ok"] = int(m.group(2))
        i += 1
    return out


def run_suite(config: str, lib: Path | None, work: Path, jobs: int, timeout: int, budget: float | None,
              exclude: list[str], start: str | None = None) -> dict:
    d = work / config
    d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.pop("KPREWRITE_PROFILE", None)
    env.pop("KPREWRITE_TRACE", None)
    if lib is not None:
        env["LD_LIBRARY_PATH"] = str(lib)
    cmd = [sys.executable, "-m", "test", f"-j{jobs}", f"--timeout={timeout}", "--tempdir", str(d / "tmp")]
    if start:               # resume a run stopped early: regrtest starts at this module of its order
        cmd += ["--start", start]
    if exclude:
        cmd += ["-x", *exclude]
    log = d / "regrtest.log"
    t = time.monotonic()
    # CPU time of the suite and its workers (each waited for by regrtest, so counted here once
    # regrtest is): less at the mercy of the machine's other tenants than the wall time.
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"cpython_suite: {config}: {' '.join(cmd)}  (log: {log})", flush=True)
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=d, start_new_session=True)
        killed = False
        try:
            p.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            killed = True
            # SIGINT: regrtest stops its workers (each in a session of its own) and prints
            # what it ran; SIGTERM would leave the workers running.
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    wall = time.monotonic() - t
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    text = log.read_text(errors="replace")
    res = parse(text)
    done = re.findall(r"^\s*\d+:\d\d:\d\d(?: load avg: [\d.]+)? \[\s*(\d+)/(\d+)", text, re.M)
    res.update(config=config, wall_s=round(wall, 1), cpu_s=round(cpu, 1), returncode=p.returncode, complete=not killed and res["result"] is not None,
               modules_done=f"{done[-1][0]}/{done[-1][1]}" if done else None, start=start)
    print(f"cpython_suite: {config}: {wall / 60:.1f} min, result {res['result']}, "
          f"{'complete' if res['complete'] else 'NOT complete'}", flush=True)
    return res


FAILING = ("failed", "failed again")


def failing(res: dict) -> list[str]:
    return sorted({n for k in FAILING for n in res["sections"].get(k, [])})


def report(results: dict, work: Path, meta: dict) -> str:
    base = results.get("original")
    rows = ["| configuration | complete | result | failing tests | equal to original | wall (min) | slowdown "
            "| CPU, user + sys (min) | CPU slowdown |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        f = failing(res)
        eq = "—" if name == "original" or not base or not base["complete"] or not res["complete"] else \
            ("yes" if f == failing(base) else "no")
        slow = (f"{res['wall_s'] / base['wall_s']:.2f}x" if base and base["complete"] and res["complete"] and name != "original"
                else "—")
        cpu_slow = (f"{res['cpu_s'] / base['cpu_s']:.2f}x" if base and base["complete"] and res["complete"]
                    and name != "original" and base.get("cpu_s") and res.get("cpu_s") else "—")
        cpu = f"{res['cpu_s'] / 60:.1f}" if res.get("cpu_s") is not None else "—"
        if not res["complete"]:
            f = sorted(res.get("not_passed", {}))
        shown = ", ".join(f) or "none"
        if not res["complete"]:
            shown = f"so far: {shown}"
        done = 'yes' if res['complete'] else 'no (' + str(res.get('modules_done')) + ' modules)'
        if res.get("start"):
            done += f", from {res['start']} on"
        rows.append(f"| {name} | {done} "
                    f"| {res['result'] or 'stopped'} | {shown} | {eq} | {res['wall_s'] / 60:.1f} | {slow} | {cpu} | {cpu_slow} |")
    lines = [f"CPython regression suite (`{' '.join(meta['command'])}`), {meta['python']}, "
             f"{meta['machine']}, {meta['date']}", "", *rows, ""]
    for name, res in results.items():
        why = res.get("not_passed", {})
        if why:
            lines.append(f"- {name}, how each failed: " + "; ".join(f"{t} {w}" for t, w in sorted(why.items())))
        for k, v in sorted(res["sections"].items()):
            if k not in FAILING:
                lines.append(f"- {name}: {len(v)} {k}")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="original,entry,kretprobe")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=600, help="per-test timeout of the suite, seconds")
    ap.add_argument("--exclude", default="", help="comma-separated test names left out of every configuration "
                    "(only tests the original library cannot run on this machine)")
    ap.add_argument("--budget", type=float, default=None, help="stop a configuration after this many seconds")
    ap.add_argument("--stop-at", default=None, help="HH:MM UTC: stop whatever runs then (a deadline)")
    ap.add_argument("--start", default=None, help="run the suite from this test module on (regrtest --start): "
                    "resumes a run stopped early; the report says the run began there")
    ap.add_argument("--out", type=Path, default=Path("cpython_suite_results"))
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: re-read the configurations' logs in --out and rewrite the report")
    a = ap.parse_args()
    if LIBPYTHON is None:
        sys.exit(f"cpython_suite: {sys.executable} has no shared libpython")
    exclude = [x for x in a.exclude.split(",") if x]
    work = a.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    meta = {"python": f"{sys.executable} {platform.python_version()} ({LIBPYTHON})",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at start",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": ["python", "-m", "test", f"-j{a.jobs}", f"--timeout={a.timeout}"] + (["-x", *exclude] if exclude else [])}
    out_json = work / "cpython_suite.json"
    results = json.loads(out_json.read_text())["results"] if out_json.exists() else {}
    if a.report_only:       # re-read every configuration's log (one stopped by hand too) and rewrite the report
        if out_json.exists():
            meta = json.loads(out_json.read_text())["meta"]
        for config in a.configs.split(","):
            log = work / config / "regrtest.log"
            if not log.exists():
                continue
            res = results.get(config, {"config": config, "wall_s": None, "returncode": None})
            text = log.read_text(errors="replace")
            res.update(parse(text))
            done = re.findall(r"^\s*(\d+):(\d\d):(\d\d)(?: load avg: [\d.]+)? \[\s*(\d+)/(\d+)", text, re.M)
            res["complete"] = res["result"] is not None
            if done:
                res["modules_done"] = f"{done[-1][3]}/{done[-1][4]}"
                if res.get("wall_s") is None:
                    h, m_, s_ = map(int, done[-1][:3])
                    res["wall_s"] = float(h * 3600 + m_ * 60 + s_)
            results[config] = res
        out_json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        (work / "cpython_suite.md").write_text(report(results, work, meta))
        print((work / "cpython_suite.md").read_text())
        return
    for config in a.configs.split(","):
        lib = None
        if config != "original":
            lib, secs = rewrite(config, work)
            rows = check_loaded(lib, work)
            print(f"cpython_suite: {config}: rewritten in {secs:.0f} s, {rows} probes fire", flush=True)
        budget = a.budget
        if a.stop_at:
            h, m = map(int, a.stop_at.split(":"))
            now = time.time()
            stop = time.mktime(time.gmtime(now)[:3] + (h, m, 0, 0, 0, 0)) - time.timezone
            budget = min(budget or float("inf"), max(0.0, stop - now))
        results[config] = run_suite(config, lib, work, a.jobs, a.timeout, budget, exclude, a.start)
        if config != "original":
            results[config]["rewrite_s"] = round(secs, 1)
        out_json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        (work / "cpython_suite.md").write_text(report(results, work, meta))
    print((work / "cpython_suite.md").read_text())


if __name__ == "__main__":
    main()
