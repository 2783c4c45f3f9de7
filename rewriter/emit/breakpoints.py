"""The breakpoint probes' descriptor table, arch-neutral: what kernel/kprobes.c keeps in
kprobe_table[] for get_kprobe(), here a C table the runtime's kp_breakpoint.h reads.  Each
site's descriptor row is the arch's (its kprobe_xol.descriptor(): struct kp_breakpoint_site of
runtime/arch/<arch>/kp_arch.h); the numbering, the hash by address and the single-step
entries are the same on every arch."""
from __future__ import annotations

from ..arch.base import SINGLESTEP

GOLDEN_RATIO_64 = 0x61C8864680B583EB   # the kernel's hash_64() multiplier (include/linux/hash.h)
HASH_EMPTY = 0xFFFFFFFF


def number_descriptors(sites) -> dict[int, int]:
    """Every breakpoint site's index in kp_breakpoints[] (table_c()'s order), by Site.index:
    what a slot that ends with a breakpoint carries (the arch's place_slot()'s desc)."""
    return {s.index: i for i, s in enumerate(s for s in sites if s.xol is not None)}


def descriptor_hash(addrs: list[int]) -> tuple[int, list[int]]:
    """The descriptors by address, open-addressed (linear probing), at most half full:
    (bits, slots), slot = hash_64(addr, bits), HASH_EMPTY where none; what get_kprobe()'s
    kprobe_table[] is to the kernel.  runtime/kp_breakpoint.h's kp_breakpoint_lookup()
    computes the same hash."""
    bits = 1
    while (1 << bits) < 2 * len(addrs):
        bits += 1
    size = 1 << bits
    slots = [HASH_EMPTY] * size
    for i, a in enumerate(addrs):
        h = ((a * GOLDEN_RATIO_64) & (2**64 - 1)) >> (64 - bits)
        while slots[h] != HASH_EMPTY:
            h = (h + 1) & (size - 1)
        slots[h] = i
    return bits, slots


def table_c(sites, slots: dict, xol, ro_after_init: bool = False) -> str:
    """The per-site descriptors in site order (xol.descriptor() writes each row), their hash
    by address, and the single-step entries in the order of their slots' ends.  slots: the
    layout's XolSlot by Site.index (xol.NO_SLOT for a site whose trap does the work).
    ro_after_init: the descriptors (never written at run time) in the section the runtime
    makes read-only once relocated (link.RELRO).  An arch whose single-stepped copies can
    end with a breakpoint (xol.SS_BREAKPOINT_SPAN) also gets the span of those ends, checked
    before a slot is read (x86-64's kp_int3_ss_end())."""
    rows, ss, ends = [], [], []
    for s in sites:
        x = s.xol
        if x is None:
            continue
        slot = slots.get(s.index, xol.NO_SLOT)
        if x.mode == SINGLESTEP:
            ss.append((slot.ss_end, len(rows)))
            if getattr(x, "ss_breakpoint", False):
                assert slot.desc == len(rows), "a breakpoint-ended slot carries the wrong descriptor index"
                ends.append(slot.ss_end)
        rows.append(xol.descriptor(s, x, slot))
    bits, hashed = descriptor_hash([s.addr for s in sites if s.xol is not None])
    ss = [i for _, i in sorted(ss)]
    n = len(rows)
    if not rows and xol.EMPTY_DESCRIPTOR is not None:
        rows, n = [xol.EMPTY_DESCRIPTOR], 1
    section = ' __attribute__((section(".data..ro_after_init")))' if ro_after_init else ""
    out = [*xol.TABLE_INCLUDES,
           f"struct kp_breakpoint_site kp_breakpoints[{max(1, len(rows))}]{section} = {{", *rows, "};",
           f"const unsigned int kp_nbreakpoints = {n};",
           f"const unsigned int kp_breakpoint_hash_shift = {64 - bits}, kp_breakpoint_hash_mask = {(1 << bits) - 1};",
           f"const unsigned int kp_breakpoint_hash[{len(hashed)}] = {{ {', '.join(map(str, hashed))} }};",
           f"const unsigned int kp_breakpoint_ss[{max(1, len(ss))}] = {{ {', '.join(map(str, ss)) or '0'} }};",
           f"const unsigned int kp_nbreakpoint_ss = {len(ss)};"]
    if xol.SS_BREAKPOINT_SPAN:
        out.append(f"const unsigned long kp_breakpoint_ss_first = {min(ends, default=-1) & (2**64 - 1):#x}UL, "
                   f"kp_breakpoint_ss_last = {max(ends, default=0):#x}UL;")
    return "\n".join(out) + "\n"
