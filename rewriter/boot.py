"""`kprewrite boot`: a kernel image booted in QEMU with a minimal initramfs, its console on
standard output, as virtme-ng's `vng` does for a kernel tree: the quickest way to see a
rewritten kernel's probes fire.

The initramfs is Debian's static busybox (busybox-static) with its applets, and an /init
that mounts proc, sysfs, debugfs and tracefs, runs the commands given (--run, each in a
shell), and powers the machine off.  QEMU is the image's architecture's system emulator
(its toolchain.py's QEMU_SYSTEM and CONSOLE), booted with -kernel, TCG unless told (--accel kvm: a host whose KVM boots guests; some nested ones never get past
the firmware)."""
from __future__ import annotations

import gzip
import shutil
import subprocess
from pathlib import Path

from .errors import KprewriteError

BUSYBOX = "/bin/busybox"
DONE = "kprewrite-boot: init done"

INIT = """#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
/bin/busybox mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
{commands}echo "{done}"
/bin/busybox poweroff -f
"""


def newc(entries: list[tuple[str, int, bytes, int]]) -> bytes:
    """A cpio archive in the SVR4 "newc" format the kernel's initramfs unpacker reads.
    entries: (name, mode, data, rdev as (major << 8 | minor)); times and owners zero."""
    out = bytearray()

    def pad():
        out.extend(b"\0" * (-len(out) % 4))

    for ino, (name, mode, data, rdev) in enumerate(entries + [("TRAILER!!!", 0, b"", 0)], 1):
        nb = name.encode() + b"\0"
        fields = (ino if name != "TRAILER!!!" else 0, mode, 0, 0, 1, 0, len(data), 0, 0,
                  rdev >> 8, rdev & 0xFF, len(nb), 0)
        out += b"070701" + "".join(f"{f:08X}" for f in fields).encode() + nb
        pad()
        out += data
        pad()
    return bytes(out)


def initramfs(commands: list[str], busybox: str = BUSYBOX, runner: tuple[str, ...] = ()) -> bytes:
    """A gzip'd initramfs: busybox and its applets' links, /init running `commands`.  runner:
    how to run another architecture's busybox here to list its applets (qemu-<arch>)."""
    path = Path(busybox)
    if not path.is_file():
        raise KprewriteError(f"{busybox}: no such file (install Debian's busybox-static, or give --busybox)")
    data = path.read_bytes()
    if b"/ld-linux" in data[:4096]:
        raise KprewriteError(f"{busybox}: dynamically linked: an initramfs needs busybox-static's")
    r = subprocess.run([*runner, busybox, "--list-full"], capture_output=True, text=True)
    if r.returncode != 0:
        raise KprewriteError(f"{busybox} --list-full: exit {r.returncode}")
    entries = [(d, 0o40755, b"", 0) for d in ("bin", "sbin", "usr", "usr/bin", "usr/sbin", "dev", "proc", "sys",
                                              "tmp", "etc", "root", "run")]
    entries += [("dev/console", 0o20600, b"", 5 << 8 | 1), ("dev/null", 0o20666, b"", 1 << 8 | 3),
                ("bin/busybox", 0o100755, data, 0)]
    entries += [(a, 0o120777, b"/bin/busybox", 0) for a in sorted({l.strip() for l in r.stdout.splitlines()})
                if a and a != "bin/busybox"]
    script = INIT.format(commands="".join(f"{c}\n" for c in commands), done=DONE)
    entries.append(("init", 0o100755, script.encode(), 0))
    return gzip.compress(newc(entries), compresslevel=6, mtime=0)


def command(image: str, machine: str, initrd: str, append: str, memory: int, smp: int, accel: str = "tcg") -> list[str]:
    """The QEMU command line that boots `image` with `initrd`."""
    from .link.toolchain import arch_toolchain
    tc = arch_toolchain(machine)
    program, args, package = tc.QEMU_SYSTEM
    qemu = shutil.which(program)
    if qemu is None:
        raise KprewriteError(f"{program}: not found (install Debian's {package})")
    cmdline = " ".join(x for x in (f"console={tc.CONSOLE} panic=-1", append) if x)
    return [qemu, *args, "-accel", accel, "-m", str(memory), "-smp", str(smp), "-nographic",
            "-no-reboot", "-nic", "none", "-kernel", image, "-initrd", initrd, "-append", cmdline]
