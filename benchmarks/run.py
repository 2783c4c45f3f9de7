#!/usr/bin/env python3
"""Benchmarks: per-hit cost of probes, the seeds' overhead table.

Row "o": an optimized kprobe with an empty pre_handler on a trivial function
called in a tight loop; (rewritten - original) / N, medians of several runs of
both binaries interleaved in one go.  Rows "r" and "ro": a kretprobe on the
same function, return hooks jump-optimized (kprewrite has no unoptimized
kretprobe yet), with an empty return handler ("r") and with empty entry and
return handlers ("ro").  Linux uretprobes are not measured: that needs tracefs
(root, debugfs mounted), which these machines do not give.
Run: python benchmarks/run.py
"""
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
N = int(os.environ.get("BENCH_N", 50_000_000))
RUNS = int(os.environ.get("BENCH_RUNS", 7))


def build(tmp: Path) -> Path:
    exe = tmp / "loop"
    subprocess.run(["gcc", "-O2", str(HERE / "loop.c"), "-o", str(exe)], check=True)
    return exe


def rewrite(exe: Path, spec: str, out: Path) -> Path:
    subprocess.run(["kprewrite", "instrument", str(exe), "--spec", str(HERE / spec), "-o", str(out)], check=True)
    return out


def time_ns(exe: Path) -> float:
    r = subprocess.run([str(exe), str(N)], capture_output=True, text=True, check=True)
    return float(r.stdout.split()[0])


def cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main():
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        orig = build(tmp)
        rows = {"o": rewrite(orig, "optimized.toml", tmp / "loop.o"),
                "r": rewrite(orig, "return.toml", tmp / "loop.r"),
                "ro": rewrite(orig, "return_entry.toml", tmp / "loop.ro")}
        times = {"original": [], **{k: [] for k in rows}}
        for _ in range(RUNS):
            times["original"].append(time_ns(orig))
            for k, exe in rows.items():
                times[k].append(time_ns(exe))
        base = statistics.median(times["original"])
        print(f"machine: {cpu()}, {os.cpu_count()} CPUs; N = {N:,} calls, {RUNS} runs each, medians")
        print()
        print("| row | what | per call, original (ns) | per call, rewritten (ns) | per hit (ns) | ratio |")
        print("|---|---|---|---|---|---|")
        what = {"o": "optimized kprobe, empty pre_handler",
                "r": "kretprobe, empty handler",
                "ro": "optimized kretprobe, empty entry_handler and handler"}
        for k in rows:
            m = statistics.median(times[k])
            print(f"| {k} | {what[k]} | {base / N:.2f} | {m / N:.2f} | {(m - base) / N:.2f} | {m / base:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
