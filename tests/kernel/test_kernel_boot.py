"""The unmodified Debian cloud kernel boots in QEMU under the harness: the baseline every
rewritten kernel is held to (user space reached, /init's commands run, clean power-off, the
kernel's own W+X check passed, no oops or warning)."""
from __future__ import annotations

import re

import pytest
from elftools.elf.elffile import ELFFile

from kernel_env import assert_boot_ok, init_script, parse_kallsyms, sections

pytestmark = pytest.mark.kernel

# What /init runs: each section starts with a line "== name" (see sections()).
SMOKE_COMMANDS = r"""
echo "== version"; cat /proc/version
echo "== ls"; ls /
echo "== kallsyms head"; cat /proc/kallsyms | head -n 5
echo "== kallsyms count"; grep -c . /proc/kallsyms
echo "== kallsyms named"; grep -wE '_text|_stext|_etext|__start_rodata|_end|do_sys_openat2|kernel_clone|vfs_read|_printk' /proc/kallsyms
echo "== kptr_restrict"; cat /proc/sys/kernel/kptr_restrict
echo "== cpus"; grep -c ^processor /proc/cpuinfo
echo "== filter functions"; grep -c . /sys/kernel/tracing/available_filter_functions
echo "== kprobes blacklist"; grep -c . /sys/kernel/debug/kprobes/blacklist
"""


@pytest.fixture(scope="session")
def smoke_boot(debian_kernel, make_initramfs, boot_kernel):
    """One boot of the unmodified vmlinux (ELF, through its PVH note), -smp 2."""
    initrd = make_initramfs(init_script(SMOKE_COMMANDS))
    return boot_kernel("unmodified-vmlinux-smp2", debian_kernel.vmlinux, initrd, smp=2, timeout=120)


def test_unmodified_vmlinux_boots(smoke_boot, debian_kernel):
    r = smoke_boot
    assert_boot_ok(r)
    s = sections(r.between())
    version = " ".join(s["version"])
    assert debian_kernel.release in version and debian_kernel.version in version, r.explain("wrong /proc/version")
    assert {"init", "bin", "proc", "sys", "dev"} <= set(" ".join(s["ls"]).split()), r.explain("ls / lacks entries")
    assert s["cpus"] == ["2"], r.explain("/proc/cpuinfo should list 2 processors")
    assert "smpboot: Total of 2 processors activated" in r.console
    print(f"\nunmodified vmlinux: boot to power-off {r.seconds:.2f} s ({r.accel}, -smp 2)")


def test_proc_kallsyms_matches_the_image(smoke_boot, debian_kernel):
    """What /proc/kallsyms shows in this boot, against the ELF's own layout: the PVH path does
    not randomize the base, so kallsyms addresses are the link-time ones."""
    r = smoke_boot
    s = sections(r.between())
    for line in s["kallsyms head"]:
        assert re.fullmatch(r"[0-9a-f]{16} [A-Za-z] \S+( \[\S+\])?", line), r.explain(f"bad kallsyms line {line!r}")
    assert len(s["kallsyms head"]) == 5
    count = int(s["kallsyms count"][0])
    assert count > 50_000, r.explain("too few kallsyms entries")
    assert s["kptr_restrict"] == ["0"]     # root in the initramfs sees real addresses
    syms = parse_kallsyms(s["kallsyms named"])
    with open(debian_kernel.vmlinux, "rb") as f:
        elf = ELFFile(f)
        text = elf.get_section_by_name(".text")
        rodata = elf.get_section_by_name(".rodata")
        assert syms["_text"][0] == syms["_stext"][0] == text["sh_addr"] == 0xFFFFFFFF81000000
        assert syms["__start_rodata"][0] == rodata["sh_addr"]
        assert text["sh_addr"] < syms["_etext"][0] <= text["sh_addr"] + text["sh_size"] < rodata["sh_addr"]
        for fn in ("do_sys_openat2", "kernel_clone", "vfs_read", "_printk"):
            assert syms[fn][1] in "tT" and text["sh_addr"] <= syms[fn][0] < syms["_etext"][0], fn
    print(f"\n/proc/kallsyms: {count} entries; " +
          ", ".join(f"{n}={a:#x}" for n, (a, _) in sorted(syms.items(), key=lambda kv: kv[1])))
    print(f"available_filter_functions: {s['filter functions']}, kprobes/blacklist: {s['kprobes blacklist']}")


def test_initramfs_is_cached_by_content(make_initramfs):
    a = make_initramfs(init_script("true"))
    b = make_initramfs(init_script("true"))
    c = make_initramfs(init_script("true"), {"etc/x": "1\n"})
    assert a == b and a != c and a.read_bytes() == b.read_bytes()


LINK_TEXT = 0xFFFFFFFF81000000


def test_unmodified_vmlinuz_boots_with_kaslr(debian_kernel, make_initramfs, boot_kernel, smoke_boot):
    """The bzImage itself (its own decompressor, the relocation table applied, KASLR on: no
    boot parameter) boots the same way, at a random base; symbols keep their offsets from _text.
    Two boots: at least one base differs from the link-time one (each is random over ~500 slots)."""
    initrd = make_initramfs(init_script(
        "echo '== kallsyms'; grep -wE '_text|_etext|do_sys_openat2|kernel_clone' /proc/kallsyms"))
    linked = parse_kallsyms(sections(smoke_boot.between())["kallsyms named"])   # the PVH boot: not moved
    bases = []
    for n in range(2):
        r = boot_kernel(f"unmodified-vmlinuz-kaslr-{n}", debian_kernel.vmlinuz, initrd, smp=2, timeout=120)
        assert_boot_ok(r)
        syms = parse_kallsyms(sections(r.between())["kallsyms"])
        base = syms["_text"][0]
        assert base % (2 << 20) == 0, r.explain(f"_text {base:#x} is not 2 MiB aligned")
        for name in ("_etext", "do_sys_openat2", "kernel_clone"):
            assert syms[name][0] - base == linked[name][0] - LINK_TEXT, r.explain(f"{name} moved within the image")
        bases.append(base)
    assert any(b != LINK_TEXT for b in bases), [hex(b) for b in bases]
    print(f"\nKASLR bases of two boots: {', '.join(hex(b) for b in bases)}")
