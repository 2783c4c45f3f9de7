"""A small, read-only view of an ELF64 little-endian file held in memory.

The ELF header is read when the view is made; the program and section headers
are read with ``struct`` the first time they are asked for (a symbol table or
the dynamic entries each time they are), and every later question (which
segment holds an address, the file offset of a link-time address, the bytes
there) is answered from those tables, never by parsing anything else.  It works
on bytes or a bytearray in place: a file just read, or a vmlinux just
decompressed from a bzImage, without a temporary file.

Its readers: image.Image (headers, the mapping of addresses to the file),
ehframe (where .eh_frame, .eh_frame_hdr, .got and the LSDAs are) and the kernel
readers (kallsyms, sites).  LIEF stays where it is used for more than this
(symbols with their types, dynamic entries, relocations), pyelftools for the
CFA programs.

Bad input: every structural fault (a table or a segment or a section running past
the end of the file, a header entry size too small) is one line of
KprewriteError, naming the file when the view has a path: ``<path>: truncated ELF
file (section .text ends at 0x..., file is 0x... bytes)``.  Reads by address are
bounds-checked the same way; the ``offset()``/``has()`` forms answer None/False
instead of raising.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator

from ..errors import KprewriteError

__all__ = ["ElfView", "Section", "Segment", "Symbol"]

# e_type
ET_EXEC, ET_DYN = 2, 3
# p_type, p_flags
PT_NULL, PT_LOAD, PT_DYNAMIC, PT_INTERP, PT_NOTE, PT_PHDR = 0, 1, 2, 3, 4, 6
PT_GNU_EH_FRAME = 0x6474E550
PT_GNU_RELRO = 0x6474E552
PF_X, PF_W, PF_R = 1, 2, 4
# sh_type, sh_flags
SHT_NULL, SHT_SYMTAB, SHT_RELA, SHT_NOBITS, SHT_DYNSYM = 0, 2, 4, 8, 11
SHN_UNDEF, SHN_ABS = 0, 0xFFF1
SHF_WRITE, SHF_ALLOC, SHF_EXECINSTR = 1, 2, 4
DT_NULL = 0

EHDR_SIZE, PHDR_SIZE, SHDR_SIZE, SYM_SIZE = 64, 56, 64, 24

_EHDR = struct.Struct("<HHIQQQIHHHHHH")        # from e_type (offset 16) to e_shstrndx
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_DYN = struct.Struct("<qQ")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class Segment:
    """A program header, as in the file."""
    type: int
    flags: int
    offset: int
    vaddr: int
    paddr: int
    filesz: int
    memsz: int
    align: int


@dataclass(frozen=True)
class Section:
    """A section header, its name read from the section name table ("" if none)."""
    name: str
    type: int
    flags: int
    addr: int
    offset: int
    size: int
    link: int = 0
    info: int = 0
    entsize: int = 0
    index: int = 0           # its index in the section header table
    align: int = 0

    @property
    def end(self) -> int:
        return self.addr + self.size

    @property
    def executable(self) -> bool:
        return bool(self.flags & SHF_EXECINSTR) and bool(self.flags & SHF_ALLOC)


@dataclass(frozen=True)
class Symbol:
    name: str
    value: int
    size: int
    type: int           # STT_*: 0 NOTYPE, 1 OBJECT, 2 FUNC, 10 GNU_IFUNC ...
    bind: int           # STB_*
    shndx: int


def _name(b: bytes) -> str:
    return b.decode("utf-8", "backslashreplace")


class ElfView:
    """The headers of an ELF64 little-endian file in `data` and reads by address.

    `path` names the file in every error (None: messages without it, for a
    caller that adds its own)."""

    def __init__(self, data: bytes, path: str | None = None):
        if not isinstance(data, (bytes, bytearray)):    # a memoryview: find() and slices need bytes
            data = bytes(data)
        self.data = data
        self.path = path
        n = len(data)
        if n < 4 or data[:4] != b"\x7fELF":
            raise self.error("not an ELF file")
        if n < EHDR_SIZE:
            raise self.error(f"truncated ELF file ({n} bytes, the ELF header alone needs {EHDR_SIZE})")
        if data[4] != 2 or data[5] != 1:
            raise self.error("not a 64-bit little-endian ELF file")
        (self.e_type, self.e_machine, _version, self.entry, self.phoff, self.shoff, _flags, _ehsize,
         self.phentsize, self.phnum, self.shentsize, self.shnum, self.shstrndx) = _EHDR.unpack_from(data, 16)

    def error(self, what: str) -> KprewriteError:
        """The one-line error about this file (to raise)."""
        return KprewriteError(f"{self.path}: {what}" if self.path is not None else what)

    def _truncated(self, what_ends: str, end: int) -> KprewriteError:
        return self.error(f"truncated ELF file ({what_ends} at {end:#x}, file is {len(self.data):#x} bytes)")

    # -- tables -----------------------------------------------------------------------
    @cached_property
    def segments(self) -> list[Segment]:
        """Every program header in file order.  A PT_LOAD's file bytes must be in the
        file and no more than its memory size."""
        n = len(self.data)
        if not self.phnum:
            return []
        if self.phentsize < PHDR_SIZE:
            raise self.error(f"bad ELF program header size {self.phentsize} (needs {PHDR_SIZE})")
        end = self.phoff + self.phnum * self.phentsize
        if end > n:
            raise self._truncated("program headers end", end)
        out = []
        for i in range(self.phnum):
            s = Segment(*_PHDR.unpack_from(self.data, self.phoff + i * self.phentsize))
            if s.type == PT_LOAD:
                if s.memsz < s.filesz:
                    raise self.error(f"malformed ELF file (a PT_LOAD segment at {s.vaddr:#x} has "
                                     f"p_filesz {s.filesz:#x} > p_memsz {s.memsz:#x})")
                if s.offset + s.filesz > n:
                    raise self._truncated("a PT_LOAD segment ends", s.offset + s.filesz)
            out.append(s)
        return out

    @cached_property
    def loads(self) -> list[Segment]:
        """The PT_LOAD segments, in file order."""
        return [s for s in self.segments if s.type == PT_LOAD]

    @cached_property
    def load_spans(self) -> list[tuple[int, int, int]]:
        """(vaddr, vaddr + filesz, file offset) of each PT_LOAD segment, in file order: what
        an address's file offset is looked up in (offset(); Image.read())."""
        return [(s.vaddr, s.vaddr + s.filesz, s.offset) for s in self.loads]

    def segment(self, type: int) -> Segment | None:
        """The first program header of a type (PT_DYNAMIC, PT_GNU_EH_FRAME...)."""
        for s in self.segments:
            if s.type == type:
                return s
        return None

    @cached_property
    def sections(self) -> list[Section]:
        """Every section header in file order (index 0, the null section, included);
        none when e_shoff or e_shnum is 0 (sstrip).  Each section but a
        SHT_NULL or SHT_NOBITS one must be in the file."""
        d, n = self.data, len(self.data)
        if not self.shoff or not self.shnum:
            return []
        if self.shentsize < SHDR_SIZE:
            raise self.error(f"bad ELF section header size {self.shentsize} (needs {SHDR_SIZE})")
        end = self.shoff + self.shnum * self.shentsize
        if end > n:
            raise self._truncated("section headers end", end)
        raw = [_SHDR.unpack_from(d, self.shoff + i * self.shentsize) for i in range(self.shnum)]
        lo = hi = 0
        if self.shstrndx < len(raw):
            s = raw[self.shstrndx]
            if s[1] != SHT_NOBITS:
                lo, hi = s[4], min(s[4] + s[5], n)
        out = []
        for i, (sh_name, typ, flags, addr, off, size, link, info, align, entsize) in enumerate(raw):
            name = ""
            a = lo + sh_name
            if a < hi:
                e = d.find(b"\0", a, hi)
                name = _name(d[a:e if e >= 0 else hi])
            if typ not in (SHT_NULL, SHT_NOBITS) and off + size > n:
                raise self._truncated(f"section {name or f'#{i} (no name)'} ends", off + size)
            out.append(Section(name, typ, flags, addr, off, size, link, info, entsize, i, align))
        return out

    @cached_property
    def _by_name(self) -> dict[str, Section]:
        out: dict[str, Section] = {}
        for s in self.sections:
            out.setdefault(s.name, s)           # the first of a duplicated name
        return out

    def section(self, name: str) -> Section | None:
        """The first section of this name."""
        return self._by_name.get(name)

    def section_at(self, addr: int) -> Section | None:
        """The allocated section linked at a nonzero address that contains addr (a
        kernel's .data..percpu, linked at 0, is not one)."""
        for s in self.sections:
            if s.flags & SHF_ALLOC and s.addr and s.addr <= addr < s.end:
                return s
        return None

    def section_bytes(self, s: Section) -> bytes:
        """A section's bytes (empty for SHT_NOBITS)."""
        return b"" if s.type == SHT_NOBITS else self.data[s.offset:s.offset + s.size]

    # -- addresses ----------------------------------------------------------------------
    def offset(self, addr: int, size: int = 1) -> int | None:
        """File offset of [addr, addr + size) when one PT_LOAD segment's file bytes hold
        it all (the first such segment), else None."""
        end = addr + size
        for lo, hi, off in self.load_spans:
            if lo <= addr and end <= hi:
                return off + addr - lo
        return None

    def has(self, addr: int, size: int = 1) -> bool:
        return self.offset(addr, size) is not None

    def offset_of(self, addr: int, size: int = 1) -> int:
        """offset(), raising when the bytes are not in the file."""
        off = self.offset(addr, size)
        if off is None:
            span = "" if size == 1 else f" (+{size:#x})"
            raise self.error(f"address {addr:#x}{span} is not in the file")
        return off

    def segment_end(self, addr: int) -> int | None:
        """File offset just past the file bytes of the PT_LOAD segment holding addr."""
        for lo, hi, off in self.load_spans:
            if lo <= addr < hi:
                return off + hi - lo
        return None

    def read(self, addr: int, size: int) -> bytes:
        """The `size` bytes at link-time address addr, all in one segment's file bytes."""
        off = self.offset_of(addr, size)
        return self.data[off:off + size]

    def read_u64(self, addr: int) -> int | None:
        """The little-endian 64-bit word at addr, None if not in the file."""
        off = self.offset(addr, 8)
        return None if off is None else _U64.unpack_from(self.data, off)[0]

    # -- dynamic section and symbols ----------------------------------------------------
    def dynamic(self) -> list[tuple[int, int]]:
        """(d_tag, d_val) of PT_DYNAMIC up to DT_NULL (a table cut by the end of the
        file or of the segment ends there)."""
        seg = self.segment(PT_DYNAMIC)
        if seg is None:
            return []
        out = []
        off, end = seg.offset, min(seg.offset + seg.filesz, len(self.data))
        while off + 16 <= end:
            tag, val = _DYN.unpack_from(self.data, off)
            if tag == DT_NULL:
                break
            out.append((tag, val))
            off += 16
        return out

    def symbols(self, table: str = ".symtab") -> Iterator[Symbol]:
        """The entries of a symbol table section (.symtab or .dynsym), index 0 included,
        names from its linked string table."""
        sec = self.section(table)
        if sec is None or sec.type == SHT_NOBITS:
            return
        yield from self.symbols_of(sec)

    def symbols_of(self, sec: Section) -> Iterator[Symbol]:
        """The entries of the symbol table section `sec`, as symbols() reads them."""
        d = self.data
        secs = self.sections
        lo = hi = 0
        if sec.link < len(secs) and secs[sec.link].type != SHT_NOBITS:
            st = secs[sec.link]
            lo, hi = st.offset, st.offset + st.size
        unpack = _SYM.unpack_from
        for off in range(sec.offset, sec.offset + sec.size - SYM_SIZE + 1, SYM_SIZE):
            st_name, info, _other, shndx, value, size = unpack(d, off)
            name = ""
            a = lo + st_name
            if st_name and a < hi:
                e = d.find(b"\0", a, hi)
                name = _name(d[a:e if e >= 0 else hi])
            yield Symbol(name, value, size, info & 0xF, info >> 4, shndx)


_RELA = struct.Struct("<QQq")


def relas(data: bytes, offset: int, size: int) -> list[tuple[int, int, int, int]]:
    """(r_offset, symbol index, type, r_addend) of each whole little-endian Elf64_Rela in
    data[offset:offset + size], as ELF64_R_SYM/ELF64_R_TYPE split r_info (a trailing
    partial entry, or one past the end of data, is not read)."""
    end = offset + min(size, len(data) - offset) // 24 * 24
    return [(off, info >> 32, info & 0xFFFFFFFF, addend)
            for off, info, addend in _RELA.iter_unpack(data[offset:end])]
