"""rewriter.elf.view: the one ELF view elf/image.py, ehframe and the kernel readers share.

Read against pyelftools on real gcc output (a PIE, a non-PIE executable, a shared
object), then real truncations and mutations of those files: every fault is one line
of KprewriteError naming the file.  Fast: three small compiles, no rewrite."""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from conftest import ALL_ARCHES, FACTS, ROOT, cc
from rewriter.elf import ehframe
from rewriter import targets
from rewriter.elf.view import PT_DYNAMIC, PT_LOAD, SHT_NOBITS, ElfView
from rewriter.errors import KprewriteError
from rewriter.elf.image import Image
from rewriter.targets.linux_kernel import elfview as kernel_elfview

ARCHES = ALL_ARCHES

PROGRAM = r"""
#include <stdio.h>
int counter = 3;
static int table[64];
__attribute__((noinline)) int work(int x) { counter++; table[x & 63] = x; return x * x + 1; }
int main(int argc, char **argv) { printf("%d %s\n", work(argc), argv[0]); return table[1]; }
"""
LIBRARY = r"""
int lib_counter;
int lib_work(int x) { lib_counter++; return x * 5 + 1; }
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("elfview")
    return {
        "pie": cc(d, "pie", PROGRAM, "-O2", "-fPIE", "-pie"),
        "nopie": cc(d, "nopie", PROGRAM, "-O2", "-no-pie"),
        "lib.so": cc(d, "lib.so", LIBRARY, "-O2", "-shared", "-fPIC"),
    }


def reference(path: Path):
    """(segments, sections, symbols of .symtab, dynamic tags) as pyelftools reads them."""
    with open(path, "rb") as f:
        e = ELFFile(f)
        segs = [(s["p_offset"], s["p_vaddr"], s["p_paddr"], s["p_filesz"], s["p_memsz"], s["p_flags"], s["p_align"])
                for s in e.iter_segments()]
        secs = [(s.name, s["sh_addr"], s["sh_offset"], s["sh_size"], s["sh_flags"], s["sh_link"], s["sh_entsize"])
                for s in e.iter_sections()]
        symtab = e.get_section_by_name(".symtab")
        syms = [(s.name, s["st_value"], s["st_size"], s["st_shndx"] if isinstance(s["st_shndx"], int) else None)
                for s in symtab.iter_symbols()] if symtab else []
        dyn = e.get_section_by_name(".dynamic")
        tags = [t["d_val"] for t in dyn.iter_tags() if t.entry.d_tag != "DT_NULL"] if dyn else []
        header = (e["e_entry"], e["e_phnum"], e["e_shnum"])
    return header, segs, secs, syms, tags


def one_line(e: pytest.ExceptionInfo, path: str, *parts: str) -> str:
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and msg.startswith(f"{path}: "), msg
    assert all(p in msg for p in parts), (parts, msg)
    return msg


# --- against pyelftools -----------------------------------------------------------------
@pytest.mark.parametrize("name", ["pie", "nopie", "lib.so"])
def test_tables_match_pyelftools(files, name):
    path = files[name]
    v = ElfView(path.read_bytes(), str(path))
    (entry, phnum, shnum), segs, secs, syms, tags = reference(path)
    assert (v.entry, v.phnum, v.shnum, v.e_machine) == (entry, phnum, shnum, FACTS.E_MACHINE)
    assert [(s.offset, s.vaddr, s.paddr, s.filesz, s.memsz, s.flags, s.align) for s in v.segments] == segs
    assert [(s.name, s.addr, s.offset, s.size, s.flags, s.link, s.entsize) for s in v.sections] == secs
    mine = [(s.name, s.value, s.size, s.shndx) for s in v.symbols(".symtab")]
    assert [(n, a, z) for n, a, z, _ in mine] == [(n, a, z) for n, a, z, _ in syms]
    assert [val for _, val in v.dynamic()] == tags
    assert v.loads == [s for s in v.segments if s.type == PT_LOAD]
    assert v.section(".text").executable and not v.section(".data").executable
    assert v.section("no such section") is None


def test_addresses(files):
    path = files["pie"]
    data = path.read_bytes()
    v = ElfView(data, str(path))
    work = next(s for s in v.symbols() if s.name == "work")
    text = v.section(".text")
    assert text.addr <= work.value < text.end
    off = work.value - text.addr + text.offset
    assert v.offset(work.value) == v.offset_of(work.value, work.size) == off
    assert v.read(work.value, work.size) == data[off:off + work.size]
    assert v.section_at(work.value) == text and v.has(work.value, work.size)
    # .bss: in memory, not in the file
    bss = v.section(".bss")
    assert bss.type == SHT_NOBITS and v.offset(bss.addr + bss.size - 1) is None and not v.has(bss.addr)
    with pytest.raises(KprewriteError) as e:
        v.read(bss.addr, 4)
    one_line(e, str(path), f"address {bss.addr:#x} (+0x4) is not in the file")
    # a read may not run past its segment's file bytes
    last = max(v.loads, key=lambda s: s.vaddr)
    end = last.vaddr + last.filesz
    assert v.has(end - 8, 8) and not v.has(end - 8, 9)
    assert v.segment_end(end - 1) == last.offset + last.filesz
    got = v.section(".got")
    assert v.read_u64(got.addr) == struct.unpack_from("<Q", data, got.offset)[0]
    assert v.segment(PT_DYNAMIC).offset == v.section(".dynamic").offset


def test_users_share_the_view(files):
    """Image's sections and segments are the view's; ehframe reads through it; the
    kernel readers' ElfView is the same class, named "vmlinux" unless told."""
    path = files["pie"]
    image = Image(str(path))
    assert image.sections is image.elf.sections and image.segments is image.elf.segments
    assert image.section_named(".text") == image.elf.section(".text")
    assert ehframe.read_fdes(image.data) == ehframe.read_fdes(image.elf) == image.fdes
    k = kernel_elfview.ElfView(image.data)
    assert isinstance(k, ElfView) and k.path == "vmlinux" and k.sections == image.sections
    assert k.kernel_segments() == []                 # a user program: nothing in the kernel's half
    loaded = targets.load(str(path))
    assert loaded.target is targets.linux_user and targets.for_image(loaded) is targets.linux_user


def test_image_does_not_import_targets():
    """The loading order: elf/image.py reads an ELF; targets.load() opens containers and
    builds the Image (no cycle between image and targets)."""
    r = subprocess.run([sys.executable, "-c", "import sys, rewriter.elf.image; "
                        "print([m for m in sys.modules if m.startswith('rewriter.targets')])"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)


# --- truncations ----------------------------------------------------------------------
def test_truncations(files, tmp_path):
    path = files["nopie"]
    data = path.read_bytes()
    v = ElfView(data, "f")
    shoff = v.shoff
    text = v.section(".text")
    cases = {
        0: "not an ELF file",
        3: "not an ELF file",
        40: "truncated ELF file (40 bytes, the ELF header alone needs 64)",
        v.phoff + 10: "truncated ELF file (program headers end at",
        shoff + 100: "truncated ELF file (section headers end at",
        text.offset + 16: "truncated ELF file (",
    }
    for n, expect in cases.items():
        with pytest.raises(KprewriteError) as e:
            cut = ElfView(data[:n], "f")
            cut.segments, cut.sections          # the tables are read when asked  # noqa: B018
        one_line(e, "f", expect)
    # every cut is refused, by the kernel readers' view as soon as it is made, with the file's name
    for n in range(0, len(data), max(1, len(data) // 97)):
        with pytest.raises(KprewriteError) as e:
            kernel_elfview.ElfView(data[:n], "vmlinux.cut")
        one_line(e, "vmlinux.cut")
    # and by the Image, through the CLI's message
    for n in (40, text.offset + 16, len(data) - 1):
        p = tmp_path / f"cut{n}"
        p.write_bytes(data[:n])
        with pytest.raises(KprewriteError) as e:
            Image(str(p))
        one_line(e, str(p), "truncated ELF file")


def test_no_section_headers_is_not_an_error(files):
    """sstrip: e_shoff and e_shnum 0: no sections, the segments still map addresses."""
    data = bytearray(files["pie"].read_bytes())
    struct.pack_into("<Q", data, 40, 0)
    struct.pack_into("<HHH", data, 60, 0, 0, 0)
    v = ElfView(bytes(data), "stripped")
    assert v.sections == [] and v.section(".text") is None and v.loads
    assert ehframe.read_fdes(v) == ehframe.read_fdes(files["pie"].read_bytes())   # via .eh_frame_hdr


# --- mutations ------------------------------------------------------------------------
def mutated(path: Path, edit) -> bytes:
    b = bytearray(path.read_bytes())
    edit(b, ElfView(bytes(b)))
    return bytes(b)


def test_mutations(files):
    path = files["pie"]

    def sec_off(v, name):
        i = next(i for i, s in enumerate(v.sections) if s.name == name)
        return i, v.shoff + i * v.shentsize

    def raises(data, *parts):
        with pytest.raises(KprewriteError) as e:
            v = ElfView(data, "m")
            v.segments, v.sections          # noqa: B018
        return one_line(e, "m", *parts)

    raises(mutated(path, lambda b, v: b.__setitem__(4, 1)), "not a 64-bit little-endian ELF file")
    raises(mutated(path, lambda b, v: b.__setitem__(5, 2)), "not a 64-bit little-endian ELF file")
    raises(mutated(path, lambda b, v: struct.pack_into("<H", b, 54, 32)), "bad ELF program header size 32")
    raises(mutated(path, lambda b, v: struct.pack_into("<H", b, 58, 40)), "bad ELF section header size 40")
    raises(mutated(path, lambda b, v: struct.pack_into("<H", b, 56, 0xFFFF)), "program headers end at")

    def shrink_memsz(b, v):
        i = next(i for i, s in enumerate(v.segments) if s.type == PT_LOAD and s.filesz)
        struct.pack_into("<Q", b, v.phoff + i * v.phentsize + 40, v.segments[i].filesz - 1)
    raises(mutated(path, shrink_memsz), "malformed ELF file (a PT_LOAD segment at", "> p_memsz")

    def nameless_past_end(b, v):
        i, sh = sec_off(v, ".comment")
        struct.pack_into("<I", b, sh, 0)
        struct.pack_into("<Q", b, sh + 32, 1 << 20)
    i, _ = sec_off(ElfView(path.read_bytes()), ".comment")
    raises(mutated(path, nameless_past_end), f"truncated ELF file (section #{i} (no name) ends at")

    # a damaged name table: no names, no error
    v = ElfView(mutated(path, lambda b, v: struct.pack_into("<H", b, 62, 0xFFF0)), "m")
    assert v.sections and all(s.name == "" for s in v.sections) and v.section(".text") is None
    # a damaged .symtab link: names empty, values read
    v0 = ElfView(path.read_bytes())
    _, sh = sec_off(v0, ".symtab")
    v = ElfView(mutated(path, lambda b, _: struct.pack_into("<I", b, sh + 40, 0xFFFF)), "m")
    assert [s.value for s in v.symbols()] == [s.value for s in v0.symbols()]
    assert all(s.name == "" for s in v.symbols())


def test_bytes_of_any_kind(files):
    """A bytearray (a kernel's decompressed vmlinux) is read in place, a memoryview as bytes."""
    data = files["lib.so"].read_bytes()
    b = bytearray(data)
    assert ElfView(b, "lib").data is b
    for d in (b, memoryview(data)):
        v = ElfView(d, "lib")
        assert v.sections == ElfView(data).sections and v.read(v.entry, 4) == ElfView(data).read(v.entry, 4)
        assert ehframe.read_fdes(v) == ehframe.read_fdes(data)


def _lief_tables(path: Path):
    import lief
    b = lief.ELF.parse(str(path))
    from rewriter.elf.image import _Sym, text
    syms = [[_Sym(text(s.name), s.value, s.size, int(s.type), s.shndx) for s in t]
            for t in (b.symtab_symbols, b.dynamic_symbols)]
    return syms[0], syms[1], {int(e.tag): e.value for e in b.dynamic_entries} if b.dynamic_entries else {}


@pytest.mark.parametrize("name", ["pie", "nopie", "lib.so", "static"])
def test_symbols_read_as_lief_reads_them(files, tmp_path, name):
    """elf/image.py reads .symtab, .dynsym and the dynamic entries with ElfView (LIEF is
    not imported for them): the same symbols, in the same order, and the same entries
    (DT_NULL's included) as LIEF gives; the GOT slots sighook hooks likewise."""
    from rewriter.arch import get_arch
    from rewriter.elf.image import _own_tables
    from rewriter.targets.linux_user import sighook
    path = files.get(name) or cc(tmp_path, "static", PROGRAM + "#include <signal.h>\nvoid (*h)(int) = 0;\n"
                                 "int sig(void) { return signal(SIGUSR1, h) != 0; }\n", "-O2", "-static",
                                 skip_without_static=True)
    own = _own_tables(ElfView(path.read_bytes(), str(path)))
    assert own is not None
    assert own == _lief_tables(path)
    image = Image(str(path))
    arch = get_arch(image.machine)
    assert image._binary is None                    # not parsed by LIEF to load it
    slots = sighook.got_slots(image, arch)
    rels = image.binary.relocations
    ref = sorted({(r.address, sighook.HOOKS[r.symbol.name]) for r in rels
                  if int(r.type) & 0xFF in arch.r_got_slot and r.has_symbol and r.symbol.name in sighook.HOOKS})
    assert slots == ref


def test_symbols_of_a_library_with_signal_hooks():
    """A real library's GOT slots of signal functions (Debian's libpython imports
    sigaction and signal): read without LIEF, equal to LIEF's."""
    lib = Path("/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0")
    if not lib.exists():
        pytest.skip("no Debian libpython3.11")
    from rewriter.arch import get_arch
    from rewriter.targets.linux_user import sighook
    image = Image(str(lib))
    arch = get_arch(image.machine)
    slots = sighook.got_slots(image, arch)
    assert image._binary is None and slots
    ref = sorted({(r.address, sighook.HOOKS[r.symbol.name]) for r in image.binary.relocations
                  if int(r.type) & 0xFF in arch.r_got_slot and r.has_symbol and r.symbol.name in sighook.HOOKS})
    assert slots == ref
    assert _own_tables_equal(lib)


def _own_tables_equal(path: Path) -> bool:
    from rewriter.elf.image import _own_tables
    return _own_tables(ElfView(path.read_bytes(), str(path))) == _lief_tables(path)
