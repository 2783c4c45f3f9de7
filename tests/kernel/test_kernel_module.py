"""Kernel modules (.ko): Debian's own romfs.ko (the cloud kernel builds romfs as a module and
does not load it at boot) read as the module loader lays it out: the target detected, the
kernel's rules read from the module's own tables, `check` and `blacklist` on it; `instrument`
refuses a module (not done yet) with one line and no output.

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
from rewriter.targets.linux_module.relocatable import KERNEL_STAND_IN, MODULE_BASE  # noqa: E402

pytestmark = pytest.mark.kernel

MODULE = "kernel/fs/romfs/romfs.ko"


def obtain_module(k: kernel_env.DebianKernel, rel: str) -> Path:
    """lib/modules/<release>/<rel> of the kernel's package, extracted once into its cache folder
    (the package fetched again with apt-get download: the kernel cache keeps only boot/)."""
    dest = k.dir / "modules" / rel
    if dest.exists():
        return dest
    with kernel_env._locked(k.dir / ".modules.lock"):
        if dest.exists():
            return dest
        work = k.dir / ".modules-dl"
        work.mkdir(exist_ok=True)
        r = subprocess.run(["apt-get", "download", "-q", f"{k.package}={k.version}"], cwd=work,
                           capture_output=True, text=True)
        debs = list(work.glob("*.deb"))
        if r.returncode != 0 or len(debs) != 1:
            pytest.fail(f"kernel test environment: apt-get download {k.package}={k.version} failed: "
                        f"{r.stderr.strip()[-300:]}", pytrace=False)
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
    return dest


@pytest.fixture(scope="module")
def romfs(debian_kernel) -> Path:
    return obtain_module(debian_kernel, MODULE)


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
    # The kretprobe's returns are the `jmp __x86_return_thunk` sites .return_sites lists.
    m = re.search(r"^romfs_fill_super\+0x0  r  ftrace  returns: (.*)$", out, re.M)
    assert m, out
    image = targets.load(str(romfs))
    f = image.function_named("romfs_fill_super")
    rets = re.findall(r"(0x[0-9a-f]+) ret", m.group(1))
    assert rets and all(f.start < int(a, 16) < f.end and image.read(int(a, 16), 1) == b"\xe9" for a in rets)
    assert syms["romfs_fill_super"][0] == ".text"


def test_instrument_refuses_a_module_cleanly(romfs, tmp_path):
    spec = tmp_path / "probes.toml"
    spec.write_text('[[kprobe]]\nsymbol_name = "romfs_get_tree"\n')
    out = tmp_path / "romfs.ko"
    before = romfs.read_bytes()
    r = kprewrite("instrument", romfs, "--spec", spec, "-o", out, check=False)
    assert r.returncode != 0 and not out.exists() and romfs.read_bytes() == before
    assert r.stderr.strip().splitlines() == [
        "kprewrite: rewriting a kernel module (.ko) is not supported yet: `check` and `blacklist` read it "
        "(docs/limitations.md)"]


def test_truncated_module_is_one_line(romfs, tmp_path):
    bad = tmp_path / "cut.ko"
    data = romfs.read_bytes()
    bad.write_bytes(data[:len(data) // 2])
    r = kprewrite("blacklist", bad, check=False)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"kprewrite: {bad}")
