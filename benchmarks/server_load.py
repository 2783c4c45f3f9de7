"""A multi-threaded server under load (issue 41, section 2): Debian's memcached and
tests/test_server_load.py's load (16 clients, 52,800 requests, every reply checked),
on the original and on the four rewrites of that test (a kprobe, a kretprobe without
and with a handler, and a function graph traced to a binary trace, each on every
function).

    python3 benchmarks/server_load.py [--runs N]

Each round runs the original and every rewrite one after the other (the original
first in even rounds and last in odd ones).  A run's throughput is the requests over
the load's wall time; its CPU is the server's own user + sys (/proc/PID/stat, read
before SIGTERM).  The table gives, per rewrite, the median over rounds of the paired
ratios (the rewrite's run over the original's of the same round) with their range:
throughput (above 1: faster) and server CPU (above 1: more).  On a shared 2-core
machine the load generator's 16 threads and the server's 4 share the cores, so the
wall time moves with the other tenants; the CPU ratio is the steadier figure."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])

import test_server_load as T                      # noqa: E402
from conftest import cc, instrument, write_spec    # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kprewrite-server-"))
    mc = T._memcached()
    prog = tmp / "memcached"
    prog.write_bytes(mc.read_bytes())
    prog.chmod(0o755)
    load = cc(tmp, "load", T.LOAD.read_text(), "-O2", "-pthread")
    binaries = {"original": (prog, {})}
    for name, (text, handlers) in T.SPECS.items():
        d = tmp / name.replace("+", "_")
        d.mkdir()
        env = {"KPREWRITE_PROFILE": str(d / "profile")}
        if name == "function_graph":
            env.update(KPREWRITE_TRACE=str(d / "trace"), KPREWRITE_TRACE_FORMAT="binary")
        binaries[name] = (instrument(prog, write_spec(d, text, handlers), d / "memcached.kp"), env)
    requests = T.CLIENTS * T.ROUNDS * (1 + T.GETS)
    results = {n: [] for n in binaries}
    for r in range(args.runs):
        order = list(binaries) if r % 2 == 0 else list(binaries)[1:] + ["original"]
        for name in order:
            b, env = binaries[name]
            if "KPREWRITE_TRACE" in env:
                Path(env["KPREWRITE_TRACE"]).unlink(missing_ok=True)
            got = T.serve(b, load, T.CLIENTS, T.ROUNDS, T.GETS, env)
            assert got["status"] == 0, got["stderr"]
            results[name].append(got)
        print(f"round {r + 1}: " + ", ".join(f"{n} {results[n][-1]['seconds']:.2f} s" for n in binaries),
              file=sys.stderr)
    base = results["original"]
    print(f"| server | throughput (requests/s) | vs original, median (range) | server CPU (user + sys) "
          f"| vs original, median (range) |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        tput = statistics.median(requests / g["seconds"] for g in runs)
        cpu = statistics.median(g["cpu"] for g in runs)
        if name == "original":
            print(f"| memcached: original | {tput:,.0f} | 1× | {cpu:.2f} s | 1× |")
            continue
        tr = [b["seconds"] / g["seconds"] for b, g in zip(base, runs)]
        cr = [g["cpu"] / max(b["cpu"], 0.01) for b, g in zip(base, runs)]
        print(f"| memcached: {name} | {tput:,.0f} | **{statistics.median(tr):.3f}×** ({min(tr):.2f}–{max(tr):.2f}) "
              f"| {cpu:.2f} s | **{statistics.median(cr):.2f}×** ({min(cr):.2f}–{max(cr):.2f}) |")
    print(f"load: {os.getloadavg()[0]:.1f}", file=sys.stderr)


if __name__ == "__main__":
    main()
