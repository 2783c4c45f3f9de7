#!/usr/bin/env python3
"""Whole-kernel benchmark: `kprewrite check` with a probe on every function of Debian's
cloud vmlinux (`symbol_name = "*"`): wall time, peak memory, and how many entries are
`ftrace` / `optimized` / refused (by check), side by side with what the running kernel
itself lets kprobes use, read in one boot of the same, unmodified kernel
(`available_filter_functions`, debugfs `kprobes/blacklist`).

Run: python benchmarks/kernel_check.py   (fetches the kernel like tests/kernel do)
"""
import collections
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests" / "kernel"))
import kernel_env  # noqa: E402


def check_everything(vmlinux: Path, cold: bool) -> tuple[float, int, collections.Counter, collections.Counter]:
    with tempfile.TemporaryDirectory() as d:
        spec = Path(d) / "all.toml"
        spec.write_text('[[kprobe]]\nsymbol_name = "*"\n')
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if cold:
            env["KPREWRITE_CACHE"] = str(Path(d) / "cache")
        t = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "rewriter", "check", str(vmlinux), "--spec", str(spec)],
                           capture_output=True, text=True, env=env)
        wall = time.monotonic() - t
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    decisions, refusals = collections.Counter(), collections.Counter()
    for line in r.stdout.splitlines():
        parts = line.split("  ")
        decisions[parts[2]] += 1
        if parts[2] == "refused":
            why = parts[3]
            m = re.search(r"is blacklisted: (.*) \([^)]*\)$", why)
            refusals[m.group(1) if m else why.split(" at 0x")[0] if " at 0x" in why else why[:60]] += 1
    return wall, peak_kib, decisions, refusals


def kernel_own_counts(k) -> dict[str, int]:
    init = kernel_env.init_script(
        'echo "== filter"; grep -c . /sys/kernel/tracing/available_filter_functions\n'
        'echo "== blacklist"; grep -c . /sys/kernel/debug/kprobes/blacklist\n')
    r = kernel_env.boot(k.vmlinux, kernel_env.build_initramfs(init), smp=2, timeout=180)
    s = kernel_env.sections(r.between())
    return {"available_filter_functions": int(s["filter"][0]), "kprobes/blacklist": int(s["blacklist"][0])}


def main():
    k = kernel_env.obtain_kernel()
    print(f"kernel: {k.release}  ({k.vmlinux})")
    print(f"machine: {os.cpu_count()} CPUs, {os.uname().machine}, Python {sys.version.split()[0]}")
    for cold in (True, False):
        wall, peak, decisions, refusals = check_everything(k.vmlinux, cold)
        print(f"check * ({'cold cache' if cold else 'warm cache'}): {wall:.1f} s wall, peak RSS {peak / 1024:.0f} MiB")
    total = sum(decisions.values())
    print(f"function entries: {total}; " + ", ".join(f"{d} {n}" for d, n in decisions.most_common()))
    for why, n in refusals.most_common(12):
        print(f"  refused {n:6d}  {why}")
    own = kernel_own_counts(k)
    print("the running kernel: " + ", ".join(f"{name} {n}" for name, n in own.items()))


if __name__ == "__main__":
    main()
