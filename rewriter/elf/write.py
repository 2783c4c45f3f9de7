"""Adding sections to an ELF file being written: the part of writing an image
that every target shares (a user ELF gets new segments too; a kernel image gets
its new code in place)."""
from __future__ import annotations

import struct
from dataclasses import dataclass

from .image import Image

SHDR_SIZE = 64


@dataclass
class NewSection:
    name: str
    type: int
    flags: int
    addr: int
    data: bytes
    size: int = -1      # for NOBITS
    align: int = 16


def append_section_headers(out: bytearray, image: Image, sections: list[NewSection], alloc_offset) -> tuple[int, int, int]:
    """Append our sections' contents (non-ALLOC ones; ALLOC ones lie in a segment
    already written, at alloc_offset(section)), a new .shstrtab and the section
    header table (the old headers plus ours) to `out`.  Returns (e_shoff, e_shnum,
    e_shstrndx) for the ELF header."""
    e_shoff = int.from_bytes(image.data[40:48], "little")
    e_shnum = int.from_bytes(image.data[60:62], "little")
    e_shstrndx = int.from_bytes(image.data[62:64], "little")
    shdrs = [bytearray(image.data[e_shoff + i * SHDR_SIZE:e_shoff + (i + 1) * SHDR_SIZE]) for i in range(e_shnum)] if e_shoff else []
    if shdrs and e_shstrndx < len(shdrs):
        sh = shdrs[e_shstrndx]
        off, size = struct.unpack_from("<QQ", sh, 24)
        strtab = bytearray(image.data[off:off + size])
    else:
        shdrs = [bytearray(SHDR_SIZE)]
        strtab = bytearray(b"\0")
        e_shstrndx = None
    for s in sections:
        name_off = len(strtab)
        strtab += s.name.encode() + b"\0"
        if s.flags & 2:      # SHF_ALLOC: lies in a segment already written
            off = alloc_offset(s)
        else:
            while len(out) % s.align:
                out += b"\0"
            off = len(out)
            out += s.data
        size = s.size if s.size >= 0 else len(s.data)
        shdrs.append(bytearray(struct.pack("<IIQQQQIIQQ", name_off, s.type, s.flags, s.addr, off, size, 0, 0, s.align, 0)))
    if e_shstrndx is None:
        shstr_name = len(strtab)
        strtab += b".shstrtab\0"
        e_shstrndx = len(shdrs)
        shdrs.append(bytearray(struct.pack("<IIQQQQIIQQ", shstr_name, 3, 0, 0, 0, 0, 0, 0, 1, 0)))
    str_off = len(out)
    out += strtab
    struct.pack_into("<QQ", shdrs[e_shstrndx], 24, str_off, len(strtab))
    while len(out) % 8:
        out += b"\0"
    shoff = len(out)
    for sh in shdrs:
        out += sh
    return shoff, len(shdrs), e_shstrndx
