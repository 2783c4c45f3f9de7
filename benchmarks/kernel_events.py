#!/usr/bin/env python3
"""Kernel benchmark: the cost of a trace event hit, ours (an `events` line, each hit a line in the
kernel's ftrace ring buffer) and the running kernel's own tracefs kprobe event, side by side in the
same boot (kprobe_events in the kernel).

Run: python3 benchmarks/kernel_events.py [--modes icount,tcg] [-n N] [--reps R] [--warmup W] [--keep DIR]

The harness is benchmarks/kernel_probes.py's (its docstring says what is measured and how): the
same twin system calls, loop program, boots and analysis.  Only ours differ: `events` lines with no
fetch args on __do_sys_getuid (its ftrace site) and __do_sys_geteuid+0xe (jump-optimized), with
their default names (p___do_sys_getuid_0, p___do_sys_geteuid_14, as the profile check reads them);
and the kernel's configurations are its tracefs events only (`p:bench __do_sys_getgid[+0xe]`, no
args), with tracing_on 1 throughout, since our lines go to the same ring buffer.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_probes as kpb  # noqa: E402

PHASES = ("none", "k-entry-event", "k-opt-event")


def rewrite(k, work: Path) -> Path:
    spec = work / "probes.toml"
    spec.write_text(f'events = ["p {kpb.TWINS[kpb.OURS_ENTRY]}", "p {kpb.TWINS[kpb.OURS_INSIDE]}+{kpb.INSIDE:#x}"]\n')
    plan = kpb.kprewrite("check", k.vmlinux, "--spec", spec).split("\n")
    want = [f"{kpb.TWINS[kpb.OURS_ENTRY]}+0x0  k  ftrace", f"{kpb.TWINS[kpb.OURS_INSIDE]}+{kpb.INSIDE:#x}  k  optimized"]
    if plan[:2] != want:
        sys.exit(f"kernel_events: check says {plan}, expected {want}")
    out = work / "vmlinux.kp"
    t = time.monotonic()
    kpb.kprewrite("instrument", k.vmlinux, "--spec", spec, "-o", out)
    print(f"kprewrite check: {'; '.join(plan[:2])}; instrument {time.monotonic() - t:.1f} s")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="icount", help="comma-separated: icount, tcg (default icount)")
    ap.add_argument("-n", type=int, default=20_000, help="system calls per timed loop")
    ap.add_argument("--reps", type=int, default=3, help="rounds per phase")
    ap.add_argument("--warmup", type=int, default=5_000, help="untimed calls before each loop")
    ap.add_argument("--keep", metavar="DIR", help="keep the rewritten kernel, spec and consoles in DIR")
    args = ap.parse_args()
    t_start = time.monotonic()
    k = kpb.kernel_env.obtain_kernel()
    qemu = kpb.sh(["qemu-system-x86_64", "--version"]).stdout.splitlines()[0]
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"kernel: {k.release} ({k.package} {k.version})")
    print(f"machine: {cpu}, {os.cpu_count()} CPUs (shared), {platform.machine()}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {qemu}")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kp-bench-events-"))
    work.mkdir(parents=True, exist_ok=True)
    kpb.check_twins(k.vmlinux)
    loop_bin = work / "syscall_loop"
    kpb.sh(["gcc", "-static", "-O2", "-Wall", "-o", str(loop_bin), str(kpb.LOOP_SRC)])
    kp = rewrite(k, work)
    phases = [ph for ph in kpb.PHASES if ph[0] in PHASES]
    files = {"bench": loop_bin}
    for mode in args.modes.split(","):
        n, reps, warmup = args.n, args.reps, args.warmup
        t = time.monotonic()
        calib = kpb.run_boot(k.vmlinux, phases[:1], n, reps, warmup, mode, files, work / f"unmodified-{mode}.console.txt")
        t1 = time.monotonic()
        r = kpb.run_boot(kp, phases, n, reps, warmup, mode, files, work / f"rewritten-{mode}.console.txt")
        t2 = time.monotonic()
        rows, notes, _ = kpb.analyse(kpb.parse(r), kpb.parse(calib), n, reps, warmup)
        rows = [(what.replace("empty pre_handler", "events line, ring buffer"), *rest) for what, *rest in rows]
        print(f"\n== QEMU mode: {mode}; calibration boot {t1 - t:.0f} s, benchmark boot {t2 - t1:.0f} s; "
              f"loops of N = {n} calls after {warmup} warm-up calls, {reps} rounds per phase, -smp 1")
        kpb.print_table(rows)
        kpb.check_ours(r, len(phases) * reps * (n + warmup), "p", kpb.INSIDE, notes)
    if not args.keep:
        shutil.rmtree(work)
    print(f"\ntotal {time.monotonic() - t_start:.0f} s")


if __name__ == "__main__":
    main()
