"""Unwind tables for a rewritten user ELF: the output's PT_GNU_EH_FRAME points
at a new .eh_frame_hdr whose table covers the image's own FDEs (left where they
are), the linked runtime's and handlers' (compiled with unwind tables, .eh_frame
kept by link.py) and one FDE per detour, return-site detour and out-of-line slot
(the arch's unwind module), all in a read-only segment after the runtime's data.
An unwinder finds FDEs only through that table (libgcc's _Unwind_Find_FDE, via
dl_iterate_phdr) or __register_frame, which the freestanding runtime cannot call;
so glibc's backtrace() in a handler goes on through the detour into the probed
function and its callers, as a kernel handler's stack does."""
from __future__ import annotations

from ...arch.base import unwind_info
from ...ehframe import write as ehw
from ...planner import INT3

PT_GNU_EH_FRAME = 0x6474E550


def eh_segment(image):
    """The image's PT_GNU_EH_FRAME, or None."""
    return next((s for s in image.segments if s.type == PT_GNU_EH_FRAME), None)


def old_table(image, arch):
    """(the image's .eh_frame address, its hdr's table), or None when the output
    gets no unwind tables: no PT_GNU_EH_FRAME with a searchable table, or an arch
    with no unwind module."""
    seg = eh_segment(image)
    if seg is None or unwind_info(arch) is None:
        return None
    try:
        return ehw.read_hdr_table(image.read, seg.vaddr, seg.memsz)
    except Exception:           # an unreadable header: the output keeps the image's own
        return None


def pieces(plan, layout, rx: bytes, arch) -> list[tuple[int, int, bytes]]:
    """(start, size, call frame program) of each piece of new code a handler can
    be called from: detours, return-site detours, out-of-line slots."""
    u = unwind_info(arch)
    out = []

    def add(at, size, hit):
        if size:
            off = at - layout.rx_vaddr
            out.append((at, size, u.fde_program(bytes(rx[off:off + size]), at, hit)))

    for site in plan.sites:
        key = ("xol", site.index) if site.decision == INT3 else ("site", site.index)
        if key in layout.sizes and layout.detour(site):
            add(layout.detour(site), layout.sizes[key], site.addr)
    for rs in plan.ret_sites:
        add(layout.detour(rs), layout.sizes[("ret", rs.addr)], rs.addr)
    return sorted(out)


def build(image, arch, layout, rx: bytes, blob, plan, addr: int) -> tuple[bytes, int, int]:
    """The unwind tables at `addr`: (bytes, the hdr's address, its size)."""
    eh_old, table = old_table(image, arch)
    table = list(table)
    for name, typ, flags, a, size in blob.sections:     # the runtime's and handlers' FDEs
        if name == ".eh_frame":
            off = a - blob.text_addr
            table += ehw.read_fde_starts(blob.text[off:off + size], a)
    eh, index = ehw.eh_frame(addr, pieces(plan, layout, rx, arch), unwind_info(arch))
    table += index
    hdr_addr = addr + ((len(eh) + 7) & ~7)
    hdr = ehw.eh_frame_hdr(hdr_addr, eh_old, table)
    return eh + b"\0" * (hdr_addr - addr - len(eh)) + hdr, hdr_addr, len(hdr)
