"""rewriter.targets.linux_kernel.x86_64.bzimage: Debian's real vmlinuz, every compressor the kernel
knows on a small made-up bzImage, and bad input (one line naming the file, nothing else)."""
from __future__ import annotations

import bz2
import gzip
import io
import lzma
import shutil
import struct
import subprocess
import zlib
from array import array
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from rewriter.errors import KprewriteError
from rewriter.targets.linux_kernel.x86_64 import bzimage

EXPECTED_SECTIONS = {".text", ".rodata", ".data", ".bss", "__ex_table", "__bug_table", ".orc_unwind",
                     ".orc_unwind_ip", ".retpoline_sites", ".return_sites", ".altinstructions",
                     ".altinstr_replacement", ".parainstructions", ".smp_locks", ".init.text",
                     ".init.data", ".notes", ".BTF", ".data..percpu"}
XEN_ELFNOTE_PHYS32_ENTRY = 18


# --- Debian's vmlinuz ----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def debian_bzimage(debian_kernel) -> bzimage.BzImage:
    return bzimage.read(debian_kernel.vmlinuz)


@pytest.mark.kernel
def test_debian_vmlinuz(debian_bzimage, debian_kernel):
    b = debian_bzimage
    d = b.describe()
    assert b.compressor == "lz4" and d["boot_protocol"] == "2.15"
    assert b.header.payload_length == d["compressed_size"] and b.header.init_size >= len(b.payload)
    assert b.vmlinux == debian_kernel.vmlinux.read_bytes()      # what the harness boots
    assert b.relocs_bytes == debian_kernel.relocs.read_bytes()
    elf = ELFFile(io.BytesIO(b.vmlinux))
    assert (elf.elfclass, elf.little_endian, elf.header["e_type"], elf.header["e_machine"]) == \
        (64, True, "ET_EXEC", "EM_X86_64")
    names = {s.name for s in elf.iter_sections()}
    assert EXPECTED_SECTIONS <= names, EXPECTED_SECTIONS - names
    assert ".symtab" not in names                                  # stripped: symbols are in kallsyms
    notes = [(n["n_name"], n["n_type"]) for n in elf.get_section_by_name(".notes").iter_notes()]
    assert ("Xen", XEN_ELFNOTE_PHYS32_ENTRY) in notes, notes       # the PVH entry QEMU boots through
    print("\n" + b.summary())


@pytest.mark.kernel
def test_debian_relocation_table(debian_bzimage):
    """The KASLR table after the ELF: three sorted lists of 32-bit truncated addresses, all inside
    the kernel image, read back to the same bytes."""
    b = debian_bzimage
    r = b.relocs
    assert r is not None and r.count > 100_000
    assert r.to_bytes() == b.relocs_bytes
    assert len(b.relocs_bytes) == 4 * (r.count + 3)
    elf = ELFFile(io.BytesIO(b.vmlinux))
    loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD" and s["p_vaddr"]]
    lo = min(s["p_vaddr"] for s in loads)
    hi = max(s["p_vaddr"] + s["p_memsz"] for s in loads)
    for lst in (r.relocs64, r.relocs32neg, r.relocs32):
        assert len(lst) and list(lst) == sorted(lst)
        assert lo <= (0xFFFFFFFF00000000 | lst[0]) and (0xFFFFFFFF00000000 | lst[-1]) < hi


def _mutated(src: Path, dst: Path, edit) -> Path:
    data = bytearray(src.read_bytes())
    data = edit(data) or data
    dst.write_bytes(bytes(data))
    return dst


def _payload_start(data) -> int:
    return ((data[0x1F1] or 4) + 1) * 512 + struct.unpack_from("<I", data, 0x248)[0]


def _set_version(v):
    def edit(d):
        struct.pack_into("<H", d, 0x206, v)
    return edit


def _zero_magic(d):
    p = _payload_start(d)
    d[p:p + 4] = b"\x00\x11\x22\x33"


def _short_length(d):   # the header claims less than the stream: the stream is cut
    struct.pack_into("<I", d, 0x24C, struct.unpack_from("<I", d, 0x24C)[0] // 2)


def _cut_file(d):       # the file ends before the payload does
    return d[:len(d) // 2]


def _no_hdrs(d):
    d[0x202:0x206] = b"XXXX"


BAD = {
    "unknown-version": (_set_version(0x0210), "unknown boot protocol 2.16"),
    "old-version": (_set_version(0x0206), "boot protocol 2.06 in the setup header is older than 2.08"),
    "unsupported-compressor": (_zero_magic, "unsupported payload compressor (magic 00 11 22 33"),
    "truncated-stream": (_short_length, "truncated or corrupt lz4 payload"),
    "truncated-file": (_cut_file, "truncated payload: the setup header puts"),
    "not-a-bzimage": (_no_hdrs, "not a bzImage"),
}


@pytest.mark.kernel
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_vmlinuz(case, debian_kernel, tmp_path):
    edit, expect = BAD[case]
    bad = _mutated(debian_kernel.vmlinuz, tmp_path / f"vmlinuz-{case}", edit)
    before = sorted(tmp_path.iterdir())
    with pytest.raises(KprewriteError) as e:
        bzimage.read(bad)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{bad}: ") and expect in msg, msg
    assert sorted(tmp_path.iterdir()) == before                    # nothing written


# --- every compressor, on a small made-up bzImage ---------------------------------------------------------

def _small_vmlinux() -> bytes:
    """A real x86-64 ELF (a system program) followed by a well-formed relocation table."""
    elf = Path(shutil.which("true") or "/bin/true").read_bytes()
    table = array("I", [0, 0x81000010, 0x81000020, 0, 0x81000030, 0, 0x81000040, 0x81000050, 0x81000060])
    return elf + table.tobytes()


def _size_append(data: bytes, compressed: bytes) -> bytes:
    return compressed + struct.pack("<I", len(data) & 0xFFFFFFFF)


def _lz4_legacy(data: bytes) -> bytes:
    if shutil.which("lz4"):       # the kernel's own command: lz4 -l -c1
        return subprocess.run(["lz4", "-l", "-9", "-c", "-", "-"], input=data, capture_output=True,
                              check=True).stdout
    import lz4.block
    out = [struct.pack("<I", bzimage.LZ4_LEGACY_MAGIC)]
    for i in range(0, len(data), bzimage.LZ4_LEGACY_BLOCK):
        blk = lz4.block.compress(data[i:i + bzimage.LZ4_LEGACY_BLOCK], store_size=False)
        out += [struct.pack("<I", len(blk)), blk]
    return b"".join(out)


def _zstd(data: bytes) -> bytes:
    zstandard = pytest.importorskip("zstandard")
    c = zstandard.ZstdCompressor(level=19).compressobj()
    return c.compress(data) + c.flush()


def _lzo(data: bytes) -> bytes:
    if not shutil.which("lzop"):
        pytest.skip("lzop not installed (Debian package lzop)")
    return subprocess.run(["lzop", "-9", "-c", "-q"], input=data, capture_output=True, check=True).stdout


COMPRESS = {   # as the kernel's Makefiles compress (scripts/Makefile.lib), then size_append
    "gzip": lambda d: gzip.compress(d, 9, mtime=0),
    "xz": lambda d: _size_append(d, lzma.compress(d, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32, filters=[
        {"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 6}])),
    "lzma": lambda d: _size_append(d, lzma.compress(d, format=lzma.FORMAT_ALONE, preset=9)),
    "lz4": lambda d: _size_append(d, _lz4_legacy(d)),
    "zstd": lambda d: _size_append(d, _zstd(d)),
    "bzip2": lambda d: _size_append(d, bz2.compress(d, 9)),
    "lzo": lambda d: _size_append(d, _lzo(d)),
}


def make_bzimage(payload: bytes, version: int = 0x020F, setup_sects: int = 1, payload_offset: int = 0x3C0) -> bytes:
    """The smallest file bzimage.py reads: a boot sector with the setup header, setup sectors,
    then protected-mode code (here filler) with the payload at ``payload_offset``."""
    setup = bytearray(((setup_sects or 4) + 1) * 512)
    setup[0x1F1] = setup_sects
    setup[0x1FE:0x200] = b"\x55\xaa"
    setup[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", setup, 0x206, version)
    setup[0x211] = 0x01                                     # LOADED_HIGH
    struct.pack_into("<II", setup, 0x248, payload_offset, len(payload))
    struct.pack_into("<I", setup, 0x260, 4 * len(payload) + (1 << 20))
    return bytes(setup) + b"\x90" * payload_offset + payload + b"\0" * 16


@pytest.mark.parametrize("name", bzimage.COMPRESSORS)
def test_each_compressor(name, tmp_path):
    vmlinux = _small_vmlinux()
    path = tmp_path / f"bzImage.{name}"
    path.write_bytes(make_bzimage(COMPRESS[name](vmlinux)))
    b = bzimage.read(path)
    assert b.compressor == name
    assert b.payload == vmlinux
    assert b.vmlinux == Path(shutil.which("true") or "/bin/true").read_bytes()
    assert list(b.relocs.relocs64) == [0x81000010, 0x81000020]
    assert list(b.relocs.relocs32neg) == [0x81000030]
    assert list(b.relocs.relocs32) == [0x81000040, 0x81000050, 0x81000060]
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]   # no temporary files


@pytest.mark.parametrize("name", ["gzip", "xz", "lz4", "zstd", "bzip2"])
def test_each_compressor_truncated(name, tmp_path):
    """A payload cut short inside its stream: one line, whatever the compressor."""
    compressed = COMPRESS[name](_small_vmlinux())
    path = tmp_path / f"bzImage.{name}"
    path.write_bytes(make_bzimage(compressed[:len(compressed) * 2 // 3]))
    with pytest.raises(KprewriteError) as e:
        bzimage.read(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}: truncated or corrupt {name} payload"), msg


def test_wrong_size_trailer(tmp_path):
    compressed = bytearray(COMPRESS["xz"](_small_vmlinux()))
    compressed[-4:] = struct.pack("<I", 12345)
    path = tmp_path / "bzImage"
    path.write_bytes(make_bzimage(bytes(compressed)))
    with pytest.raises(KprewriteError, match=r"decompresses to (more than )?\d+ bytes, its trailer says 12345"):
        bzimage.read(path)


def test_payload_not_elf(tmp_path):
    path = tmp_path / "bzImage"
    path.write_bytes(make_bzimage(COMPRESS["gzip"](b"\0" * 4096)))
    with pytest.raises(KprewriteError, match=r": the decompressed payload is not an ELF vmlinux"):
        bzimage.read(path)


def test_elf_without_relocs(tmp_path):
    """CONFIG_RELOCATABLE=n: the payload is the ELF alone."""
    elf = Path(shutil.which("true") or "/bin/true").read_bytes()
    path = tmp_path / "bzImage"
    path.write_bytes(make_bzimage(COMPRESS["gzip"](elf)))
    b = bzimage.read(path)
    assert b.vmlinux == elf and b.relocs is None and b.relocs_bytes == b""


def test_missing_file(tmp_path):
    with pytest.raises(KprewriteError, match=r"/nope: no such file"):
        bzimage.read(tmp_path / "nope")


def test_is_bzimage():
    img = make_bzimage(COMPRESS["gzip"](_small_vmlinux()))
    assert bzimage.is_bzimage(img)
    assert not bzimage.is_bzimage(Path(shutil.which("true") or "/bin/true").read_bytes())
    assert not bzimage.is_bzimage(b"")


def test_missing_decoder_package(tmp_path, monkeypatch):
    """Without the Python package a compressor needs: one line naming the package."""
    path = tmp_path / "bzImage"
    path.write_bytes(make_bzimage(COMPRESS["lz4"](_small_vmlinux())))
    monkeypatch.setitem(__import__("sys").modules, "lz4.block", None)
    with pytest.raises(KprewriteError, match=r": an LZ4 payload needs the Python package lz4 \(pip install lz4\)$"):
        bzimage.read(path)


# --- writing a bzImage (bzimage_write.py) -----------------------------------------------------------------

def _kernel_like_elf(noise: bool = True) -> bytes:
    """An x86-64 ELF laid out like a vmlinux: two PT_LOADs at p_paddr-relative offsets with
    padding between them, p_align 2 MiB; its text random (noise), else zeros (what a rewrite
    filling it with compressible code leaves room for)."""
    import random
    rnd = random.Random(12)
    text = rnd.randbytes(0x800) if noise else bytes(0x800)
    data = bytes(rnd.choice(b"\0\0\0\x01\xff") for _ in range(0x400))
    out = bytearray(0x4400)
    out[:16] = b"\x7fELF\x02\x01\x01" + bytes(9)
    struct.pack_into("<HHIQQQIHHHHHH", out, 16, 2, 62, 1, 0xFFFFFFFF81000000, 64, 0, 0, 64, 56, 2, 64, 0, 0)
    struct.pack_into("<IIQQQQQQ", out, 64, 1, 5, 0x2000, 0xFFFFFFFF81000000, 0x1000000, 0x800, 0x800, 0x200000)
    struct.pack_into("<IIQQQQQQ", out, 120, 1, 6, 0x4000, 0xFFFFFFFF81001000, 0x1001000, 0x400, 0x1000, 0x200000)
    out[0x2000:0x2800] = text
    out[0x4000:0x4400] = data
    return bytes(out)


def _table(n: int) -> bzimage.RelocTable:
    return bzimage.RelocTable(array("I", [0x81000000 + 8 * i for i in range(n)]), array("I", [0x81000400]),
                              array("I", [0x81000010, 0x81000020]))


def _zo_bzimage(name: str, payload: bytes) -> bytes:
    """make_bzimage() with what the writer also needs: ZO's input_len/output_len words after
    the payload (mkpiggy.c) and tools/build.c's CRC-32 at the end."""
    compressed = COMPRESS[name](payload)
    img = bytearray(make_bzimage(compressed))
    struct.pack_into("<II", img, len(img) - 16, len(compressed), len(payload))
    img += bytes(4)
    struct.pack_into("<I", img, len(img) - 4, ~zlib.crc32(bytes(img[:-4])) & 0xFFFFFFFF)
    return bytes(img)


@pytest.mark.parametrize("name", [c for c in bzimage.COMPRESSORS if c != "lzo"])
def test_write_each_compressor(name, tmp_path):
    """A rewritten ELF and a longer table back in the payload: same file size, same compressor,
    the decompressed payload exactly output_len bytes (ELF re-laid, zeros, the table last),
    input_len, payload_length and the CRC-32 updated, nothing else changed."""
    from rewriter.targets.linux_kernel.x86_64 import bzimage_write
    old = _zo_bzimage(name, _kernel_like_elf() + _table(4).to_bytes())
    b = bzimage.parse(old, "in")
    elf = _kernel_like_elf(noise=False)
    new = bzimage_write.build(b, elf, _table(300), "in")
    assert len(new) == len(old)
    c = bzimage.parse(new, "out")
    assert c.compressor == name and len(c.payload) == len(b.payload)
    assert c.relocs == _table(300) and c.payload.endswith(_table(300).to_bytes())
    compact = bzimage_write.compact_elf(elf, "in")
    assert len(compact) == 0x2400 and c.vmlinux == compact
    tail = len(_table(300).to_bytes())
    assert c.payload[len(compact):-tail] == bytes(len(c.payload) - len(compact) - tail)
    n = c.header.payload_length
    assert struct.unpack_from("<II", new, len(new) - 20) == (n, len(b.payload))
    assert bzimage_write.crc32_ok(new)
    same = bytearray(new)
    start = b.header.payload_start
    for lo, hi in ((0x24C, 0x250), (len(old) - 20, len(old) - 16), (len(old) - 4, len(old)),
                   (start, start + b.header.payload_length)):
        same[lo:hi] = old[lo:hi]
    assert same == old


def _parse_elf(payload: bytes) -> list[bytes]:
    """arch/x86/boot/compressed/misc.c's parse_elf(): each PT_LOAD memmove()d, in program
    header order, to output + p_paddr - LOAD_PHYSICAL_ADDR (the lowest p_paddr here).
    Returns each segment's bytes where they landed (between them, stale bytes of no use)."""
    out = bytearray(payload)
    phoff, = struct.unpack_from("<Q", payload, 0x20)
    phnum, = struct.unpack_from("<H", payload, 0x38)
    loads = [struct.unpack_from("<IIQQQQQQ", payload, phoff + 56 * i) for i in range(phnum)]
    loads = [p for p in loads if p[0] == 1]
    base = min(p[4] for p in loads)
    for p in loads:
        assert p[7] % 0x200000 == 0                         # "Alignment of LOAD segment isn't multiple of 2MB"
        out[p[4] - base:p[4] - base + p[5]] = out[p[2]:p[2] + p[5]]
    return [bytes(out[p[4] - base:p[4] - base + p[5]]) for p in loads]


@pytest.mark.kernel
def test_compact_vmlinux_places_what_parse_elf_places(debian_bzimage):
    """Debian's vmlinux re-laid: parse_elf() builds the same kernel in memory from it, and the
    room it frees before output_len is the padding between the original's PT_LOADs."""
    from rewriter.targets.linux_kernel.x86_64 import bzimage_write
    b = debian_bzimage
    compact = bzimage_write.compact_elf(b.vmlinux, "vmlinuz")
    assert _parse_elf(compact) == _parse_elf(b.payload)
    assert bzimage_write.memory_end(compact) <= len(compact) and b.elf_size - len(compact) > 4_000_000
    print(f"\nvmlinux {b.elf_size} bytes, re-laid {len(compact)}: room for "
          f"{(len(b.payload) - len(compact)) // 4 - b.relocs.count - 3} more KASLR relocations")


def test_write_refusals(tmp_path):
    from rewriter.targets.linux_kernel.x86_64 import bzimage_write
    elf = _kernel_like_elf(noise=False)
    b = bzimage.parse(_zo_bzimage("gzip", elf + _table(4).to_bytes()), "in")
    with pytest.raises(KprewriteError) as e:
        bzimage_write.build(b, elf, _table(2100), "in")
    assert str(e.value) == ("in: the rewritten vmlinux (9216 bytes) and its relocation table (8424 bytes) exceed "
                            "the decompressor's output_len (17448 bytes)"), e.value
    with pytest.raises(KprewriteError, match=r"^in: the rewritten kernel compresses \(gzip\) to \d+ bytes; the "
                                             r"decompressor has room for \d+ \(the original payload's length\)$"):
        bzimage_write.build(b, _kernel_like_elf(noise=True), _table(4), "in")
    lzo = bzimage.BzImage("in", b.header, "lzo", b.payload, b.elf_size, b.relocs, b.raw)
    with pytest.raises(KprewriteError, match=r"^in: writing a bzImage with a lzo payload is not supported"):
        bzimage_write.build(lzo, elf, _table(4), "in")


INSTRUMENT_BAD = ("unknown-version", "unsupported-compressor", "truncated-stream", "truncated-file")


@pytest.mark.kernel
@pytest.mark.parametrize("case", INSTRUMENT_BAD)
def test_instrument_bad_vmlinuz(case, debian_kernel, tmp_path):
    """instrument on a bad bzImage: one line naming the file, exit 1, nothing written."""
    import os
    import sys
    edit, expect = BAD[case]
    bad = _mutated(debian_kernel.vmlinuz, tmp_path / f"vmlinuz-{case}", edit)
    spec = tmp_path / "p.toml"
    spec.write_text('handlers = ["h.c"]\n[[kprobe]]\nsymbol_name = "kernel_clone"\npre_handler = "pre"\n')
    (tmp_path / "h.c").write_text("#include <linux/kprobes.h>\n"
                                  "static int pre(struct kprobe *p, struct pt_regs *regs) { return 0; }\n")
    before = bad.read_bytes()
    out = tmp_path / "out"
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "rewriter", "instrument", str(bad), "--spec", str(spec), "-o", str(out)],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 1 and not out.exists() and bad.read_bytes() == before
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kprewrite: {bad}: ") and expect in lines[0], r.stderr
