"""Where new code and data go in a kernel image, and how they survive the boot.

The gap between the end of .text and .rodata (PFN_ALIGN(_etext) .. __start_rodata) is in
the first PT_LOAD: loaded, mapped and executable from boot, zero-filled in the file.
mark_rodata_ro() would make it read-only and NX, then free it; three boot hooks (runtime
handlers on set_memory_ro(), set_memory_nx() and free_kernel_image_pages(), placed as any
probe; runtime/platform/linux_kernel/platform.c, startup.py) keep the pages we use: code
read-only and executable like .text, data NX, read-only from mark_rodata_ro() on where
it is .data..ro_after_init (first, page-aligned: link.RELRO), read-write after it (hits
write it).  A fourth, on setup_per_cpu_areas(), allocates every possible CPU's
counters from memblock.  The runtime's data goes
in the rodata/data gap (PFN_ALIGN(__end_rodata) .. _sdata), which mark_rodata_ro() frees
the same way; the first PT_LOAD is extended over it (extend_first_load()), so that it is
loaded (its file bytes are the padding before the second PT_LOAD's 2 MiB-aligned offset).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from ...errors import KprewriteError
from .symbols import PT_LOAD, symbol

PAGE = 0x1000


@dataclass
class GapLayout:
    rx_vaddr: int             # the first byte we use: PFN_ALIGN(_etext)
    end: int                  # __start_rodata
    data_vaddr: int           # PFN_ALIGN(__end_rodata): the runtime's data
    data_end: int             # _sdata

    @property
    def after_phdrs(self) -> int:
        return self.rx_vaddr


def plan_layout(image) -> GapLayout:
    align = lambda a: (a + PAGE - 1) & ~(PAGE - 1)  # noqa: E731
    return GapLayout(align(symbol(image, "_etext")), symbol(image, "__start_rodata"),
                     align(symbol(image, "__end_rodata")), symbol(image, "_sdata"))


def code_room(image, lay) -> int:
    """What the text/rodata gap has left after the detours, for the runtime's code and
    rodata (emit/tables.py places the site records by it)."""
    return lay.target.end - lay.text_addr


def extend_first_load(image, out: bytearray, data_vaddr: int, data_end: int):
    """Extend the PT_LOAD that ends in the rodata/data gap over [data_vaddr, data_end), so
    that the loader (QEMU's PVH loader, the decompressor's parse_elf()) copies our data;
    the file bytes there are the padding before the next PT_LOAD and must be zero.
    Returns the file offset of an address, the extended segment included."""
    e_phoff, = struct.unpack_from("<Q", out, 32)
    e_phnum, = struct.unpack_from("<H", out, 56)
    for i in range(e_phnum):
        at = e_phoff + 56 * i
        p_type, _, p_offset, p_vaddr, _, p_filesz, p_memsz, _ = struct.unpack_from("<IIQQQQQQ", out, at)
        if p_type == PT_LOAD and p_vaddr <= data_vaddr and p_vaddr + p_memsz <= data_vaddr < p_vaddr + 0x40000000:
            end_off = p_offset + (data_end - p_vaddr)
            others = [s for s in image.segments if s.type == PT_LOAD and s.vaddr != p_vaddr]
            if p_filesz != p_memsz or any(p_offset + p_filesz < s.offset + s.filesz and s.offset < end_off for s in others) \
                    or end_off > len(out) or any(out[p_offset + p_filesz:end_off]):
                break
            if data_end > data_vaddr:
                struct.pack_into("<QQ", out, at + 32, data_end - p_vaddr, data_end - p_vaddr)

            def offset_of(addr: int, base=p_offset - p_vaddr, lo=p_vaddr, hi=data_end) -> int:
                return base + addr if lo <= addr < max(hi, lo + 1) else image.offset_of(addr)
            return offset_of
    raise KprewriteError(f"{image.path}: the rodata/data gap at {data_vaddr:#x} is not file padding after "
                         "a PT_LOAD; cannot place the probes' data there")
