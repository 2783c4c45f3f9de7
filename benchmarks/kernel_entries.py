#!/usr/bin/env python3
"""Kernel benchmark: a probe on every function entry.

Run: python3 benchmarks/kernel_entries.py [--count N] [--timeout S]
     python3 benchmarks/kernel_entries.py --all [--timeout S]
     (fetches Debian's cloud kernel like tests/kernel do; needs gcc, qemu-system-x86, busybox-static)

--all: one `[[kprobe]] symbol_name = "*"` table with an empty pre_handler, every
function (ftrace sites, jump-optimized entries and breakpoint probes alike; what the rules
refuse is skipped, as for any glob): the decisions `check` gives, the space used of each gap,
then the same boot.

`instrument` with an empty pre_handler on the first N function entries that are ftrace sites
(in address order; by name, or by address where kallsyms gives the name to several
functions), and by default on every one.  When
the probes do not fit in the image's two gaps (text/rodata for code, rodata/data for data),
`instrument` says what they need; the script then searches (by bisection) the largest N that
fits.  The output is booted under qemu-system-x86_64 -smp 2 with no boot parameter: reaching
user space, the W+X check, power-off, and the kprobe_profile rows at power-off (probes hit,
hits, nmissed) are reported.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests" / "kernel"))
sys.path.insert(0, str(ROOT))
import kernel_env  # noqa: E402
from rewriter.elf.image import Image  # noqa: E402
from rewriter.targets import linux_kernel  # noqa: E402

HANDLER = "#include <linux/kprobes.h>\nint pre(struct kprobe *p, struct pt_regs *regs) { return 0; }\n"
NEED = re.compile(r"need (\d+) KiB of code and (\d+) KiB of data; the text/rodata gap has (\d+) KiB "
                  r"and the rodata/data gap (\d+) KiB")


def kprewrite(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "rewriter", *map(str, args)], capture_output=True, text=True, env=env)


def ftrace_entries(vmlinux: Path, d: Path) -> list[str]:
    """Every function entry `check` calls ftrace, in address order, as a spec line: by name
    where kallsyms names one function so, else (static functions sharing a name) by address."""
    spec = d / "all.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "*"\n')
    r = kprewrite("check", vmlinux, "--spec", spec, "--format", "json")
    image = Image(str(vmlinux))
    linux_kernel.load_symbols(image)
    count = collections.Counter(f.name for f in image.functions)
    out = []
    for p in json.loads(r.stdout)["probes"]:
        if p["decision"] == "ftrace" and p["offset"] == 0:
            out.append(f'symbol_name = "{p["symbol"]}"' if count[p["symbol"]] == 1 else f'addr = {p["address"]}')
    return out


def instrument(vmlinux: Path, d: Path, entries: list[str]) -> tuple[Path | None, str, float]:
    (d / "h.c").write_text(HANDLER)
    spec = d / "p.toml"
    spec.write_text('handlers = ["h.c"]\n' + "".join(f'[[kprobe]]\n{e}\npre_handler = "pre"\n' for e in entries))
    out = d / f"vmlinux.{len(entries)}"
    t = time.monotonic()
    r = kprewrite("instrument", vmlinux, "--spec", spec, "-o", out)
    return (out if r.returncode == 0 else None), r.stderr.strip(), time.monotonic() - t


def gap_use(vmlinux: Path, out: Path) -> str:
    """The space our sections take of each gap (the output's .kprewrite.text and .kprewrite.data)."""
    image = Image(str(vmlinux))
    linux_kernel.load_symbols(image)
    gap = linux_kernel.plan_layout(image)
    img = Image(str(out))
    text, data = img.section_named(".kprewrite.text"), img.section_named(".kprewrite.data")
    return (f"{text.size >> 10:,} of the {(gap.end - gap.rx_vaddr) >> 10:,} KiB text/rodata gap, "
            f"{data.size >> 10:,} of the {(gap.data_end - gap.data_vaddr) >> 10:,} KiB rodata/data gap")


def every_function(vmlinux: Path, d: Path) -> tuple[Path | None, str, float]:
    """instrument with `symbol_name = "*"` (an empty pre_handler); prints check's decisions."""
    (d / "h.c").write_text(HANDLER)
    spec = d / "star.toml"
    spec.write_text('handlers = ["h.c"]\n[[kprobe]]\nsymbol_name = "*"\npre_handler = "pre"\n')
    r = kprewrite("check", vmlinux, "--spec", spec, "--format", "json")
    probes = json.loads(r.stdout)["probes"]
    print(f"check, symbol_name = \"*\": {len(probes):,} function entries: "
          + ", ".join(f"{n:,} {k}" for k, n in collections.Counter(p["decision"] for p in probes).most_common()))
    out = d / "vmlinux.star"
    t = time.monotonic()
    r = kprewrite("instrument", vmlinux, "--spec", spec, "-o", out)
    return (out if r.returncode == 0 else None), r.stderr.strip(), time.monotonic() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, help="probe the first N ftrace entries (default: every one)")
    ap.add_argument("--all", action="store_true", help='symbol_name = "*": every function, not only ftrace sites')
    ap.add_argument("--timeout", type=int, default=600)
    a = ap.parse_args()
    k = kernel_env.obtain_kernel()
    with tempfile.TemporaryDirectory(prefix="kp-entries-") as tmp:
        d = Path(tmp)
        if a.all:
            out, err, secs = every_function(k.vmlinux, d)
            print(f"instrument: {'ok' if out else 'FAILED'} ({secs:.1f} s)\n{err}")
            if out is None:
                return 1
            print(f"space: {gap_use(k.vmlinux, out)}")
            return boot(out, a.timeout, "every function")
        names = ftrace_entries(k.vmlinux, d)
        n = min(a.count or len(names), len(names))
        print(f"kernel {k.release}: {len(names)} ftrace-site function entries ({sum(e.startswith('addr') for e in names)} by address: names kallsyms gives several functions)")
        out, err, secs = instrument(k.vmlinux, d, names[:n])
        print(f"instrument, {n} probes: {'ok' if out else err} ({secs:.1f} s)")
        if out is None and NEED.search(err):
            lo, hi = 0, n                    # lo fits (0 trivially), hi does not
            while hi - lo > 250:
                mid = (lo + hi) // 2 // 250 * 250 or 250
                o, e, s = instrument(k.vmlinux, d, names[:mid])
                print(f"instrument, {mid} probes: {'ok' if o else e} ({s:.1f} s)")
                lo, hi = (mid, hi) if o else (lo, mid)
                out = o if o else out
            n = lo
            if out is None or not out.name.endswith(f".{n}"):
                out, err, secs = instrument(k.vmlinux, d, names[:n])
        if out is None:
            print(err)
            return 1
        return boot(out, a.timeout, f"{n} probes")


def boot(out: Path, timeout: int, what: str) -> int:
    """Boot the output (-smp 2, no boot parameter) and report what the console shows."""
    initrd = kernel_env.build_initramfs(kernel_env.init_script("echo hello; ls / > /dev/null; cat /proc/version"))
    r = kernel_env.boot(out, initrd, smp=2, timeout=timeout)
    rows = re.findall(r"\]   (p_\S+) +(\d+) +(\d+)", r.console)
    print(f"boot with {what} ({r.accel}, -smp 2, {platform.node()}): {r.seconds:.1f} s to power-off; "
          f"user space {'reached' if r.reached() else 'NOT reached'}; "
          f"W+X check {'passed' if kernel_env.WX_PASSED in r.console else 'NOT passed'}; "
          f"{'powered off' if r.powered_off else 'no power-off'}; problems: {r.problems() or 'none'}")
    print(f"kprobe_profile: {len(rows)} rows, {sum(1 for _, h, _ in rows if int(h))} probes hit, "
          f"{sum(int(h) for _, h, _ in rows)} hits, {sum(int(m) for _, _, m in rows)} nmissed")
    for l in r.lines():
        if any(w in l for w in ("kprewrite: kept", "Freeing unused kernel image", "kprewrite: built the tables",
                                "kprewrite: probe tables read-only")):
            print(" ", l)
    return 0 if r.reached() and r.powered_off and not r.problems() else 1


if __name__ == "__main__":
    sys.exit(main())
