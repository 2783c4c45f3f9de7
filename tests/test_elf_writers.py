"""Unit tests of the ELF writers: rewriter/targets/linux_user/writer.py (where the new
segments go, and the output's program headers) and rewriter/elf/write.py (the section
header table with the new sections).  A real gcc program written with made-up new
code and data, read back with pyelftools and readelf, and (without code patches)
run natively: the kernel and ld.so accept the moved program header table.  No
rewrite pipeline: a second or two."""
from __future__ import annotations

import struct
import subprocess

import pytest
from elftools.elf.elffile import ELFFile

from conftest import ALL_ARCHES, CROSS, cc, run
from rewriter.arch import get_arch
from rewriter.elf.write import NewSection, append_section_headers
from rewriter.errors import KprewriteError
from rewriter.elf.image import Image
from rewriter.targets.linux_user import writer as W

ARCHES = ALL_ARCHES
LOCAL = "qemu" if CROSS else "native"      # the runner of the tests that run once

PROG = r"""
#include <stdio.h>
static int table[300];
int main(int argc, char **argv) { table[argc] = argc; printf("hello %d\n", table[1] + 41); return 0; }
"""
PT_LOAD, PT_PHDR = 1, 6
PF_X, PF_W, PF_R = 1, 2, 4
SHF_WRITE, SHF_ALLOC, SHF_EXEC = 1, 2, 4


@pytest.fixture(scope="module")
def progs(tmp_path_factory):
    d = tmp_path_factory.mktemp("elfw")
    return {"pie": cc(d, "pie", PROG, "-O2", "-fPIE", "-pie"),
            "nopie": cc(d, "nopie", PROG, "-O2", "-no-pie"),
            "dir": d}


@pytest.fixture(scope="module")
def static(progs):
    """A static and a static-PIE build (no PT_PHDR / no PT_INTERP: the kernel's AT_PHDR and
    glibc's static start-up find the moved table on their own)."""
    d = progs["dir"]
    return {"static": cc(d, "static", PROG, "-O2", "-static", skip_without_static=True),
            "static-pie": cc(d, "static-pie", PROG, "-O2", "-static-pie", skip_without_static=True)}


def _write(image: Image, patches=(), entry=None, sections=None):
    lay = W.plan_layout(image)
    rx = bytes(lay.phdr_size) + bytes(range(256)) * 3          # the table's room, then "code"
    rw_vaddr = W.page_up(lay.rx_vaddr + len(rx))
    rw = b"kprewrite data\0" * 4
    meta = b'{"format": "test"}'
    if sections is None:
        sections = [NewSection(".kprewrite.text", 1, SHF_ALLOC | SHF_EXEC, lay.rx_vaddr + lay.phdr_size,
                               rx[lay.phdr_size:]),
                    NewSection(".kprewrite.data", 1, SHF_ALLOC | SHF_WRITE, rw_vaddr, rw),
                    NewSection(".kprewrite.bss", 8, SHF_ALLOC | SHF_WRITE, rw_vaddr + len(rw), b"", size=0x3000 - len(rw)),
                    NewSection(".kprewrite.meta", 1, 0, 0, meta, align=1)]
    out = W.write_image(image, lay, list(patches), rx, rw_vaddr, rw, 0x3000, sections, entry, [])
    return lay, rx, rw_vaddr, rw, meta, out


def _segments(data: bytes):
    phoff, phnum = struct.unpack_from("<Q", data, 32)[0], struct.unpack_from("<H", data, 56)[0]
    return [struct.unpack_from("<IIQQQQQQ", data, phoff + i * 56) for i in range(phnum)]


def test_plan_layout_after_everything(progs):
    """The new code goes a page past both the last segment's end and the file's end, its
    file offset following its address (vaddr - offset of the first PT_LOAD), page aligned;
    the program header table gets room for the old headers and two new PT_LOADs."""
    for kind in ("pie", "nopie"):
        image = Image(str(progs[kind]))
        lay = W.plan_layout(image)
        loads = [s for s in _segments(image.data) if s[0] == PT_LOAD]
        first = min(loads, key=lambda s: s[3])
        assert lay.skew == first[3] - first[2]
        assert lay.rx_vaddr % W.PAGE == 0 and lay.rx_vaddr - lay.rx_offset == lay.skew
        assert lay.rx_vaddr >= max(s[3] + s[6] for s in loads) + W.PAGE
        assert lay.rx_offset >= len(image.data)
        # (and one for the unwind tables' segment: targets/linux_user/unwind.py)
        assert lay.phdr_size == (len(_segments(image.data)) + 2 + lay.unwind) * 56
        assert lay.after_phdrs % 64 == 0 and lay.after_phdrs >= lay.rx_vaddr + lay.phdr_size
    # A file longer than its segments reach (debug info, notes at its end): past the file too.
    long = progs["dir"] / "long"
    long.write_bytes(progs["nopie"].read_bytes() + bytes(0x40000))
    image = Image(str(long))
    lay = W.plan_layout(image)
    assert lay.rx_offset >= len(image.data) and lay.rx_offset % W.PAGE == 0


@pytest.mark.parametrize("kind", ["pie", "nopie", "static", "static-pie"])
def test_written_program_headers(progs, static, kind):
    """Old program headers unchanged (PT_PHDR moved into the new code segment), two new
    PT_LOADs right after the last old one, R-X then RW-, page aligned (offset = vaddr mod
    page), in ascending address order, not overlapping anything; the output runs."""
    image = Image(str({**progs, **static}[kind]))
    lay, rx, rw_vaddr, rw, meta, out = _write(image)
    old, new = _segments(image.data), _segments(out)
    assert len(new) == len(old) + 2 + lay.unwind       # a PT_NULL where no unwind tables are given
    last = max(i for i, s in enumerate(old) if s[0] == PT_LOAD)
    added = new[last + 1:last + 3]
    assert new[:last + 1] + new[last + 3 + lay.unwind:] == [s if s[0] != PT_PHDR else new[[q[0] for q in new].index(PT_PHDR)]
                                                for s in old]
    (rxs, rws) = added
    assert (rxs[0], rxs[1], rws[0], rws[1]) == (PT_LOAD, PF_R | PF_X, PT_LOAD, PF_R | PF_W)
    for s in added:
        assert s[7] == W.PAGE and s[2] % W.PAGE == s[3] % W.PAGE == 0
    assert (rxs[3], rxs[2], rxs[5]) == (lay.rx_vaddr, lay.rx_offset, len(rx))
    assert (rws[3], rws[5], rws[6]) == (rw_vaddr, len(rw), 0x3000)
    assert rws[2] - rxs[2] == rws[3] - rxs[3]                    # one skew for both
    loads = [s for s in new if s[0] == PT_LOAD]
    assert [s[3] for s in loads] == sorted(s[3] for s in loads)
    for a, b in zip(loads, loads[1:]):
        assert a[3] + a[6] <= b[3]
    # The moved table: at the start of the new R-X segment, covering every header.
    if any(s[0] == PT_PHDR for s in old):
        phdr = next(s for s in new if s[0] == PT_PHDR)
        assert (phdr[2], phdr[3], phdr[5]) == (lay.rx_offset, lay.rx_vaddr, len(new) * 56)
    assert struct.unpack_from("<Q", out, 32)[0] == lay.rx_offset
    assert out[rxs[2] + lay.phdr_size:rxs[2] + rxs[5]] == rx[lay.phdr_size:]
    assert out[rws[2]:rws[2] + len(rw)] == rw
    path = progs["dir"] / f"{kind}.out"
    path.write_bytes(out)
    path.chmod(0o755)
    r = run(path, runner=LOCAL, timeout=20)
    assert (r.returncode, r.stdout) == (0, "hello 42\n"), r.stderr


@pytest.mark.parametrize("kind", ["pie", "nopie"])
def test_written_sections(progs, kind):
    """Old section headers kept, ours appended with their contents at their offsets (an
    ALLOC one inside its segment, a non-ALLOC one after the segments), names in a new
    .shstrtab; pyelftools and readelf read it all without a warning."""
    image = Image(str(progs[kind]))
    lay, rx, rw_vaddr, rw, meta, out = _write(image)
    path = progs["dir"] / f"{kind}.sec"
    path.write_bytes(out)
    with open(progs[kind], "rb") as f:
        before = [(s.name, s.header.sh_type, s["sh_addr"], s["sh_offset"], s["sh_size"])
                  for s in ELFFile(f).iter_sections()]
    with open(path, "rb") as f:
        e = ELFFile(f)
        secs = list(e.iter_sections())
        after = [(s.name, s.header.sh_type, s["sh_addr"], s["sh_offset"], s["sh_size"]) for s in secs]
        assert [a for a in after[:len(before)] if a[0] != ".shstrtab"] == [b for b in before if b[0] != ".shstrtab"]
        by = {s.name: s for s in secs}
        assert [s.name for s in secs[len(before):]] == [".kprewrite.text", ".kprewrite.data", ".kprewrite.bss",
                                                         ".kprewrite.meta"]
        assert by[".kprewrite.text"].data() == rx[lay.phdr_size:]
        assert by[".kprewrite.text"]["sh_offset"] == lay.rx_offset + lay.phdr_size
        assert by[".kprewrite.data"].data() == rw
        assert by[".kprewrite.bss"]["sh_type"] == "SHT_NOBITS" and by[".kprewrite.bss"]["sh_size"] == 0x3000 - len(rw)
        assert by[".kprewrite.meta"].data() == meta and by[".kprewrite.meta"]["sh_addr"] == 0
        assert by[".kprewrite.meta"]["sh_offset"] >= lay.rx_offset + len(rx)
        shoff = e["e_shoff"]
        assert shoff % 8 == 0 and shoff + e["e_shnum"] * 64 == len(out)
    r = subprocess.run(["readelf", "-W", "-l", "-S", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert ".kprewrite.text" in r.stdout and ".kprewrite.meta" in r.stdout
    assert " LOAD " in r.stdout and "R E 0x1000" in r.stdout and "RW  0x1000" in r.stdout


def test_patches_and_entry(progs):
    """Code patches land at their addresses' file offsets, e_entry is set when given, and
    nothing else of the original's bytes changes but the ELF header's fields and the
    section-name table's header."""
    image = Image(str(progs["nopie"]))
    main = image.function_named("main").start
    lay, rx, _, _, _, out = _write(image, patches=[(main, b"\xcc\x90")], entry=lay_entry(image))
    off = image.offset_of(main)
    assert out[off:off + 2] == b"\xcc\x90"
    assert struct.unpack_from("<Q", out, 24)[0] == lay_entry(image)
    changed = [i for i in range(len(image.data)) if out[i] != image.data[i]]
    header = set(range(24, 32)) | set(range(32, 40)) | set(range(40, 48)) | set(range(56, 58)) | set(range(60, 64))
    shstr = struct.unpack_from("<H", image.data, 62)[0]
    shdr = struct.unpack_from("<Q", image.data, 40)[0] + shstr * 64
    allowed = header | {off, off + 1} | set(range(shdr, shdr + 64))
    assert set(changed) <= allowed, [hex(i) for i in sorted(set(changed) - allowed)][:10]


def lay_entry(image):
    return W.plan_layout(image).after_phdrs


def test_no_section_headers(progs, tmp_path):
    """An input without section headers (stripped of them): the output gets a NULL
    header, ours, and a .shstrtab of its own."""
    data = bytearray(progs["nopie"].read_bytes())
    struct.pack_into("<Q", data, 40, 0)
    struct.pack_into("<HH", data, 60, 0, 0)
    bare = tmp_path / "bare"
    bare.write_bytes(data)
    image = Image(str(bare))
    out = bytearray(data)
    shoff, shnum, shstrndx = append_section_headers(out, image, [NewSection(".kprewrite.meta", 1, 0, 0, b"meta!",
                                                                             align=1)], lambda s: 0)
    struct.pack_into("<Q", out, 40, shoff)
    struct.pack_into("<HH", out, 60, shnum, shstrndx)
    (tmp_path / "bare.out").write_bytes(out)
    with open(tmp_path / "bare.out", "rb") as f:
        e = ELFFile(f)
        assert [s.name for s in e.iter_sections()] == ["", ".kprewrite.meta", ".shstrtab"]
        assert e.get_section_by_name(".kprewrite.meta").data() == b"meta!"


def test_refused_layouts(progs, tmp_path):
    """A segment whose memory runs out of the jump's reach from the code, or one that
    would make the output hold hundreds of MiB of padding: one error each."""
    data = progs["nopie"].read_bytes()
    image = Image(str(progs["nopie"]))
    phoff = struct.unpack_from("<Q", data, 32)[0]
    last = max(i for i, s in enumerate(_segments(data)) if s[0] == PT_LOAD)
    # An arch whose far probes fall back one by one (FAR_FALLBACK) refuses only the padding.
    far = "MiB past the end of the file" if getattr(get_arch(image.machine), "FAR_FALLBACK", False) else "out of jump reach"
    for memsz, what in ((3 << 30, far), (600 << 20, "MiB past the end of the file")):
        bad = bytearray(data)
        struct.pack_into("<Q", bad, phoff + last * 56 + 40, memsz)
        p = tmp_path / f"bad{memsz}"
        p.write_bytes(bad)
        with pytest.raises(KprewriteError, match=what):
            W.plan_layout(Image(str(p)))
    assert W.plan_layout(image)
