"""Kernel modules (.ko): Debian's own romfs.ko (the cloud kernel builds romfs as a module and
does not load it at boot) read as the module loader lays it out: the target detected, the
kernel's rules read from the module's own tables, `check` and `blacklist` on it; rewritten with
a C-handler probe, a counting probe and a kretprobe at ftrace sites, `list` on it, and in one
boot of the unmodified Debian kernel: insmod, mount(2) exercising the probes, rmmod printing the
hits, loaded and counted again; then the same in a rewritten kernel image (each counts its own).
What a module does not take yet is refused with one line.

What the rules must find is counted independently, from the .ko's relocation sections (each
entry of __mcount_loc, .return_sites, .retpoline_sites is one relocation against the text):
binutils' readelf, not our reader."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import kprewrite  # the tree's CLI, as every test runs it

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from rewriter import targets  # noqa: E402
from rewriter.targets import linux_module  # noqa: E402
from rewriter.targets.linux_module.x86_64.relocatable import KERNEL_STAND_IN, MODULE_BASE  # noqa: E402

pytestmark = pytest.mark.kernel

# romfs: small, not loaded at boot, exercised by mount(2); kvm-amd: .noinstr.text,
# .altinstructions and __ex_table, which romfs lacks (read only, never loaded).
MODULES = {"romfs": "kernel/fs/romfs/romfs.ko", "kvm-amd": "kernel/arch/x86/kvm/kvm-amd.ko"}


def obtain_modules(k: kernel_env.DebianKernel, rels: list[str]) -> list[Path]:
    """lib/modules/<release>/<rel> of the kernel's package for each rel, extracted once into its
    cache folder (the package fetched again with apt-get download: the kernel cache keeps only boot/)."""
    dests = [k.dir / "modules" / rel for rel in rels]
    if all(d.exists() for d in dests):
        return dests
    with kernel_env._locked(k.dir / ".modules.lock"):
        missing = [(rel, d) for rel, d in zip(rels, dests) if not d.exists()]
        if not missing:
            return dests
        work = k.dir / ".modules-dl"
        work.mkdir(exist_ok=True)
        r = subprocess.run(["apt-get", "download", "-q", f"{k.package}={k.version}"], cwd=work,
                           capture_output=True, text=True)
        debs = list(work.glob("*.deb"))
        if r.returncode != 0 or len(debs) != 1:
            pytest.fail(f"kernel test environment: apt-get download {k.package}={k.version} failed: "
                        f"{r.stderr.strip()[-300:]}", pytrace=False)
        for rel, dest in missing:
            member = f"./lib/modules/{k.release}/{rel}"
            tar = subprocess.run(f"dpkg-deb --fsys-tarfile {debs[0]} | tar -xO {member}", shell=True,
                                 capture_output=True)
            if tar.returncode != 0 or not tar.stdout.startswith(b"\x7fELF"):
                pytest.fail(f"kernel test environment: {debs[0].name} has no {member}", pytrace=False)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_suffix(".tmp")
            tmp.write_bytes(tar.stdout)
            tmp.rename(dest)
        for d in debs:
            d.unlink()
    return dests


@pytest.fixture(scope="module")
def modules(debian_kernel) -> dict[str, Path]:
    return dict(zip(MODULES, obtain_modules(debian_kernel, list(MODULES.values()))))


@pytest.fixture(scope="module")
def romfs(modules) -> Path:
    return modules["romfs"]


def _relocations(ko: Path, section: str) -> int:
    out = subprocess.run(["readelf", "-W", "-r", str(ko)], capture_output=True, text=True, check=True).stdout
    m = re.search(rf"Relocation section '\.rela{re.escape(section)}' at offset \S+ contains (\d+) entr", out)
    return int(m.group(1)) if m else 0


def _func_syms(ko: Path) -> dict[str, tuple[str, int, int]]:
    """name -> (section name, value, size) of the .ko's FUNC symbols (readelf)."""
    out = subprocess.run(["readelf", "-W", "-s", "-S", str(ko)], capture_output=True, text=True, check=True).stdout
    secs = {int(i): n for i, n in re.findall(r"^\s*\[\s*(\d+)\]\s+(\S+)", out, re.M)}
    syms = {}
    for v, size, ndx, name in re.findall(r"^\s*\d+:\s+([0-9a-f]+)\s+(\d+)\s+FUNC\s+\w+\s+\w+\s+(\d+)\s+(\S+)$",
                                         out, re.M):
        syms[name] = (secs[int(ndx)], int(v, 16), int(size))
    return syms


def test_module_detected_and_laid_out(romfs):
    image = targets.load(str(romfs))
    assert image.target is linux_module
    f = image.function_named("romfs_get_tree")
    sec, value, size = _func_syms(romfs)["romfs_get_tree"]
    assert sec == ".text" and f is not None and f.end - f.start == size
    text = next(s for s in image.sections if s.name == ".text")
    assert text.addr >= MODULE_BASE and f.start == text.addr + value
    # The entry is an ftrace site: `call __fentry__` (relocated at insmod) or its nop.
    code = image.read(f.start, 5)
    assert code[:1] == b"\xe8" or code == bytes.fromhex("0f1f440000")


def test_blacklist_reads_the_module_tables(romfs):
    lines = kprewrite("blacklist", romfs).stdout.splitlines()

    def count(what):
        return sum(1 for line in lines if line.endswith(what))
    assert count("boot-patched site (__mcount_loc)") == _relocations(romfs, "__mcount_loc") > 0
    assert count("boot-patched site (.return_sites)") == _relocations(romfs, ".return_sites") > 0
    assert count("boot-patched site (.retpoline_sites)") == _relocations(romfs, ".retpoline_sites") > 0
    assert count("static call site (static_call_text_reserved)") == _relocations(romfs, ".static_call_sites") // 2
    assert count("jump label site (jump_label_text_reserved)") == _relocations(romfs, "__jump_table") // 3
    # Each function of .init.text (by address: init_module is an alias of init_romfs_fs).
    init = {}
    for n, (s, v, _) in _func_syms(romfs).items():
        if s == ".init.text":
            init.setdefault(v, set()).add(n)
    assert init and all(any(re.search(rf"  ({'|'.join(names)})  in \.init\.text", line) for line in lines)
                        for names in init.values())
    assert any("  _printk  a kernel symbol the module refers to" in line for line in lines)


def test_check_on_module(romfs, tmp_path):
    syms = _func_syms(romfs)
    spec = tmp_path / "probes.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "romfs_get_tree"\n'
                    '[[kprobe]]\nsymbol_name = "init_romfs_fs"\n'
                    '[[kprobe]]\nsymbol_name = "_printk"\n'
                    '[[kretprobe]]\nsymbol_name = "romfs_fill_super"\n')
    r = kprewrite("check", romfs, "--spec", spec, check=False)
    out = r.stdout
    assert re.search(r"^romfs_get_tree\+0x0  k  ftrace$", out, re.M), out
    assert re.search(r"^init_romfs_fs\+0x0  k  refused  blacklist at 0x\S+: .* in \.init\.text", out, re.M), out
    assert re.search(rf"^_printk\+0x0  k  refused  blacklist at {KERNEL_STAND_IN >> 32:#x}", out, re.M), out
    # A module's kretprobes are the kernel's: the return address swapped at entry.
    assert re.search(r"^romfs_fill_super\+0x0  r  ftrace  returns: trampoline  kretprobe_trampoline at ", out, re.M), out
    assert syms["romfs_fill_super"][0] == ".text"


def test_instrument_refuses_what_a_module_does_not_take_yet(romfs, tmp_path):
    """A probe inside a function (not at its ftrace site): one line, no output."""
    spec = tmp_path / "probes.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "romfs_get_tree"\n'
                    '[[kprobe]]\nsymbol_name = "romfs_readdir"\noffset = 5\n')
    out = tmp_path / "romfs.ko"
    before = romfs.read_bytes()
    r = kprewrite("instrument", romfs, "--spec", spec, "-o", out, check=False)
    assert r.returncode != 0 and not out.exists() and romfs.read_bytes() == before
    assert r.stderr.strip().splitlines() == [
        "kprewrite: probes.toml: [[kprobe]] #2 (romfs_readdir+0x5): a module's probes are written at ftrace "
        "sites (function entries) only for now; this one is optimized"]


HANDLER_C = r"""
#include <linux/kprobes.h>
static int handler_pre(struct kprobe *p, struct pt_regs *regs)
{
	printk(KERN_INFO "kp-module: %s pre ip=%lx\n", p->symbol_name, regs->ip);
	return 0;
}
static int ret_handler(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	printk(KERN_INFO "kp-module: %s returned %d\n", ri->rp->kp.symbol_name, (int)regs_return_value(regs));
	return 0;
}
"""

COMMANDS = """
mkdir -p /mnt
T=/sys/kernel/tracing
insmod /romfs.ko; echo insmod1=$?
grep -E ' (romfs_get_tree|romfs_init_fs_context)([[:space:]]|$)' /proc/kallsyms | sed 's/^/ksym: /'
grep -c '^romfs_' $T/available_filter_functions | sed 's/^/ftrace-romfs: /'
grep -E '^romfs_(get_tree|init_fs_context)[[:space:]]' $T/available_filter_functions | sed 's/^/ftrace-probed: /'
for i in 1 2 3; do mount -t romfs /dev/null /mnt 2>/dev/null; done
rmmod romfs; echo rmmod1=$?
grep -c romfs /proc/modules | sed 's/^/loaded: /'
insmod /romfs.ko; echo insmod2=$?
mount -t romfs /dev/null /mnt 2>/dev/null
rmmod romfs; echo rmmod2=$?
"""


@pytest.fixture(scope="module")
def rewritten_romfs(romfs, tmp_path_factory):
    d = tmp_path_factory.mktemp("module")
    (d / "h.c").write_text(HANDLER_C)
    (d / "probes.toml").write_text('handlers = ["h.c"]\n'
                                   '[[kprobe]]\nsymbol_name = "romfs_get_tree"\npre_handler = "handler_pre"\n'
                                   '[[kprobe]]\nsymbol_name = "romfs_init_fs_context"\n'
                                   '[[kretprobe]]\nsymbol_name = "romfs_get_tree"\nhandler = "ret_handler"\n')
    out = d / "romfs.ko"
    kprewrite("instrument", romfs, "--spec", d / "probes.toml", "-o", out)
    again = d / "again.ko"
    kprewrite("instrument", romfs, "--spec", d / "probes.toml", "-o", again)
    assert out.read_bytes() == again.read_bytes()            # deterministic
    return out


def test_list_on_rewritten_module(romfs, rewritten_romfs):
    r = kprewrite("diff", romfs, rewritten_romfs, check=False)
    assert r.returncode != 0 and "diff compares ELF files; a kernel module is relinked (ld -r)" in r.stderr
    lines = kprewrite("list", rewritten_romfs).stdout.splitlines()
    assert [line.split("  ", 1)[1] for line in lines] == ["k  romfs_get_tree+0x0 [FTRACE]",
                                                          "k  romfs_init_fs_context+0x0 [FTRACE]",
                                                          "r  romfs_get_tree+0x0 [FTRACE]"]


def test_rewritten_module_loads_counts_and_unloads(debian_kernel, rewritten_romfs, make_initramfs, boot_kernel):
    """The unmodified Debian kernel insmods the rewritten romfs.ko (tainted: unsigned), the probes fire
    from mount(2) (romfs_init_fs_context and romfs_get_tree run, then the mount fails: /dev/null is no
    block device), rmmod prints each probe's hits, and the module loads and counts again."""
    initrd = make_initramfs(kernel_env.init_script(COMMANDS), {"romfs.ko": rewritten_romfs})
    r = boot_kernel("module-romfs", debian_kernel.vmlinux, initrd, smp=2, timeout=180)
    kernel_env.assert_boot_ok(r)
    out = r.between()
    for line in ("insmod1=0", "rmmod1=0", "loaded: 0", "insmod2=0", "rmmod2=0"):
        assert re.search(rf"^{line}$", out, re.M), r.explain(f"no {line}")
    assert "romfs: module verification failed: signature and/or required key missing - tainting kernel" in out
    ksym = {m.group(2): int(m.group(1), 16) for m in re.finditer(r"^ksym: ([0-9a-f]+) t (\S+)", out, re.M)}
    assert set(ksym) == {"romfs_get_tree", "romfs_init_fs_context"}, r.explain("no kallsyms lines")
    # ftrace no longer owns the probed entries (their __mcount_loc entries dropped), the others it does.
    assert not re.search(r"^ftrace-probed:", out, re.M), r.explain("a probed site is still ftrace's")
    assert int(re.search(r"^ftrace-romfs: (\d+)", out, re.M).group(1)) > 5
    # The C handler ran on each hit, with regs->ip the probed address + 1 (as an ftrace kprobe's).
    ips = re.findall(r"kp-module: romfs_get_tree pre ip=([0-9a-f]+)", out)
    assert len(ips) == 4 and {int(ip, 16) for ip in ips[:3]} == {ksym["romfs_get_tree"] + 1}, out
    # The kretprobe on the same entry (one detour for both): romfs_get_tree() fails with -ENOTBLK.
    assert re.findall(r"kp-module: romfs_get_tree returned (-?\d+)", out) == ["-15"] * 4, out
    hits = re.findall(r"kprewrite: romfs: (\S+) (\S+) hits (\d+)(.*)", out)
    assert hits == [("p_romfs_get_tree_0", "romfs_get_tree+0x0", "3", ""),
                    ("p_romfs_init_fs_context_0", "romfs_init_fs_context+0x0", "3", ""),
                    ("r_romfs_get_tree_0", "romfs_get_tree+0x0", "3", " returns 3 nmissed 0"),
                    ("p_romfs_get_tree_0", "romfs_get_tree+0x0", "1", ""),
                    ("p_romfs_init_fs_context_0", "romfs_init_fs_context+0x0", "1", ""),
                    ("r_romfs_get_tree_0", "romfs_get_tree+0x0", "1", " returns 1 nmissed 0")], out


def test_truncated_module_is_one_line(romfs, tmp_path):
    bad = tmp_path / "cut.ko"
    data = romfs.read_bytes()
    bad.write_bytes(data[:len(data) // 2])
    r = kprewrite("blacklist", bad, check=False)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"kprewrite: {bad}")


def test_oversized_module_is_refused(romfs, tmp_path):
    """A .bss of 1 TiB (a crafted header): refused in one line before anything is laid out."""
    import struct
    from rewriter.targets.linux_module.x86_64 import relocatable
    data = bytearray(romfs.read_bytes())
    bss = next(s for s in relocatable.read_sections(bytes(data), "romfs.ko") if s.name == ".bss")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    struct.pack_into("<Q", data, shoff + bss.index * 64 + 32, 1 << 40)
    bad = tmp_path / "big.ko"
    bad.write_bytes(data)
    r = kprewrite("blacklist", bad, check=False)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"kprewrite: {bad}: the module's sections take 0x1000000")
    assert lines[0].endswith("(more than 256 MiB): not a module the loader would take")


def test_module_and_kernel_image_rewritten_in_one_boot(debian_kernel, rewritten_romfs, make_initramfs, boot_kernel,
                                                       tmp_path):
    """The rewritten romfs.ko in a rewritten kernel: each image's runtime counts its own probes
    (the module's is its own, with hidden symbols; the kernel's prints its kprobe_profile at power-off)."""
    spec = tmp_path / "k.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "do_sys_openat2"\n')
    vmlinux = tmp_path / "vmlinux"
    kprewrite("instrument", debian_kernel.vmlinux, "--spec", spec, "-o", vmlinux)
    initrd = make_initramfs(kernel_env.init_script(COMMANDS), {"romfs.ko": rewritten_romfs})
    r = boot_kernel("module-romfs-rewritten-kernel", vmlinux, initrd, smp=2, timeout=180)
    kernel_env.assert_boot_ok(r)
    out = r.between()
    for line in ("insmod1=0", "rmmod1=0", "insmod2=0", "rmmod2=0"):
        assert re.search(rf"^{line}$", out, re.M), r.explain(f"no {line}")
    hits = re.findall(r"kprewrite: romfs: (\S+) \S+ hits (\d+)", out)
    assert hits == [("p_romfs_get_tree_0", "3"), ("p_romfs_init_fs_context_0", "3"), ("r_romfs_get_tree_0", "3"),
                    ("p_romfs_get_tree_0", "1"), ("p_romfs_init_fs_context_0", "1"), ("r_romfs_get_tree_0", "1")], out
    profile = r.profile()
    # The kernel's profile: its probe (and its own boot hooks), none of the module's.
    assert profile["p_do_sys_openat2_0"][0] > 0, profile
    assert not [e for e in profile if "romfs" in e], profile


def test_module_noinstr_alternatives_ex_table(modules, tmp_path):
    """kvm-amd.ko's .noinstr.text functions refused one by one, its .altinstructions sites reserved
    (one per entry: two relocations each), a probe inside a function with an __ex_table entry refused
    (the function holding its first entry's instruction, read from readelf's relocations)."""
    ko = modules["kvm-amd"]
    lines = kprewrite("blacklist", ko).stdout.splitlines()
    noinstr = {n for n, (sec, _, _) in _func_syms(ko).items() if sec == ".noinstr.text"}
    listed = {m.group(1) for line in lines if (m := re.search(r"  (\S+)  in \.noinstr\.text \(noinstr\)$", line))}
    assert noinstr and listed == noinstr, (listed, noinstr)
    assert sum(line.endswith("alternatives site (alternatives_text_reserved)") for line in lines) \
        == _relocations(ko, ".altinstructions") // 2 > 0
    out = subprocess.run(["readelf", "-W", "-r", str(ko)], capture_output=True, text=True, check=True).stdout
    m = re.search(r"R_X86_64_PC32\s+\S+\s+\.text \+ ([0-9a-f]+)", out[out.index(".rela__ex_table'"):])
    insn = int(m.group(1), 16)
    func, start = next((n, v) for n, (sec, v, size) in _func_syms(ko).items()
                       if sec == ".text" and v + 5 < insn < v + size)
    spec = tmp_path / "probes.toml"
    # Right after the ftrace site (an instruction boundary), so the region check comes first.
    spec.write_text(f'[[kprobe]]\nsymbol_name = "{func}"\noffset = 5\n'
                    f'[[kprobe]]\nsymbol_name = "{sorted(noinstr)[0]}"\n')
    r = kprewrite("check", ko, "--spec", spec, check=False)
    assert re.search(rf"^{func}\+0x5  k  refused  __ex_table at 0x\S+: {func} has an exception "
                     "table entry", r.stdout, re.M), r.stdout
    assert re.search(rf"^{sorted(noinstr)[0]}\+0x0  k  refused  blacklist at .* in \.noinstr\.text", r.stdout, re.M), r.stdout
