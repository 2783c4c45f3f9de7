"""Stage 7: write the output ELF.

Minimal surgery on the input's bytes, so everything the program had stays
where it was: the probe jumps are patched in place, and the new code and data
are appended as two new PT_LOAD segments (a third, read-only, for the unwind
tables of unwind.py).  The program header table moves into
the first of them, whose vaddr - offset equals the first segment's, so both
the kernel's and QEMU's AT_PHDR computations find it.  (LIEF reads the input;
its builder is not used to write, because adding segments with it shifts the
existing layout that our detours already point into.)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from ...arch import get_arch
from ...errors import KprewriteError
from ...elf.write import NewSection, append_section_headers  # noqa: F401  (NewSection: the target's API)
from ...elf.image import PF_R, PF_W, PF_X, PT_LOAD, PT_PHDR, Image

PAGE = 0x1000
PT_GNU_EH_FRAME = 0x6474E550
PHDR_SIZE = 56
NEW_PHDRS = 2
MAX_PADDING = 512 << 20


def page_up(x: int) -> int:
    return (x + PAGE - 1) & ~(PAGE - 1)


@dataclass
class Layout:
    """Where the new segments go, decided before anything is emitted."""
    skew: int          # vaddr - offset of the first PT_LOAD
    rx_vaddr: int      # V: program headers, stubs, detours, runtime code
    rx_offset: int
    phdr_size: int
    unwind: bool = False  # a third PT_LOAD, after the data, holds unwind tables (unwind.py)
    data_vaddr = None  # the runtime's data follows its code (link/ld.py's default)

    @property
    def after_phdrs(self) -> int:
        return self.rx_vaddr + ((self.phdr_size + 63) & ~63)


def plan_layout(image: Image) -> Layout:
    loads = [s for s in image.segments if s.type == PT_LOAD]
    first = min(loads, key=lambda s: s.vaddr)
    skew = first.vaddr - first.offset
    max_end = max(s.vaddr + s.memsz for s in loads)
    v = page_up(max(max_end, len(image.data) + skew)) + PAGE
    # Detours are reached by the arch's jump from the code and jump back the same way
    # (x86-64: rel32, +-2 GiB); a segment (a damaged p_memsz, a bss of gigabytes) that
    # puts the end of the image out of that reach leaves no place for them.  An eighth
    # of the reach is kept for the new code itself (256 MiB of x86-64's).
    # An arch whose probes fall back one by one (FAR_FALLBACK: aarch64's B reaches
    # only +-128 MiB; optprobe refuses the sites out of reach) needs no such place.
    arch = get_arch(image.machine)
    reach = arch.JUMP_REACH
    lo = min((a for a, _ in image.exec_ranges), default=first.vaddr)
    far = v - lo > reach - (reach >> 3) and not getattr(arch, "FAR_FALLBACK", False)
    if far or v - skew < 0:
        raise KprewriteError(f"{image.path}: its PT_LOAD segments end at {max_end:#x}, out of jump reach "
                             f"of its code at {lo:#x}: no place for detours")
    # The new segments' file offset follows their address (so AT_PHDR finds the moved program
    # headers): whatever a segment's memory reaches past the file becomes zeros in the output.
    if v - skew - len(image.data) > MAX_PADDING:
        raise KprewriteError(f"{image.path}: its PT_LOAD segments end at {max_end:#x}, "
                             f"{(v - skew - len(image.data)) >> 20} MiB past the end of the file; the output "
                             f"would hold that much padding (at most {MAX_PADDING >> 20} MiB)")
    from .unwind import old_table
    unwind = old_table(image, get_arch(image.machine)) is not None
    nph = len(image.segments) + NEW_PHDRS + unwind
    return Layout(skew, v, v - skew, nph * PHDR_SIZE, unwind)


def write_image(image: Image, layout: Layout, patches: list[tuple[int, bytes]], rx: bytes,
                rw_vaddr: int, rw: bytes, rw_memsz: int, sections: list[NewSection],
                entry: int | None, file_patches: list[tuple[int, bytes]],
                unwind: tuple[int, bytes, int, int] | None = None) -> bytes:
    """Assemble the output bytes.  `rx` starts at layout.rx_vaddr and has room
    for the program headers at its beginning; `rw` is the data segment.
    unwind: (vaddr, bytes, hdr vaddr, hdr size) of a read-only segment after the
    data (unwind.build()), PT_GNU_EH_FRAME repointed at its hdr."""
    out = bytearray(image.data)
    spans = image.elf.load_spans
    for addr, code in patches:      # tens of thousands (retargeted branches): offset_of() inline
        for lo, hi, off in spans:
            if lo <= addr < hi:
                off += addr - lo
                break
        else:
            off = image.offset_of(addr)
        out[off:off + len(code)] = code
    for off, raw in file_patches:
        out[off:off + len(raw)] = raw
    # Program headers: the old ones, PT_PHDR moved, the new PT_LOADs after the last old one.
    e_phoff = int.from_bytes(out[32:40], "little")
    e_phnum = int.from_bytes(out[56:58], "little")
    old = [bytes(out[e_phoff + i * PHDR_SIZE:e_phoff + (i + 1) * PHDR_SIZE]) for i in range(e_phnum)]
    rx_off = layout.rx_offset
    rw_off = rx_off + (rw_vaddr - layout.rx_vaddr)
    new_loads = [
        struct.pack("<IIQQQQQQ", PT_LOAD, PF_R | PF_X, rx_off, layout.rx_vaddr, layout.rx_vaddr, len(rx), len(rx), PAGE),
        struct.pack("<IIQQQQQQ", PT_LOAD, PF_R | PF_W, rw_off, rw_vaddr, rw_vaddr, len(rw), rw_memsz, PAGE),
    ]
    if unwind is not None:
        u_vaddr, u_bytes, hdr_vaddr, hdr_size = unwind
        u_off = page_up(rw_off + len(rw)) + (u_vaddr & (PAGE - 1))
        new_loads.append(struct.pack("<IIQQQQQQ", PT_LOAD, PF_R, u_off, u_vaddr, u_vaddr, len(u_bytes), len(u_bytes),
                                     PAGE))
    elif layout.unwind:             # planned, none given: the loaders skip a PT_NULL
        new_loads.append(bytes(PHDR_SIZE))
    phdrs = []
    last_load = max(i for i, p in enumerate(old) if struct.unpack_from("<I", p)[0] == PT_LOAD)
    for i, p in enumerate(old):
        typ = struct.unpack_from("<I", p)[0]
        if typ == PT_PHDR:
            size = layout.phdr_size
            p = struct.pack("<IIQQQQQQ", PT_PHDR, PF_R, rx_off, layout.rx_vaddr, layout.rx_vaddr, size, size, 8)
        elif typ == PT_GNU_EH_FRAME and unwind is not None:
            h_off = u_off + hdr_vaddr - u_vaddr
            p = struct.pack("<IIQQQQQQ", PT_GNU_EH_FRAME, PF_R, h_off, hdr_vaddr, hdr_vaddr, hdr_size, hdr_size, 4)
        phdrs.append(p)
        if i == last_load:
            phdrs.extend(new_loads)
    table = b"".join(phdrs)
    assert len(table) == layout.phdr_size
    rx = table + rx[len(table):]
    # Lay out the file: pad to rx_off, rx, pad to rw_off, rw.
    if len(out) > rx_off:
        raise KprewriteError(f"{image.path}: internal layout error (file end {len(out):#x} past {rx_off:#x})")
    out += b"\0" * (rx_off - len(out)) + rx
    out += b"\0" * (rw_off - len(out)) + rw
    if unwind is not None:
        out += b"\0" * (u_off - len(out)) + u_bytes
    # Section headers: the old ones plus ours, and a new .shstrtab at the end.
    shoff, shnum, e_shstrndx = append_section_headers(
        out, image, sections,
        lambda s: (rx_off + s.addr - layout.rx_vaddr) if s.addr < rw_vaddr else
        (u_off + s.addr - u_vaddr) if unwind is not None and s.addr >= u_vaddr else (rw_off + s.addr - rw_vaddr))
    # ELF header.
    struct.pack_into("<Q", out, 32, rx_off)                 # e_phoff
    struct.pack_into("<H", out, 56, len(phdrs))             # e_phnum
    struct.pack_into("<Q", out, 40, shoff)                  # e_shoff
    struct.pack_into("<H", out, 60, shnum)                  # e_shnum
    struct.pack_into("<H", out, 62, e_shstrndx)             # e_shstrndx
    if entry is not None:
        struct.pack_into("<Q", out, 24, entry)
    return bytes(out)
