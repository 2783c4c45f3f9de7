"""Stage 4: plan each probe.

Registration checks first (kernel/kprobes.c: instruction boundary, blacklist,
can_probe), then probes at one address aggregate into a site, and each site is
either jump-optimized (opt.c's can_optimize) or not, with the check that refused
it and the offending address.  Explicit probes that cannot be placed are
errors (register_kprobes() is all or nothing); probes from a glob are skipped.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from . import blacklist as bl
from .resolve import Probe

OPTIMIZED, INT3, REFUSED = "optimized", "int3", "refused"


@dataclass
class Site:
    """One probed address: the kernel's aggregator kprobe, and its optimized_kprobe."""
    addr: int
    probes: list[Probe]
    decision: str = REFUSED
    reason: object = None            # arch Refusal, or str
    dcr: list | None = None          # the detoured code region, if optimized
    index: int = -1
    detour: int = 0
    resume: int = 0
    resume_post: int = 0
    detour_code: bytes = b""
    clean: bool = False              # clean call: no handler here reads pt_regs
    template: bool = False           # clean, one probe, no post_handler: dispatch inlined in the detour
    clobbers: set | None = None      # call-clobbered registers the handlers write (None: unknown)
    xol: object = None               # INT3 fallback: the arch's out-of-line plan (kprobe_xol.Xol)
    kret_hook: int = 0               # a kretprobe return hook at this exit (kretprobe.HOOK_KIND), as a breakpoint

    @property
    def with_post(self) -> bool:
        return any(p.spec.post_handler for p in self.probes)

    @property
    def post_ip(self) -> int:
        return self.dcr[0].addr + len(self.dcr[0].code) if self.dcr else self.addr

    @property
    def region_end(self) -> int:
        return self.dcr[-1].addr + len(self.dcr[-1].code) if self.dcr else self.addr + 1


@dataclass
class Plan:
    sites: list[Site] = field(default_factory=list)          # placed, in address order
    errors: list[str] = field(default_factory=list)
    skipped: dict[str, list[Probe]] = field(default_factory=lambda: defaultdict(list))
    rejected: list[tuple[Probe, str, str]] = field(default_factory=list)   # (probe, decision, reason)


def make_int3(image, arch, s: Site) -> Site:
    """The INT3 fallback (arch_prepare_kprobe()): a breakpoint probe whose
    instruction is emulated, boosted or single-stepped out of line."""
    s.xol = arch.kprobe_xol.prepare(image, s.addr)
    s.dcr = [s.xol.insn]
    s.decision = INT3
    return s


def _where(p: Probe) -> str:
    return f"{p.spec.table} ({p.label})"


def plan(image, analysis, arch, probes: list[Probe], blacklist, optimize: bool, spec_name: str) -> Plan:
    out = Plan()
    by_addr: dict[int, list[Probe]] = defaultdict(list)

    def fail(p: Probe, decision: str, reason: str, check: str, error: str | None = None):
        out.rejected.append((p, decision, reason))
        if p.from_glob:
            out.skipped[check].append(p)
        else:
            out.errors.append(f"{spec_name}: {_where(p)}: {error or reason}")

    for p in probes:
        if p.func is None:
            fail(p, REFUSED, f"no function symbol or FDE covers {p.addr:#x}, so the instruction boundary cannot be checked", "no_function")
            continue
        if p.spec.symbol_name and not p.from_glob and not (p.func.start <= p.addr < p.func.end and p.addr - p.offset >= p.func.start):
            fail(p, REFUSED, f"offset {p.offset:#x} is beyond the end of {p.symbol}", "offset")
            continue
        if not analysis.is_boundary(p.func, p.addr):
            fail(p, REFUSED, f"{p.addr:#x} is not an instruction boundary of {p.func.name} (decoded from {p.func.start:#x})", "insn_boundary")
            continue
        e = bl.lookup(blacklist, p.addr)
        if e is not None:
            fail(p, REFUSED, f"{p.addr:#x} is blacklisted: {e.reason} ({e.symbol})", "blacklist")
            continue
        r = arch.optprobe.can_probe_insn(image, p.addr)
        if r is not None and not arch.kprobe_xol.emulates_refused(image, p.addr):
            fail(p, REFUSED, str(r), r.check)
            continue
        by_addr[p.addr].append(p)

    sites = [Site(a, ps) for a, ps in sorted(by_addr.items())]
    for s in sites:
        if not optimize:
            s.reason = "kprobes_optimization: jump optimization is off (--no-optimize or optimize = false)"
            continue
        r = arch.optprobe.can_optimize(image, analysis, s.probes[0].func, s.addr)
        if not isinstance(r, list):
            s.reason = r
            continue
        if s.with_post and r[0].info.emulate in ("jmp rel", "jcc rel", "call rel"):
            s.reason = arch.optprobe.Refusal("post_handler", s.addr, "a post_handler cannot run after a branch in a detour")
            continue
        s.dcr = r
        s.decision = OPTIMIZED
    # Another probe inside the region keeps the site unoptimized (the kernel's
    # pre-optimization check); every site is placed (optimized or int3), so all count.
    placed = sorted(s.addr for s in sites)
    import bisect
    for s in sites:
        if s.decision != OPTIMIZED:
            continue
        i = bisect.bisect_right(placed, s.addr)
        if i < len(placed) and placed[i] < s.region_end:
            s.reason = arch.optprobe.Refusal("probe_in_region", placed[i], f"another probe sits inside the region [{s.addr:#x}, {s.region_end:#x})")
            s.decision, s.dcr = REFUSED, None
    for s in sites:
        if s.decision != OPTIMIZED:
            make_int3(image, arch, s)
        out.sites.append(s)
    for i, s in enumerate(out.sites):
        s.index = i
    return out
