"""Stage 5: lay out the new code.  Every address the generated C tables and the
final code need is decided here, before linking: the target's start-up stubs,
each optimized site's detour buffer (the kernel's optinsn slot), each return
site's detour, each breakpoint site's out-of-line slot (its insn slot), and
where the linked runtime and handlers start.  Sizes come from emitting each
piece once with placeholder runtime addresses (emission.Far): no piece's size
depends on where the runtime lands.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from . import emission
from .arch.base import EMULATE
from .errors import KprewriteError
from .planner import INT3


@contextmanager
def relocating(c: emission.Code, what: str, addr: int):
    """The arch cannot move an instruction near `addr` to where its copy goes (a rel32
    branch or rip-relative target out of reach of the new code: only damaged code has
    one): one line naming the file and the site, as __copy_instruction()'s failure
    makes register_kprobe() refuse the probe."""
    try:
        yield
    except c.arch.emit.EmitError as e:
        raise KprewriteError(f"{c.image.path}: {what} at {addr:#x}: an instruction cannot be relocated "
                             f"to the new code ({e})") from None


@dataclass
class Layout:
    rx_vaddr: int                 # where the new code segment starts (the target's choice)
    stubs: dict[str, int]         # start-up stub name -> address (the target's)
    text_addr: int                # the linked runtime and handlers
    target: object = None         # the target's own layout (file offsets, headers)
    data_addr: int | None = None  # the runtime's data, when the target puts it apart from the code
    sizes: dict = field(default_factory=dict)   # ("site"|"ret"|"xol", key) -> bytes laid out


def place(c: emission.Code, target) -> Layout:
    """Addresses for everything the plan adds; fills the plan's address fields
    (Site.detour/resume/resume_post, RetSite.detour, the xol slots)."""
    tl = target.plan_layout(c.image)
    stubs, pos = target.reserve_stubs(c.image, tl.after_phdrs)
    sizes = {}
    for site in c.plan.sites:
        if site.decision == INT3:
            continue
        # A light hit's hot part (emit.light_detour: up to the jump back, some 55 bytes)
        # starts a cache line, which then holds all of it: one line fetched a hit.
        pos = (pos + 63) & ~63 if site.light else (pos + 15) & ~15
        with relocating(c, "probe", site.addr):
            code, site.resume, site.resume_post = emission.site_detour(c, site, pos, emission.Far(pos))
        site.detour = pos
        sizes[("site", site.index)] = len(code)
        pos += len(code)
    for site in c.plan.sites:       # evicted neighbours (planner.short_jumps.evict_neighbour()): a copy, no probe
        ev = site.evicted
        if ev is None:
            continue
        pos = (pos + 15) & ~15
        ev.detour = pos
        with relocating(c, "evicted region", ev.addr):
            sizes[("evicted", ev.addr)] = n = len(emission.evicted_detour(c, ev, pos))
        pos += n
    for site in c.plan.sites:       # a shared region's segments jump one to the next
        for s, nxt in zip([site] + site.riders, site.riders):
            s.back = nxt.detour
    for rs in c.plan.ret_sites:
        pos = (pos + 15) & ~15
        rs.detour = pos
        with relocating(c, "return site", rs.addr):
            sizes[("ret", rs.addr)] = n = len(emission.ret_detour(c, rs, pos, emission.Far(pos)))
        pos += n
    c.arch.kprobe_xol.number_descriptors(c.plan.sites)
    for site in c.plan.sites:
        if site.decision == INT3 and site.xol.mode != EMULATE:
            with relocating(c, "probe", site.addr):
                n = c.arch.kprobe_xol.place_slot(site.xol, site.index, site.with_post, pos)
            site.resume, site.resume_post = site.xol.slot, site.xol.slot_post
            site.detour = pos
            sizes[("xol", site.index)] = n
            pos += n
    return Layout(tl.rx_vaddr, stubs, (pos + 63) & ~63, tl, tl.data_vaddr, sizes)
