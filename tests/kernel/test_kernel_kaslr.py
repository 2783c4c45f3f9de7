"""A bzImage in, a bzImage out, KASLR on: `instrument` on Debian's own vmlinuz writes a
vmlinuz that qemu-system-x86_64 -kernel boots like the original, with no boot parameter (KASLR on,
as by default): three boots, three random bases, probes firing at each; one per boot loader:
QEMU's -kernel, SYSLINUX from a disk image, and UEFI (OVMF: the PE header and the EFI stub).

The spec: the kernel's kprobe_example handlers on kernel_clone (an ftrace site: its __mcount_loc
entry, a 64-bit KASLR relocation, is zeroed and must stay 0), and a jump-optimized probe on an
instruction of copy_process that loads the address of tasklist_lock (`mov $tasklist_lock, %rdi`:
a 32-bit KASLR relocation, which moves to the instruction's copy in the detour).  Its post_handler
runs after the copy and prints %rdi: the randomized address of tasklist_lock, as /proc/kallsyms
says in the same boot.  One rewrite and three boots are shared by the tests of this module."""
from __future__ import annotations

import dataclasses
import re
import struct
import sys
import zlib
from pathlib import Path

import capstone
import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

from kernel_env import DONE_MARKER, assert_boot_ok, init_script

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from rewriter import targets  # noqa: E402
from rewriter.targets import linux_kernel  # noqa: E402
from rewriter.targets.linux_kernel.x86_64 import bzimage  # noqa: E402

pytestmark = pytest.mark.kernel

BOOTS = 3
FORKS = 3
SYMBOLS = ("_text", "kernel_clone", "copy_process", "tasklist_lock")
# Everything /init reports goes through /dev/kmsg, in order with the handlers' printk lines:
# a handler's printk on a fork would cut a line still draining from the serial tty.  The
# builtin `read -t 1` waits without forking, so the marker lines printed before it drain.
COMMANDS = ("read -t 1 x\n"
            "echo LOOP-START > /dev/kmsg\n"
            f"for i in {' '.join(map(str, range(FORKS)))}; do /bin/true; done\n"
            "echo LOOP-END > /dev/kmsg\n"
            f"grep -w {' '.join(f'-e {s}' for s in SYMBOLS)} /proc/kallsyms > /tmp/syms\n"
            'while read l; do echo "kp-sym: $l" > /dev/kmsg; done < /tmp/syms\n'
            'read c < /proc/cmdline; echo "kp-cmdline: $c" > /dev/kmsg\n'
            f"echo {DONE_MARKER}\nread -t 1 x\n")

LOCK_HANDLERS = r"""
#include <linux/kprobes.h>

/* After the copied `mov $tasklist_lock, %rdi` ran in the detour. */
static void lock_post(struct kprobe *p, struct pt_regs *regs, unsigned long flags)
{
	pr_info("kp-lock: p->addr = 0x%lx, di = 0x%lx\n", (unsigned long)p->addr, regs->di);
}
"""



def lock_load(image) -> int:
    """Offset in copy_process of `mov $tasklist_lock, %rdi` (with its 32-bit KASLR relocation)."""
    f = next(f for f in image.functions if f.name == "copy_process")
    lock = next(s.addr for s in image.kernel_symbols if s.name == "tasklist_lock")
    relocs = {0xFFFFFFFF00000000 | r for r in image.container.relocs.relocs32}
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    for insn in cs.disasm(image.read(f.start, f.end - f.start), f.start):
        if insn.mnemonic == "mov" and insn.op_str == f"rdi, {lock:#x}" and \
                any(insn.address <= e < insn.address + insn.size for e in relocs):
            return insn.address - f.start
    pytest.fail("copy_process has no `mov $tasklist_lock, %rdi` with a KASLR relocation")


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory, debian_kernel):
    d = tmp_path_factory.mktemp("kaslr")
    image = targets.load(str(debian_kernel.vmlinuz))     # the vmlinux inside the bzImage
    linux_kernel.load_symbols(image)
    off = lock_load(image)
    (d / "lock.c").write_text(LOCK_HANDLERS)
    sample = ROOT / "samples" / "kprobe_example" / "handlers.c"
    spec = d / "probes.toml"
    spec.write_text(f'handlers = ["{sample}", "lock.c"]\n'
                    '[[kprobe]]\nsymbol_name = "kernel_clone"\npre_handler = "handler_pre"\npost_handler = "handler_post"\n'
                    f'[[kprobe]]\nsymbol_name = "copy_process"\noffset = {off:#x}\npost_handler = "lock_post"\n')
    r = kprewrite("check", debian_kernel.vmlinuz, "--spec", spec)
    assert r.stdout.splitlines() == ["kernel_clone+0x0  k  ftrace", f"copy_process+{off:#x}  k  optimized"], r.stdout
    out = d / "vmlinuz.kp"
    kprewrite("instrument", debian_kernel.vmlinuz, "--spec", spec, "-o", out)
    return {"out": out, "offset": off, "link": {s.name: s.addr for s in image.kernel_symbols if s.name in SYMBOLS}}


LOADERS = ("qemu", "syslinux", "uefi")     # kernel_env.boot()'s
CMDLINES = {"qemu": "console=ttyS0 panic=-1 no_timer_check",
            "syslinux": "BOOT_IMAGE=vmlinuz console=ttyS0 panic=-1 no_timer_check initrd=initrd.gz",
            "uefi": "console=ttyS0 panic=-1 no_timer_check initrd=initrd"}


@pytest.fixture(scope="module")
def boots(rewritten, make_initramfs, boot_kernel):
    """One boot of the rewritten bzImage per boot loader: QEMU's -kernel (SeaBIOS and QEMU's
    Linux boot ROM), SYSLINUX from a disk image (BIOS), UEFI (OVMF: the PE header and the
    kernel's EFI stub)."""
    initrd = make_initramfs(init_script(COMMANDS))
    results, seen = [], {rewritten["link"]["_text"]}
    for loader in LOADERS:
        r = boot_kernel(f"kaslr-bzimage-{loader}", rewritten["out"], initrd, smp=2, timeout=180, loader=loader)
        # KASLR picks the virtual base among ~480 2 MiB slots, slot 0 being the link address: one
        # boot in ~480 lands there (or on another boot's base) by chance.  Boot that loader once
        # more; a loader that never randomizes lands there twice, which the test reports.
        if _text(r) is not None and _text(r) in seen:
            r = boot_kernel(f"kaslr-bzimage-{loader}-again", rewritten["out"], initrd, smp=2, timeout=180,
                            loader=loader)
        seen.add(_text(r))
        results.append(r)
    return results


def _text(r) -> int | None:
    m = re.search(r"kp-sym: ([0-9a-f]{16}) \w _text$", r.console, re.M)
    return int(m.group(1), 16) if m else None


def _kallsyms(r) -> dict[str, int]:
    syms = {m.group(2): int(m.group(1), 16) for m in re.finditer(r"kp-sym: ([0-9a-f]{16}) \w (\S+)$", r.console, re.M)}
    assert set(SYMBOLS) <= set(syms), r.explain(f"/proc/kallsyms lacks some of {SYMBOLS}")
    return syms


def test_header_and_decompressor_unchanged(rewritten, debian_kernel):
    """Same size; the setup header the same but payload_length; outside the payload only
    ZO's input_len word and tools/build.c's CRC-32 differ."""
    old, new = debian_kernel.vmlinuz.read_bytes(), rewritten["out"].read_bytes()
    assert len(new) == len(old)
    a, b = bzimage.parse(old), bzimage.parse(new, "out")
    start, length = a.header.payload_start, a.header.payload_length
    assert b.header.payload_length <= length
    word = old.find(struct.pack("<II", length, len(a.payload)), start + length)
    assert word > 0
    assert struct.unpack_from("<I", new, word)[0] == b.header.payload_length
    assert new[start + b.header.payload_length:start + length] == bytes(length - b.header.payload_length)
    assert (~zlib.crc32(new[:-4]) & 0xFFFFFFFF) == struct.unpack_from("<I", new, len(new) - 4)[0]
    assert b.header == dataclasses.replace(a.header, payload_length=b.header.payload_length)
    same = bytearray(new)
    for lo, hi in ((0x24C, 0x250), (word, word + 4), (len(old) - 4, len(old)), (start, start + length)):
        same[lo:hi] = old[lo:hi]
    assert same == old
    # The decompressed payload: output_len unchanged, the table at its very end.
    assert len(b.payload) == len(a.payload) and b.compressor == a.compressor and b.relocs is not None
    assert b.relocs.count > a.relocs.count


def test_list_reads_the_bzimage(rewritten):
    lines = kprewrite("list", rewritten["out"]).stdout.splitlines()
    link = rewritten["link"]
    assert f"{link['kernel_clone']:016x}  k  kernel_clone+0x0 [FTRACE]" in lines, lines
    assert f"{link['copy_process'] + rewritten['offset']:016x}  k  copy_process+{rewritten['offset']:#x} " \
           "[OPTIMIZED]" in lines, lines


def test_diff_refuses_a_bzimage(rewritten, debian_kernel):
    r = kprewrite("diff", debian_kernel.vmlinuz, rewritten["out"], check=False)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"kprewrite: {debian_kernel.vmlinuz}: diff compares ELF files; a bzImage's vmlinux is re-laid when written, "
        "so compare the vmlinux it holds and that vmlinux rewritten"], r.stderr


def test_boots_with_kaslr_at_different_bases(boots, rewritten):
    """No boot parameter: KASLR on; user space reached, W+X check passed, no oops, clean
    power-off, each boot at its own base."""
    bases = []
    for loader, r in zip(LOADERS, boots):
        assert_boot_ok(r)
        cmdline = re.findall(r"kp-cmdline: (.*)$", r.console, re.M)     # as each loader passes it
        assert cmdline == [CMDLINES[loader]], r.explain("a boot parameter was added")
        assert "KASLR disabled" not in r.console, r.explain("the kernel did not randomize")
        assert ("SYSLINUX " in r.console) == (loader == "syslinux"), r.explain("SYSLINUX booted it, or not")
        assert ("EFI stub: " in r.console and "efi: EFI v" in r.console) == (loader == "uefi"), \
            r.explain("booted through UEFI, or not")
        bases.append(_kallsyms(r)["_text"])
    assert len(set(bases)) == BOOTS and rewritten["link"]["_text"] not in bases, [hex(b) for b in bases]
    print("\n_text per boot: " + ", ".join(f"{b:#x}" for b in bases) +
          f"; boot to power-off {', '.join(f'{r.seconds:.1f}' for r in boots)} s ({boots[0].accel})")


def test_probes_fire_at_the_randomized_addresses(boots, rewritten):
    """kprobe_example's p->addr is kernel_clone's address in /proc/kallsyms of the same boot, one
    pre/post pair per fork; the optimized probe's copied `mov` loaded the randomized tasklist_lock."""
    off = rewritten["offset"]
    for r in boots:
        syms = _kallsyms(r)
        lines = r.lines()
        i = next(n for n, l in enumerate(lines) if l.endswith("LOOP-START"))
        j = next(n for n in range(i, len(lines)) if lines[n].endswith("LOOP-END"))
        loop = lines[i:j]
        clone = syms["kernel_clone"]
        pre = [l for l in loop if "handler_pre: <kernel_clone>" in l]
        post = [l for l in loop if "handler_post: <kernel_clone>" in l]
        assert len(pre) == FORKS and len(post) == FORKS, r.explain(f"{FORKS} forks between the markers")
        assert all(re.search(rf"p->addr = 0x{clone:016x}, ip = {clone + 1:x}, ", l) for l in pre), \
            r.explain(f"kernel_clone is at {clone:#x} in this boot")
        assert all(f"p->addr = 0x{clone:016x}, flags" in l for l in post), r.explain(f"post at {clone:#x}")
        lock = [l for l in loop if "kp-lock: " in l]
        want = f"kp-lock: p->addr = {syms['copy_process'] + off:#x}, di = {syms['tasklist_lock']:#x}"
        assert len(lock) == FORKS and all(l.endswith(want) for l in lock), \
            r.explain(f"{FORKS} lines ending {want!r}")


@pytest.mark.slow
def test_rewriting_twice_gives_identical_bytes(rewritten, debian_kernel, tmp_path):
    spec = rewritten["out"].parent / "probes.toml"
    again = tmp_path / "vmlinuz.kp.again"
    kprewrite("instrument", debian_kernel.vmlinuz, "--spec", spec, "-o", again)
    assert again.read_bytes() == rewritten["out"].read_bytes()
