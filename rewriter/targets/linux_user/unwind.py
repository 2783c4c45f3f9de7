"""Unwind tables for a rewritten user ELF: the output's PT_GNU_EH_FRAME points
at a new .eh_frame_hdr whose table covers the image's own FDEs (left where they
are), the linked runtime's and handlers' (compiled with unwind tables, .eh_frame
kept by link/ld.py) and one FDE per detour, return-site detour and out-of-line slot
(the arch's unwind module), all in a read-only segment after the runtime's data.
An unwinder finds FDEs only through that table (libgcc's _Unwind_Find_FDE, via
dl_iterate_phdr) or __register_frame, which the freestanding runtime cannot call;
so glibc's backtrace() in a handler goes on through the detour into the probed
function and its callers, as a kernel handler's stack does."""
from __future__ import annotations

from array import array

from ... import cache
from ...analysis import workers
from ...arch.base import unwind_info
from ...elf.ehframe import write as ehw
from ...planner import BREAKPOINT

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


def programs(plan, layout, arch, rx: bytes | None = None) -> list[tuple[int, int, bytes]]:
    """(start, size, call frame program) of each piece of new code a handler can
    be called from: detours, return-site detours, out-of-line slots.  rx None:
    those whose code the layout kept (layout.Layout.code: the detours as sized,
    with placeholder runtime addresses), computed while the compiler and linker
    run (Programs, started by pipeline.build), as a program follows only the
    pieces' instructions, their branches inside the piece and the hits, which
    the placeholders leave as they will be; rx (the new code, from
    layout.rx_vaddr): the others (the out-of-line slots), or all when the layout
    kept none."""
    return Programs(plan, layout, arch, rx).result()


class Programs:
    """programs() started: with enough pieces, in worker processes (workers.Workers)
    that run beside the compiler and linker, until result() is read.  The programs
    are a function of the pieces' bytes, addresses and hits alone, so they are
    cached (kind detour-cfi) by those and kprewrite's code: a second rewrite of an
    image with the same spec does not decode its detours again."""

    def __init__(self, plan, layout, arch, rx: bytes | None = None, path: str = "the image"):
        self.u = unwind_info(arch)
        self.todo = todo = _pieces(plan, layout, rx)
        self.progs = self.key = self.job = None
        if len(todo) >= CACHED_PIECES:
            self.key = cache.key(b"detour-cfi", cache.code_version(), arch.name.encode(),
                                 repr([(at, size, hit) for at, size, hit, _ in todo]).encode(),
                                 b"".join(t[3] for t in todo))
            self.progs = _unpack(cache.get("detour-cfi", self.key), len(todo))
        if self.progs is None and len(todo) >= PARALLEL_PIECES and workers.jobs() > 1:
            step = -(-len(todo) // SLICES)
            self.job = workers.Workers(_programs_of, [(lo, min(lo + step, len(todo))) for lo in range(0, len(todo), step)],
                                       (self.u, todo), path, "its detours' unwind programs")

    def result(self) -> list[tuple[int, int, bytes]]:
        if self.progs is None:
            if self.job is not None:
                try:
                    self.progs = [prog for got in self.job.results() for prog in got]
                finally:
                    self.close()
            else:
                self.progs = [self.u.fde_program(code, at, hit) for at, _, hit, code in self.todo]
            if self.key is not None:
                cache.put("detour-cfi", self.key, _pack(self.progs))
        return [(at, size, prog) for (at, size, _, _), prog in zip(self.todo, self.progs)]

    def close(self) -> None:
        """The workers ended (result() read, or the rewrite failed first)."""
        if self.job is not None:
            self.job.close()
            self.job = None


def _programs_of(lo: int, hi: int) -> list[bytes]:
    """A worker's slice of Programs' pieces."""
    u, todo = workers.shared()
    return [u.fde_program(code, at, hit) for at, _, hit, code in todo[lo:hi]]


def _pieces(plan, layout, rx: bytes | None) -> list[tuple[int, int, int, bytes]]:
    """(start, size, hit, code) of programs()' pieces."""
    todo = []

    def add(key, at, hit):
        code = layout.code.get(key)
        if not layout.sizes[key]:
            return
        if rx is None:
            if code is None:        # an out-of-line slot: from the final code
                return
        elif code is not None:      # done early
            return
        else:
            off = at - layout.rx_vaddr
            code = bytes(rx[off:off + layout.sizes[key]])
        todo.append((at, len(code), hit, code))

    sites, ret_sites, code = plan.sites, plan.ret_sites, layout.code
    if rx is not None and code:         # the layout's own pieces were done early: only the others
        sites = [site for site in sites if ("site", site.index) not in code]
        ret_sites = [rs for rs in ret_sites if ("ret", rs.addr) not in code]
    for site in sites:
        key = ("xol", site.index) if site.decision == BREAKPOINT else ("site", site.index)
        if key in layout.sizes and layout.detour(site):
            add(key, layout.detour(site), site.addr)
    for rs in ret_sites:
        add(("ret", rs.addr), layout.detour(rs), rs.addr)
    return todo


# Below this many pieces, computing the programs costs less than keying them.
CACHED_PIECES = 500
# From this many, worker processes compute them (starting them costs some 10 ms), in
# this many slices, so that the workers end together.
PARALLEL_PIECES = 1000
SLICES = 16


def _pack(programs: list[bytes]) -> bytes:
    return array("I", [len(programs), *map(len, programs)]).tobytes() + b"".join(programs)


def _unpack(data: bytes | None, count: int) -> list[bytes] | None:
    """The programs _pack() stored, or None (nothing stored, or not `count` of them)."""
    if data is None or len(data) < 4:
        return None
    n = array("I", data[:4])[0]
    if n != count or len(data) < 4 * (n + 1):
        return None
    sizes = array("I", data[4:4 * (n + 1)])
    out, p = [], 4 * (n + 1)
    for size in sizes:
        out.append(data[p:p + size])
        p += size
    return out if p == len(data) else None


def build(image, arch, layout, rx: bytes, blob, plan, addr: int, early=None) -> tuple[bytes, int, int]:
    """The unwind tables at `addr`: (bytes, the hdr's address, its size).  early:
    programs(plan, layout, arch), if computed already."""
    eh_old, table = old_table(image, arch)
    table = list(table)
    for name, typ, flags, a, size in blob.sections:     # the runtime's and handlers' FDEs
        if name == ".eh_frame":
            off = a - blob.text_addr
            table += ehw.read_fde_starts(blob.text[off:off + size], a)
    if early is None:
        early = programs(plan, layout, arch)
    eh, index = ehw.eh_frame(addr, sorted(early + programs(plan, layout, arch, rx)), unwind_info(arch))
    table += index
    hdr_addr = addr + ((len(eh) + 7) & ~7)
    hdr = ehw.eh_frame_hdr(hdr_addr, eh_old, table)
    return eh + b"\0" * (hdr_addr - addr - len(eh)) + hdr, hdr_addr, len(hdr)
