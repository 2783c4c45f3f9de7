"""Stage 5: lay out the new code.  Every address the generated C tables and the
final code need is decided here, before linking: the target's start-up stubs,
each optimized site's detour buffer (the kernel's optinsn slot), each return
site's detour, each breakpoint site's out-of-line slot (its insn slot), and
where the linked runtime and handlers start.  Sizes come from emitting each
piece once with placeholder runtime addresses (emission.Far): no piece's size
depends on where the runtime lands, and the code differs from the final one only
in the fields that reach the runtime, which the arch logs and emission patches
(Layout.links).  The result is a Layout of its own, plain data beside the plan:
the plan is never written here, and emission, the tables, the report and the
targets read (plan, layout).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from . import breakpoints, emission
from ..arch.base import EMULATE, XolSlot
from ..errors import KprewriteError
from ..planner import BREAKPOINT, EvictedRegion, RetSite, Site


class relocating:
    """The arch cannot move an instruction near `addr` to where its copy goes (its
    branch or PC-relative target out of reach of the new code, e.g. x86-64's rel32:
    only damaged code has one): one line naming the file and the site, as
    __copy_instruction()'s failure makes register_kprobe() refuse the probe.
    (A class, not a generator's context manager: one is entered per site.)"""
    __slots__ = ("c", "what", "addr")

    def __init__(self, c: emission.Code, what: str, addr: int):
        self.c, self.what, self.addr = c, what, addr

    def __enter__(self):
        return None

    def __exit__(self, typ, e, tb):
        if typ is not None and issubclass(typ, self.c.arch.emit.EmitError):
            raise KprewriteError(f"{self.c.image.path}: {self.what} at {self.addr:#x}: an instruction cannot be "
                                 f"relocated to the new code ({e})") from None
        return False


@dataclass(frozen=True)
class SiteAddrs:
    """Where the layout put one site's code: its detour buffer (the kernel's optinsn
    slot) or, for a breakpoint site, its out-of-line slot (the insn slot)."""
    detour: int = 0         # 0: none (an emulated breakpoint site)
    resume: int = 0         # where the copy of the probed instruction starts (the runtime resumes there)
    resume_post: int = 0    # where a post_handler's site resumes after it
    back: int = 0           # where the copy of a shared region's segment jumps: the next rider's detour (0: region end)


NOWHERE = SiteAddrs()


@dataclass(frozen=True)
class Layout:
    """Every address the layout assigns, keyed by the plan's own names for what it
    places (Site.index, RetSite.addr, EvictedRegion.addr): its result beside the
    plan, which it leaves as it found it (E9Patch's split: the plan says what, the
    layout and emission say how, and each reads (plan, layout))."""
    rx_vaddr: int                 # where the new code segment starts (the target's choice)
    stubs: dict[str, int]         # start-up stub name -> address (the target's)
    text_addr: int                # the linked runtime and handlers
    target: object = None         # the target's own layout (file offsets, headers)
    data_addr: int | None = None  # the runtime's data, when the target puts it apart from the code
    sizes: Mapping = field(default_factory=dict)     # ("site"|"evicted"|"ret"|"xol", key) -> bytes laid out
    sites: Mapping[int, SiteAddrs] = field(default_factory=dict)   # by Site.index
    evicted: Mapping[int, int] = field(default_factory=dict)       # EvictedRegion.addr -> its detour
    returns: Mapping[int, int] = field(default_factory=dict)       # RetSite.addr -> its detour
    xol: Mapping[int, XolSlot] = field(default_factory=dict)       # Site.index -> its out-of-line slot
    # The code each detour was sized with ("site"|"ret", key as in sizes): placeholder runtime
    # addresses, but its final size, instructions and internal branches; what needs no more
    # than those (a user target's unwind rows) is computed from it while the linker runs.
    code: Mapping = field(default_factory=dict)
    # Of the code above, that which is final but for its references to the runtime:
    # ("site"|"ret", key) -> (address, symbol, ...): where each field reaching a symbol lies,
    # which emission patches (an arch that logs them: Emit.relink).  A site whose copy
    # names a detour not laid out yet, or a rider's next detour, is built again instead.
    links: Mapping = field(default_factory=dict)

    def site(self, site: Site) -> SiteAddrs:
        return self.sites.get(site.index, NOWHERE)

    def detour(self, x: Site | RetSite | EvictedRegion) -> int:
        """The detour of a site, a return site or an evicted region (0: not laid out yet)."""
        if isinstance(x, Site):
            return self.site(x).detour
        return (self.returns if isinstance(x, RetSite) else self.evicted).get(x.addr, 0)


def place(c: emission.Code, target) -> Layout:
    """Addresses for everything the plan adds, in a Layout; the plan is left untouched.
    Each piece is sized by emitting it against the layout so far (a branch copied into a
    detour names a detour laid out already, or its region: the encoding is as long)."""
    tl = target.plan_layout(c.image)
    stubs, pos = target.reserve_stubs(c.image, tl.after_phdrs)
    for i, sc in enumerate(c.plan.signal_syscalls):     # Rules.signal_syscalls: each one's stub
        pos = (pos + 15) & ~15
        stubs[f"sigcall{i}"] = pos
        pos += len(c.arch.emit.signal_syscall_stub(pos, sc, pos))
    sizes, sites, evicted, returns, xol, codes, links = {}, {}, {}, {}, {}, {}, {}
    logs = c.arch.emit.relink is not None
    # What is laid out so far: the same mappings, filled in as pieces are placed.
    so_far = Layout(tl.rx_vaddr, stubs, 0, tl, tl.data_vaddr, sizes, sites, evicted, returns, xol)
    for site in c.plan.sites:
        if site.decision == BREAKPOINT:
            continue
        # A light hit's hot part (emit.light_detour: up to the jump back, some 55 bytes)
        # starts a cache line, which then holds all of it: one line fetched a hit.
        pos = (pos + 63) & ~63 if site.light else (pos + 15) & ~15
        # Final but for its links unless a branch it copies names a detour to come (its own too).
        final = logs and (not site.branch_to or all(so_far.detour(to) for to in site.branch_to.values()))
        far = emission.Far(pos)
        with relocating(c, "probe", site.addr):
            code, resume, resume_post = emission.site_detour(c, so_far, site, pos, far)
        sites[site.index] = SiteAddrs(pos, resume, resume_post)
        key = ("site", site.index)      # one key object for the three (12,000 sites: the collector counts them)
        sizes[key], codes[key] = len(code), code
        if final:
            links[key] = tuple(far.links)
        pos += len(code)
    for site in c.plan.sites:       # evicted neighbours (planner.short_jumps.evict_neighbour()): a copy, no probe
        ev = site.evicted
        if ev is None:
            continue
        pos = (pos + 15) & ~15
        evicted[ev.addr] = pos
        with relocating(c, "evicted region", ev.addr):
            sizes[("evicted", ev.addr)] = n = len(emission.evicted_detour(c, ev, pos))
        pos += n
    for site in c.plan.sites:       # a shared region's segments jump one to the next
        for s, nxt in zip([site] + site.riders, site.riders):
            sites[s.index] = replace(so_far.site(s), back=so_far.site(nxt).detour)
            links.pop(("site", s.index), None)      # its copy jumps there, not as laid out
    for rs in c.plan.ret_sites:
        pos = (pos + 15) & ~15
        returns[rs.addr] = pos
        far = emission.Far(pos)
        key = ("ret", rs.addr)
        with relocating(c, "return site", rs.addr):
            code = codes[key] = emission.ret_detour(c, rs, pos, far)
            sizes[key] = n = len(code)
        if logs:
            links[key] = tuple(far.links)
        pos += n
    desc = breakpoints.number_descriptors(c.plan.sites)
    for site in c.plan.sites:
        if site.decision == BREAKPOINT and site.xol.mode != EMULATE:
            with relocating(c, "probe", site.addr):
                slot = c.arch.kprobe_xol.place_slot(site.xol, site.index, site.with_post, pos, desc.get(site.index, 0))
            xol[site.index] = slot
            sites[site.index] = SiteAddrs(pos, slot.addr, slot.post)
            sizes[("xol", site.index)] = slot.size
            pos += slot.size
    frozen = lambda d: MappingProxyType(dict(d))  # noqa: E731
    return Layout(tl.rx_vaddr, stubs, (pos + 63) & ~63, tl, tl.data_vaddr, frozen(sizes), frozen(sites),
                  frozen(evicted), frozen(returns), frozen(xol), frozen(codes), frozen(links))
