#!/usr/bin/env python3
"""Whole-kernel instrument benchmark (issue 10, "Benchmarks", third bullet): `instrument` with a
probe on every function entry of Debian's cloud vmlinux (`symbol_name = "*"`, no handler: the
probes only count hits), then, if it writes a kernel, one boot of it to user space under
qemu-system-x86_64 -smp 2 (TCG), as tests/kernel boot theirs.

Everything we add lives in the text/rodata gap (PFN_ALIGN(_etext) .. __start_rodata), so the
output also shows what the probes need there, part by part, read from the linked runtime that
KPREWRITE_KEEP keeps (whether or not it fits): the detours (our code before the runtime), the
runtime's code, and its tables (struct kprobe per probe, per-site records, the per-CPU pool of
hit counters, strings).

Run: python3 benchmarks/kernel_every_entry.py [--keep DIR]   (fetches the kernel like tests/kernel do)
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elftools.elf.elffile import ELFFile

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests" / "kernel"))
sys.path.insert(0, str(ROOT))
import kernel_env  # noqa: E402

KiB = 1024


def gap(vmlinux: Path) -> tuple[int, int]:
    from rewriter.image import Image
    from rewriter.targets import linux_kernel
    image = Image(str(vmlinux))
    linux_kernel.load_symbols(image)
    lay = linux_kernel.plan_layout(image)
    return lay.rx_vaddr, lay.end


def breakdown(keep: Path, gap_start: int, gap_end: int) -> None:
    """What the probes need in the gap, from the kept link (kp.ld, blob.elf, kp_table.o)."""
    m = re.search(r"^\s*\. = (0x[0-9a-f]+);", (keep / "kp.ld").read_text(), re.M)
    text_addr = int(m.group(1), 16)
    table_c = (keep / "kp_table.c").read_text()
    nprobes = int(re.search(r"struct kprobe kp_probes\[(\d+)\]", table_c).group(1))
    with open(keep / "blob.elf", "rb") as f:
        secs = {s.name: (s["sh_addr"], s["sh_size"]) for s in ELFFile(f).iter_sections() if s["sh_flags"] & 2}
        end = max(a + sz for a, sz in secs.values())
    with open(keep / "kp_table.o", "rb") as f:
        elf = ELFFile(f)
        syms = {s.name: (elf.get_section(s["st_shndx"]).name, s["st_size"])
                for s in elf.get_section_by_name(".symtab").iter_symbols()
                if s.name.startswith("kp_") and s["st_size"] and isinstance(s["st_shndx"], int)}
        strings = sum(s["sh_size"] for s in elf.iter_sections() if s.name.startswith(".rodata.str"))
    print(f"  the gap: {gap_start:#x}..{gap_end:#x} = {(gap_end - gap_start) // KiB} KiB; "
          f"needed: {(end - gap_start) // KiB} KiB for {nprobes} probes (the runtime's boot and shutdown hooks included)")
    rows = [("detours (jumps' targets, before the runtime)", text_addr - gap_start)]
    rows += [(f"runtime {name}", sz) for name, (_, sz) in secs.items()]
    for name in ("kp_kernel_pool", "kp_probes", "kp_sites", "kp_site_probes"):
        if name in syms:
            rows.append((f"  table {name} (in {syms[name][0]})", syms[name][1]))
    rows.append(("  strings: symbol and probe names (in .rodata)", strings))
    for what, sz in rows:
        print(f"  {what:48s} {sz // KiB:8d} KiB  {sz / nprobes:7.1f} B/probe")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keep", metavar="DIR", help="keep the spec, the kept link and the output in DIR")
    args = ap.parse_args()
    k = kernel_env.obtain_kernel()
    print(f"kernel: {k.release} ({k.package} {k.version}); machine: {os.cpu_count()} CPUs (shared), "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kp-every-"))
    work.mkdir(parents=True, exist_ok=True)
    spec = work / "every-entry.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "*"\n')
    out = work / "vmlinux.kp"
    keep = work / "link"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KPREWRITE_KEEP": str(keep)}
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "rewriter", "instrument", str(k.vmlinux), "--spec", str(spec),
                        "-o", str(out)], capture_output=True, text=True, env=env)
    wall = time.monotonic() - t
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / KiB / KiB
    print(f"instrument, symbol_name = \"*\": exit {r.returncode}, {wall:.0f} s wall, peak RSS {peak:.2f} GiB")
    for line in (r.stderr.strip().splitlines() or ["(nothing on standard error)"]):
        print(f"  says: {line}")
    if (keep / "kp.ld").exists():
        breakdown(keep, *gap(k.vmlinux))
    if r.returncode == 0:
        init = kernel_env.init_script("cat /proc/version\ngrep -c . /sys/kernel/debug/kprobes/list || true\n")
        b = kernel_env.boot(out, kernel_env.build_initramfs(init), smp=2, timeout=900, log=work / "console.txt")
        print(f"boot: {b.seconds:.0f} s, {b.accel}; user space reached: {b.reached()}; /init finished: "
              f"{b.reached(kernel_env.DONE_MARKER)}; W+X check passed: {kernel_env.WX_PASSED in b.console}; "
              f"clean power-off: {b.powered_off}; problems: {b.problems()[:5]}")
        if not b.reached():
            print(b.tail(30))
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
