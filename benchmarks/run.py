#!/usr/bin/env python3
"""Benchmarks: per-hit cost of probes, the seeds' overhead table.

Row "o": an optimized kprobe with an empty pre_handler on a trivial function
called in a tight loop; (rewritten - original) / N, medians of several runs of
both binaries interleaved in one go.  Row "o+regs": the same with a
pre_handler that reads a register: it only loads from regs, so the detour stores
that field of a partial struct pt_regs (the whole one for a handler that writes it).
Row "c": the same probe with no handler at all (it only counts hits: a
light hit, the form of every probe in an image without handlers).

Rows "b" and "k" (breakpoint probes, --no-optimize): "b" on the same function,
whose first instruction is boosted; "k" on a function whose first instruction
is single-stepped.  Each hit costs a SIGTRAP (two for "k"), so they run
N_TRAP calls.  Row "u": a Linux uprobe (tracefs uprobe_events) on the same
function as "b", when tracefs is mounted and writable; skipped with a note
otherwise.

Rows "r" and "ro": a kretprobe on the same function, return hooks
jump-optimized, with an empty return handler ("r") and with empty entry and
return handlers ("ro").  Row "ur": a Linux uretprobe on the same function,
when tracefs allows, like row "u".

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
# This tree's CLI, not whatever `kprewrite` comes first on PATH (another checkout).
KPREWRITE = [sys.executable, "-m", "rewriter"]
TREE_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
N = int(os.environ.get("BENCH_N", 50_000_000))
RUNS = int(os.environ.get("BENCH_RUNS", 7))
N_TRAP = int(os.environ.get("BENCH_N_TRAP", 100_000))
N_T = max(1, N // 100)                    # row t: a trace line costs microseconds
TRACEFS = Path("/sys/kernel/tracing")


def build(tmp: Path) -> Path:
    exe = tmp / "loop"
    subprocess.run(["gcc", "-O2", str(HERE / "loop.c"), "-o", str(exe)], check=True)
    return exe


def rewrite(exe: Path, spec: str, out: Path, *extra: str) -> Path:
    subprocess.run([*KPREWRITE, "instrument", str(exe), "--spec", str(HERE / spec), "-o", str(out), *extra],
                   check=True, env=TREE_ENV)
    return out


ROW_ENV = {"t": {"KPREWRITE_TRACE": "/dev/null"}}


def time_ns(exe: Path, n: int = N, *args: str, env: dict | None = None) -> float:
    e = dict(os.environ, **(env or {}))
    r = subprocess.run([str(exe), str(n), *args], capture_output=True, text=True, check=True, env=e)
    return float(r.stdout.split()[0])


def _append(path: Path, line: str):
    # tracefs files refuse the seek that Python's append mode does.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class Uprobe:
    """A uprobe (ret: a uretprobe) on `target` through tracefs, enabled only while timing."""
    def __init__(self, exe: Path, ret: bool = False):
        self.exe = exe
        self.event = "target_ret" if ret else "target"
        self.kind = "r" if ret else "p"
        self.ok, self.note = False, ""
        events = TRACEFS / "uprobe_events"
        if not events.exists():
            self.note = f"{events} not found (tracefs not mounted; as root: mount -t tracefs nodev {TRACEFS})"
            return
        off = None
        for line in subprocess.run(["nm", str(exe)], capture_output=True, text=True).stdout.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[2] == "target":
                off = int(parts[0], 16)
        try:
            _append(events, f"{self.kind}:kprewrite_bench/{self.event} {exe}:{off:#x}\n")
            self.ok = True
        except OSError as e:
            self.note = f"cannot add a uprobe: {e.strerror}"

    def _enable(self, on: bool):
        (TRACEFS / f"events/kprewrite_bench/{self.event}/enable").write_text("1" if on else "0")

    def time_ns(self, n: int) -> float:
        self._enable(True)
        try:
            return time_ns(self.exe, n)
        finally:
            self._enable(False)

    def close(self):
        if self.ok:
            _append(TRACEFS / "uprobe_events", f"-:kprewrite_bench/{self.event}\n")
            (TRACEFS / "trace").write_text("")


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
        # row -> (binary, calls, extra arguments, its baseline)
        rows = {
            "o": (rewrite(orig, "optimized.toml", tmp / "loop.o"), N, (), "original"),
            "o+regs": (rewrite(orig, "regs.toml", tmp / "loop.regs"), N, (), "original"),
            "c": (rewrite(orig, "count.toml", tmp / "loop.count"), N, (), "original"),
            "b": (rewrite(orig, "optimized.toml", tmp / "loop.b", "--no-optimize"), N_TRAP, (), "original-trap"),
            "k": (rewrite(orig, "singlestep.toml", tmp / "loop.k", "--no-optimize"), N_TRAP, ("ss",), "original-ss"),
            "r": (rewrite(orig, "return.toml", tmp / "loop.r"), N, (), "original"),
            "ro": (rewrite(orig, "return_entry.toml", tmp / "loop.ro"), N, (), "original"),
            "t": (rewrite(orig, "trace.toml", tmp / "loop.t"), N_T, (), "original-t"),
        }
        bases = {"original": (N, ()), "original-trap": (N_TRAP, ()), "original-ss": (N_TRAP, ("ss",)),
                 "original-t": (N_T, ())}
        up = Uprobe(orig)
        urp = Uprobe(orig, ret=True)
        times = {k: [] for k in [*bases, *rows, "u", "ur"]}
        try:
            for _ in range(RUNS):
                for k, (n, args) in bases.items():
                    times[k].append(time_ns(orig, n, *args))
                for k, (exe, n, args, _) in rows.items():
                    times[k].append(time_ns(exe, n, *args, env=ROW_ENV.get(k)))
                if up.ok:
                    times["u"].append(up.time_ns(N_TRAP))
                if urp.ok:
                    times["ur"].append(urp.time_ns(N_TRAP))
        finally:
            up.close()
            urp.close()
        print(f"machine: {cpu()}, {os.cpu_count()} CPUs; N = {N:,} calls (b, k, u: {N_TRAP:,}; t: {N_T:,}), "
              f"{RUNS} runs each, medians")
        print()
        print("| row | what | per call, original (ns) | per call, rewritten (ns) | per hit (ns) | ratio |")
        print("|---|---|---|---|---|---|")
        what = {"o": "optimized kprobe, empty pre_handler (clean call, dispatch inlined)",
                "o+regs": "optimized kprobe, pre_handler reading regs (partial pt_regs: the field read)",
                "c": "optimized kprobe, no handler (counts only: light hit)",
                "b": "breakpoint kprobe, boosted, empty pre_handler",
                "k": "breakpoint kprobe, single-stepped, empty pre_handler",
                "r": "kretprobe, empty handler",
                "ro": "optimized kretprobe, empty entry_handler and handler",
                "t": "kprobe_events line, 1 fetch arg, trace line to /dev/null",
                "u": "Linux uprobe (tracefs event) on the function of row b",
                "ur": "Linux uretprobe (tracefs event) on the same function (compare with r, ro)"}
        if up.ok:
            rows["u"] = (None, N_TRAP, (), "original-trap")
        if urp.ok:
            rows["ur"] = (None, N_TRAP, (), "original-trap")
        for k, (_, n, _, b) in rows.items():
            base = statistics.median(times[b])
            m = statistics.median(times[k])
            print(f"| {k} | {what[k]} | {base / n:.2f} | {m / n:.2f} | {(m - base) / n:.2f} | {m / base:.2f}x |")
        for name, u in (("u", up), ("ur", urp)):
            if not u.ok:
                print()
                print(f"Row {name} skipped: {u.note}.")


if __name__ == "__main__":
    sys.exit(main())
