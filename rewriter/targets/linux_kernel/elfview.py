"""A minimal read-only view of an ELF64 little-endian vmlinux held in memory.

The kernel readers (kallsyms, sites) need only the section and program headers and
address-to-file-offset translation, over bytes already read; this does that with
``struct`` and no parse of anything else.  (LIEF parses this ~52 MB vmlinux in about
0.08 s, so it would do too; this keeps the readers usable on a bytes object, e.g. a
vmlinux just decompressed from a bzImage, without a temporary file.)

Every malformed input is a one-line KprewriteError naming the file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from rewriter.errors import KprewriteError

SHT_NOBITS = 8
SHF_ALLOC = 0x2
SHF_EXECINSTR = 0x4
PT_LOAD = 1


@dataclass(frozen=True)
class Section:
    name: str
    type: int
    flags: int
    addr: int
    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.addr + self.size

    @property
    def executable(self) -> bool:
        return bool(self.flags & SHF_EXECINSTR)


@dataclass(frozen=True)
class Segment:
    vaddr: int
    offset: int
    filesz: int
    memsz: int
    flags: int


class ElfView:
    """Section headers, PT_LOAD segments and reads by virtual address."""

    def __init__(self, data: bytes, path: str = "vmlinux"):
        self.data = data
        self.path = path
        n = len(data)
        if n < 64 or data[:4] != b"\x7fELF":
            raise KprewriteError(f"{path}: not an ELF file")
        if data[4] != 2 or data[5] != 1:
            raise KprewriteError(f"{path}: not a 64-bit little-endian ELF (class {data[4]}, data {data[5]})")
        (e_type, e_machine, _ver, self.entry, phoff, shoff, _flags, _ehsize,
         phentsize, phnum, shentsize, shnum, shstrndx) = struct.unpack_from("<HHIQQQIHHHHHH", data, 16)
        self.e_type = e_type
        self.e_machine = e_machine
        if phnum and (phentsize < 56 or phoff + phentsize * phnum > n):
            raise KprewriteError(
                f"{path}: truncated ELF: program headers end at {phoff + phentsize * phnum:#x}, "
                f"beyond the end of the file ({n:#x})")
        if shnum and (shentsize < 64 or shoff + shentsize * shnum > n):
            raise KprewriteError(
                f"{path}: truncated ELF: section headers end at {shoff + shentsize * shnum:#x}, "
                f"beyond the end of the file ({n:#x})")
        self.segments: list[Segment] = []
        for i in range(phnum):
            p_type, p_flags, p_offset, p_vaddr, _paddr, p_filesz, p_memsz, _align = struct.unpack_from(
                "<IIQQQQQQ", data, phoff + i * phentsize)
            if p_type != PT_LOAD:
                continue
            if p_offset + p_filesz > n:
                raise KprewriteError(
                    f"{path}: truncated ELF: segment at file offset {p_offset:#x} ends at "
                    f"{p_offset + p_filesz:#x}, beyond the end of the file ({n:#x})")
            self.segments.append(Segment(p_vaddr, p_offset, p_filesz, p_memsz, p_flags))
        raw = []
        for i in range(shnum):
            raw.append(struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize))
        names = b""
        if raw and shstrndx < len(raw):
            s = raw[shstrndx]
            if s[4] + s[5] > n:
                raise KprewriteError(f"{path}: truncated ELF: section name table beyond the end of the file")
            names = data[s[4]:s[4] + s[5]]
        self.sections: list[Section] = []
        for sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, *_ in raw[1:]:
            end = names.find(b"\0", sh_name)
            name = names[sh_name:end if end >= 0 else None].decode("latin-1")
            if sh_type != SHT_NOBITS and sh_offset + sh_size > n:
                raise KprewriteError(
                    f"{path}: truncated ELF: section {name} ends at file offset {sh_offset + sh_size:#x}, "
                    f"beyond the end of the file ({n:#x})")
            self.sections.append(Section(name, sh_type, sh_flags, sh_addr, sh_offset, sh_size))
        self._by_name = {s.name: s for s in self.sections}

    def section(self, name: str) -> Section | None:
        return self._by_name.get(name)

    def section_at(self, addr: int) -> Section | None:
        """The allocated section (not .data..percpu, linked at 0) containing addr."""
        for s in self.sections:
            if s.flags & SHF_ALLOC and s.addr and s.addr <= addr < s.end:
                return s
        return None

    def offset_of(self, addr: int, size: int = 1) -> int:
        """File offset of [addr, addr+size) inside one PT_LOAD segment's file bytes."""
        for seg in self.segments:
            if seg.vaddr <= addr and addr + size <= seg.vaddr + seg.filesz:
                return seg.offset + addr - seg.vaddr
        raise KprewriteError(f"{self.path}: address {addr:#x} (+{size:#x}) is not in the file's loaded bytes")

    def has(self, addr: int, size: int = 1) -> bool:
        return any(seg.vaddr <= addr and addr + size <= seg.vaddr + seg.filesz for seg in self.segments)

    def read(self, addr: int, size: int) -> bytes:
        off = self.offset_of(addr, size)
        return self.data[off:off + size]

    def kernel_segments(self) -> list[Segment]:
        """PT_LOAD segments linked in the kernel's half (not the per-CPU one at 0)."""
        return [s for s in self.segments if s.vaddr >= 1 << 63]
