#!/usr/bin/env python3
"""Benchmarks: per-hit cost of probes, the seeds' overhead table.

Row "o": an optimized kprobe with an empty pre_handler on a trivial function
called in a tight loop; (rewritten - original) / N, medians of several runs of
both binaries interleaved in one go.  Row "o+regs": the same with a
pre_handler that reads a register, so the detour builds struct pt_regs.
Row "t": the same probe as a kprobe_events line with one fetch arg, each hit
writing a trace line to /dev/null (N / 100 calls: a trace line costs
microseconds, not nanoseconds).
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


ROW_N = {"t": max(1, N // 100)}           # calls per run, if not N
ROW_ENV = {"t": {"KPREWRITE_TRACE": "/dev/null"}}


def time_ns(exe: Path, n: int = N, env: dict | None = None) -> float:
    e = dict(os.environ, **(env or {}))
    r = subprocess.run([str(exe), str(n)], capture_output=True, text=True, check=True, env=e)
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
                "o+regs": rewrite(orig, "regs.toml", tmp / "loop.regs"),
                "t": rewrite(orig, "trace.toml", tmp / "loop.t")}
        times = {"original": [], **{k: [] for k in rows}}
        base_n = {}                      # the original, timed with each row's N
        for _ in range(RUNS):
            times["original"].append(time_ns(orig))
            for k, exe in rows.items():
                if k in ROW_N:
                    base_n.setdefault(k, []).append(time_ns(orig, ROW_N[k]))
                times[k].append(time_ns(exe, ROW_N.get(k, N), ROW_ENV.get(k)))
        base = statistics.median(times["original"])
        print(f"machine: {cpu()}, {os.cpu_count()} CPUs; N = {N:,} calls, {RUNS} runs each, medians")
        print()
        print("| row | what | per call, original (ns) | per call, rewritten (ns) | per hit (ns) | ratio |")
        print("|---|---|---|---|---|---|")
        what = {"o": "optimized kprobe, empty pre_handler (clean call, dispatch inlined)",
                "o+regs": "optimized kprobe, pre_handler reading regs (full struct pt_regs)",
                "t": "kprobe_events line, 1 fetch arg, trace line to /dev/null"}
        for k in rows:
            n = ROW_N.get(k, N)
            b = statistics.median(base_n[k]) if k in base_n else base
            m = statistics.median(times[k])
            print(f"| {k} | {what[k]} | {b / n:.2f} | {m / n:.2f} | {(m - b) / n:.2f} | {m / b:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
