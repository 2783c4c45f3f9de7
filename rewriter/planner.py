"""Stage 4: plan each probe, kprobes and kretprobes together.

Registration checks first (kernel/kprobes.c: instruction boundary, blacklist,
can_probe; register_kretprobe()'s own checks for rp->kp), then probes at one
address aggregate into a site, and each site is either jump-optimized (opt.c's
can_optimize) or an INT3 probe, with the check that refused the jump and the
offending address.  Explicit probes that cannot be placed are errors
(register_kprobes() is all or nothing); probes from a glob are skipped.

Then the return sites of every function with a kretprobe: every exit (ret,
tail-call jmp, a jump the target calls a return: Rules.return_jumps) gets a
jump-optimized return hook, or where no jump fits a breakpoint return hook (an
INT3 site at the exit, aggregated with the sites above).  Only a function whose
exits cannot all be named, or (a target without breakpoint return hooks,
Rules.kretprobe_int3_exits) one with an exit no jump fits, falls back to the
kernel's return-address trampoline.  The plan ends with one numbering: site
indices, kp_probes[] and kp_kretprobes[] slots.

choose_forms() finishes the plan once the handlers' code is known: the detour
form of each site (clean call, pt_regs, inlined template) and of each return
hook.  Nothing after planning decides or renumbers anything.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

from . import blacklist as bl
from .events import trace_key
from .resolve import EntryProbe, Probe, is_entry
from .rules import Rules

OPTIMIZED, FTRACE, INT3, REFUSED = "optimized", "ftrace", "int3", "refused"
JUMPS = (OPTIMIZED, FTRACE)         # decisions that write a jump to a detour
TRAMPOLINE = "trampoline"           # a kretprobe whose returns only the trampoline catches
# How an exit reaches the kretprobe return path (the runtime's KP_KRET_HOOK_*):
# a ret; a tail call to a function whose own returns are hooked (the instance
# stays pending for them); a tail call to anything else (the return address is
# swapped for the trampoline, as the kernel's kretprobes always do).
HOOK_RET, HOOK_PENDING, HOOK_SWAP = "ret", "pending", "swap"
HOOK_KIND = {HOOK_RET: 1, HOOK_PENDING: 2, HOOK_SWAP: 3}

# kretprobe_blacklist (the kernel's holds __switch_to, which does not return to
# its caller): functions whose return does not match their call.
NEVER_RETURNS = "never returns to its caller"
RETURNS_TWICE = "returns twice (a return handler would fire for a call that never entered)"
SWITCHES = "does not return to its caller (it switches the stack)"
KRETPROBE_BLACKLIST = {
    "__switch_to": SWITCHES,
    "_start": "the program's entry point has no caller to return to",
    "__libc_start_main": NEVER_RETURNS, "__libc_start_call_main": NEVER_RETURNS,
    "exit": NEVER_RETURNS, "_exit": NEVER_RETURNS, "_Exit": NEVER_RETURNS, "abort": NEVER_RETURNS,
    "pthread_exit": NEVER_RETURNS, "__stack_chk_fail": NEVER_RETURNS, "__assert_fail": NEVER_RETURNS,
    "__cxa_throw": NEVER_RETURNS, "_Unwind_Resume": NEVER_RETURNS,
    "setjmp": RETURNS_TWICE, "_setjmp": RETURNS_TWICE, "__sigsetjmp": RETURNS_TWICE, "sigsetjmp": RETURNS_TWICE,
    "vfork": RETURNS_TWICE, "fork": RETURNS_TWICE, "getcontext": RETURNS_TWICE,
    "longjmp": SWITCHES, "_longjmp": SWITCHES, "siglongjmp": SWITCHES, "__longjmp_chk": SWITCHES,
    "setcontext": SWITCHES, "swapcontext": SWITCHES,
}


@dataclass
class Site:
    """One probed address: the kernel's aggregator kprobe, and its optimized_kprobe."""
    addr: int
    probes: list[Probe]
    decision: str = REFUSED
    reason: object = None            # arch Refusal, or str
    dcr: list | None = None          # the detoured code region, if optimized
    index: int = -1
    xol: object = None               # INT3 fallback: the arch's out-of-line plan
    kret_hook: int = 0               # a breakpoint return hook at this exit (HOOK_KIND)
    ret_hooks: dict = field(default_factory=dict)   # exits inside this DCR -> (Group, hook kind)
    # Forms (choose_forms):
    clean: bool = False              # clean call: no handler here reads pt_regs
    template: bool = False           # one probe, no post_handler: dispatch inlined in the detour
    clobbers: set | None = None      # call-clobbered registers the handlers write (None: unknown)
    aligned: bool = False            # template: the ABI has the stack 16-byte aligned at the site
    flags_live: bool = True          # clean template: the arithmetic flags are live at the site
    light: bool = False              # template of a probe in an image with no handler: count only
    red_zone: bool = False           # light: the 128 bytes below %rsp are free here (a function entry)
    # A region shared by several probes (_share_regions): the head takes the jump and
    # holds the whole region in dcr; each site copies only seg, its own part of it.
    head: "Site | None" = None
    riders: list = field(default_factory=list)
    seg: list | None = None
    # A region under 5 bytes (_short_jumps()): a short jump at addr to the jump
    # to the detour, in the dead padding at `slot`.
    slot: int = 0
    # Direct branches among the copied instructions whose target is a detoured
    # region's start: address -> the Site or RetSite whose detour they enter instead.
    branch_to: dict = field(default_factory=dict)
    # No dead padding in reach (_evict_neighbour()): the slot is the second 5 bytes
    # of a neighbouring region moved to a detour of its own.
    evicted: "EvictedRegion | None" = None
    # Addresses (layout):
    detour: int = 0
    back: int = 0                    # where the copy of seg jumps: the next rider's detour (0: region end)
    resume: int = 0
    resume_post: int = 0

    @property
    def with_post(self) -> bool:
        return any(p.spec.post_handler for p in self.probes)

    @property
    def post_ip(self) -> int:
        return self.dcr[0].addr + len(self.dcr[0].code) if self.dcr else self.addr

    @property
    def segment(self) -> list:
        """The instructions this site's detour copies."""
        return self.seg if self.seg is not None else self.dcr

    @property
    def segment_end(self) -> int:
        seg = self.segment
        return seg[-1].addr + len(seg[-1].code) if seg else self.addr + 1

    @property
    def region_end(self) -> int:
        return self.dcr[-1].addr + len(self.dcr[-1].code) if self.dcr else self.addr + 1


@dataclass
class EvictedRegion:
    """Beyond the kernel (E9Patch's neighbour eviction, T3): an optimized region
    carrying no kprobe.  Its first 5 bytes jump to a detour that runs its
    relocated copy and jumps back to its end (no handler, no hit count); its
    next 5 bytes, dead now (the only way into the region is its start), hold
    the jump of the short-jump probe that needed them (`for_site`)."""
    addr: int
    dcr: list
    for_site: "Site"
    detour: int = 0                  # layout

    @property
    def region_end(self) -> int:
        return self.dcr[-1].addr + len(self.dcr[-1].code)


@dataclass
class RetSite:
    """A return site with its own detour: a 5-byte jmp at `addr`."""
    exit: object                 # arch Exit
    dcr: list
    addr: int
    region_end: int
    hook: str = HOOK_RET         # HOOK_RET / HOOK_PENDING / HOOK_SWAP
    group: object = None
    detour: int = 0              # layout


@dataclass
class Group:
    """The kretprobes of one function, and how its returns are caught."""
    func: object
    entry: int
    site: Site                       # the entry's site
    probes: list[EntryProbe]
    mode: str = OPTIMIZED
    reason: object = None
    exits: list = field(default_factory=list)
    sites: list[RetSite] = field(default_factory=list)
    embedded: list = field(default_factory=list)     # (kprobe Site, Exit): exits inside a kprobe's DCR
    int3_exits: list = field(default_factory=list)   # (Exit, why no jump): breakpoint return hooks
    hooks: dict = field(default_factory=dict)        # exit addr -> HOOK_*
    ret_template: dict | None = None  # the inlined return hook's parameters (choose_forms)

    @property
    def ret_clean(self) -> bool:
        """No handler of its kretprobes reads regs at return."""
        return all(p.ret_clean for p in self.probes)


@dataclass
class Retarget:
    """A direct branch (call, jmp, jcc rel32) to the start of a detoured region,
    sent straight to its detour (Rules.retarget_branches): the jump at the region
    would take it there anyway, one taken jump later."""
    src: int
    size: int                        # the branch instruction's length
    target: int                      # the region it named
    to: "Site | RetSite"             # whose detour it enters


@dataclass
class Plan:
    sites: list[Site] = field(default_factory=list)          # placed, in address order
    errors: list[str] = field(default_factory=list)
    skipped: dict[str, list[Probe]] = field(default_factory=lambda: defaultdict(list))
    # (probe, decision, reason, check name, address of the instruction that made it fail)
    rejected: list[tuple[Probe, str, str, str, int]] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)        # functions with kretprobes, by entry
    ret_sites: list[RetSite] = field(default_factory=list)   # by address
    kprobes: list[tuple[Site, Probe]] = field(default_factory=list)          # kp_probes[], by slot
    kretprobes: list[tuple[Site, EntryProbe, Group]] = field(default_factory=list)   # kp_kretprobes[]
    retargets: list[Retarget] = field(default_factory=list)   # by source address

    def hit_slot(self, p: Probe) -> int:
        """A probe's hit counter: kp_probes[] first, then each kretprobe's rp->kp."""
        return len(self.kprobes) + p.slot if is_entry(p) else p.slot


def make_int3(image, arch, s: Site, ss_int3: bool = False) -> Site:
    """The INT3 fallback (arch_prepare_kprobe()): a breakpoint probe whose
    instruction is emulated, boosted or single-stepped out of line (ss_int3: the
    single-stepped copy ends with an int3, Rules.singlestep_int3)."""
    s.xol = arch.kprobe_xol.prepare(image, s.addr, ss_int3)
    s.dcr = [s.xol.insn]
    s.decision = INT3
    return s


def plan(image, analysis, arch, probes: list[Probe], rules, optimize: bool, spec_name: str) -> Plan:
    out = Plan()
    kret_refused = Plan()
    by_addr: dict[int, list[Probe]] = defaultdict(list)

    def fail(p: Probe, decision: str, reason: str, check: str, addr: int | None = None, into: Plan = out):
        into.rejected.append((p, decision, reason, check, p.addr if addr is None else addr))
        if p.from_glob:
            into.skipped[check].append(p)
        else:
            into.errors.append(f"{spec_name}: {p.spec.table} ({p.label}): {reason}")

    for p in probes:
        if is_entry(p):
            why = _kretprobe_refusal(image, analysis, arch, p, rules)
            if why is not None:
                fail(p, REFUSED, *why, into=kret_refused)
                continue
        why = _register_refusal(image, analysis, arch, p, rules.blacklist)
        if why is not None:
            fail(p, REFUSED, *why)
            continue
        by_addr[p.addr].append(p)

    sites = [Site(a, ps) for a, ps in sorted(by_addr.items())]
    for s in sites:
        _optimize(image, analysis, arch, s, optimize, rules)
    if rules.shared_regions and optimize:
        _share_regions(image, analysis, arch, sites, rules)
    # Another probe inside the region keeps the site unoptimized (the kernel's
    # pre-optimization check); every site is placed (optimized or int3), so all count.
    placed = sorted(s.addr for s in sites if s.head is None)
    for s in sites:
        if s.decision not in JUMPS or s.head is not None:
            continue
        i = bisect.bisect_right(placed, s.addr)
        if i < len(placed) and placed[i] < s.region_end:
            s.reason = arch.Refusal("probe_in_region", placed[i], f"another probe sits inside the region [{s.addr:#x}, {s.region_end:#x})")
            s.decision, s.dcr = REFUSED, None
    if rules.short_jumps and optimize:
        _short_jumps(image, analysis, arch, sites, rules)
    for s in sites:
        if s.decision not in JUMPS:
            if not rules.int3:      # no breakpoint probes in this target (yet): refused
                for p in s.probes:
                    fail(p, REFUSED, str(s.reason), getattr(s.reason, "check", "kprobes_optimization"),
                         getattr(s.reason, "addr", s.addr))
                continue
            # A breakpoint on a site patched at boot (a kernel's paravirt call, lock prefix,
            # return thunk...) would be overwritten or trip the patcher's checks, and an
            # instruction with an exception fixup must not fault in an out-of-line copy.
            e = rules.reserved.overlapping(s.addr, s.addr + 1)
            if e is not None:
                why = arch.Refusal(e.reason, e.start, f"the int3 at {s.addr:#x} would sit on " + (
                    "an instruction with an exception fixup (its out-of-line copy could fault)"
                    if e.reason == "__ex_table" else f"a site patched at boot ({e.symbol})"))
                for p in s.probes:
                    fail(p, REFUSED, str(why), why.check, why.addr)
                continue
            make_int3(image, arch, s, rules.singlestep_int3)
        out.sites.append(s)
    out.errors += kret_refused.errors
    out.rejected += kret_refused.rejected
    for check, ps in kret_refused.skipped.items():
        out.skipped[check].extend(ps)
    _plan_returns(image, analysis, arch, out, rules)
    if rules.retarget_branches:
        _retarget_branches(image, analysis, arch, out, rules)
    _number(out)
    return out


def _patched_ranges(arch, plan: Plan) -> bl.Index:
    """Every byte range the plan writes in the image's code: regions,
    breakpoints, short jumps' slots, evicted neighbours (the slot in them),
    return sites."""
    ranges = ([(s.addr, s.addr + 1) if s.decision == INT3 else (s.addr, s.region_end)
               for s in plan.sites if s.head is None]
              + [(s.slot, s.slot + arch.JUMP_SIZE) for s in plan.sites if s.slot and s.evicted is None]
              + [(s.evicted.addr, s.evicted.region_end) for s in plan.sites if s.evicted is not None]
              + [(rs.addr, rs.region_end) for rs in plan.ret_sites])
    return bl.Index([bl.BlacklistEntry(lo, hi, "", "patched") for lo, hi in ranges])


def _retarget_branches(image, analysis, arch, plan: Plan, rules) -> None:
    """Beyond the kernel: a direct branch to the start of a detoured region (a
    call of a probed function, a jump to a probed return) names the detour
    itself, saving the taken jump at the region on every hit through it.  The
    branch's bytes stay the same length and its return address the same, so the
    callee cannot tell.  Only branches the decoding can vouch for are rewritten:
    in a function decoded to its end, in code an FDE describes (no data mistaken
    for code), and clear of every byte the plan patches or the target reserves
    (a copied branch in a detour keeps naming the region)."""
    entries: dict[int, object] = {}
    for s in plan.sites:
        if s.decision == OPTIMIZED and s.head is None:
            entries[s.addr] = s
    for rs in plan.ret_sites:
        entries.setdefault(rs.addr, rs)
    if not entries:
        return
    patched = _patched_ranges(arch, plan)
    fdes = bl.Index([bl.BlacklistEntry(f.start, f.end, "", "FDE") for f in image.fdes])

    def vouched(src, size):
        f = image.function_at(src)
        return (f is not None and analysis.decoded(f).undecodable is None and analysis.is_boundary(f, src)
                and any(e.start <= src and src + size <= e.end for e in fdes.all_overlapping(src, src + size)))

    # The copies in the detours too (not an exit whose copy a return hook makes).
    for s in plan.sites:
        if s.decision not in JUMPS:
            continue
        for insn in s.segment:
            if insn.info.emulate in ("call rel", "jmp rel", "jcc rel") and insn.addr not in s.ret_hooks \
                    and insn.info.rel_target in entries:
                s.branch_to[insn.addr] = entries[insn.info.rel_target]
    em = arch.emit
    for target, to in sorted(entries.items()):
        for src in sorted(set(analysis.branch_sources.get(target, ()))):
            code = image.read(src, 6)
            off = em.branch_rel32(code)
            if off is None:
                continue
            size = off + 4
            if patched.overlapping(src, src + size) is not None \
                    or rules.reserved.overlapping(src, src + size) is not None or not vouched(src, size):
                continue
            plan.retargets.append(Retarget(src, size, target, to))
    plan.retargets.sort(key=lambda r: r.src)


def _register_refusal(image, analysis, arch, p: Probe, blacklist) -> tuple | None:
    """register_kprobe()'s checks: (reason, check name[, address]), or None."""
    if p.func is None:
        return f"no function symbol or FDE covers {p.addr:#x}, so the instruction boundary cannot be checked", "no_function"
    if p.spec.symbol_name and not p.from_glob and not (p.func.start <= p.addr < p.func.end and p.addr - p.offset >= p.func.start):
        return f"offset {p.offset:#x} is beyond the end of {p.symbol}", "offset"
    if not analysis.is_boundary(p.func, p.addr):
        return f"{p.addr:#x} is not an instruction boundary of {p.func.name} (decoded from {p.func.start:#x})", "insn_boundary"
    e = bl.lookup(blacklist, p.addr)
    if e is not None:
        return f"{p.addr:#x} is blacklisted: {e.reason} ({e.symbol})", "blacklist"
    r = arch.optprobe.can_probe_insn(image, p.addr)
    if r is not None and not arch.kprobe_xol.emulates_refused(image, p.addr):
        return str(r), r.check, r.addr
    return None


def _kretprobe_refusal(image, analysis, arch, p: EntryProbe, rules) -> tuple[str, str] | None:
    """register_kretprobe()'s own checks: a function entry (kprobe_on_func_entry),
    not on the kretprobe blacklist, a function that returns."""
    if not rules.kretprobes:
        return f"kretprobes are not supported in {image.label} yet", "kretprobe"
    f = p.func
    if f is None:
        return f"a kretprobe must be on a function entry (kprobe_on_func_entry): no function covers {p.addr:#x}", "func_entry"
    if p.addr != arch.optprobe.adjust_kprobe_addr(image, f.start, 0):
        return f"a kretprobe must be on a function entry (kprobe_on_func_entry): {p.label} is not", "func_entry"
    bad = next((n for n in [f.name] + list(f.aliases) if n in KRETPROBE_BLACKLIST), None)
    if bad:
        return f"{bad} is on the kretprobe blacklist: {KRETPROBE_BLACKLIST[bad]}", "kretprobe_blacklist"
    if ".cold" in f.name:
        return (f"{f.name} is a cold part of a function, entered by a jump, not a call: "
                "it has no return address"), "cold_part"
    d = analysis.decoded(f)
    if d.undecodable is None and d.indirect_jump is None:
        ex = arch.retprobe.find_exits(image, analysis, f)
        if not ex.exits and ex.refusal is None:
            return f"{f.name} has no ret and no tail call: it never returns", "never_returns"
    return None


def _optimize(image, analysis, arch, s: Site, optimize: bool, rules) -> None:
    """An ftrace site (KPROBE_FLAG_FTRACE: the jump takes the 5-byte site, the
    function's own code is not touched, whatever the optimization setting), else
    can_optimize() for the site: its DCR, or the refusal."""
    if s.addr in rules.ftrace:
        s.dcr, s.decision = [arch.ftrace_site_insn(s.addr)], FTRACE
        return
    if not optimize:
        s.reason = "kprobes_optimization: jump optimization is off (--no-optimize or optimize = false)"
        return
    r = arch.optprobe.can_optimize(image, analysis, s.probes[0].func, s.addr)
    if not isinstance(r, list):
        s.reason = r
        return
    if s.with_post and arch.is_branch(r[0]):
        s.reason = arch.Refusal("post_handler", s.addr, "a post_handler cannot run after a branch in a detour")
        return
    why = rules.region_refusal(arch, analysis, s.probes[0].func, s.addr, r[-1].addr + len(r[-1].code))
    if why is not None:
        s.reason = why
        return
    s.dcr = r
    s.decision = OPTIMIZED


def _share_regions(image, analysis, arch, sites: list[Site], rules) -> None:
    """Beyond the kernel, which refuses a second probe inside a region: one
    detour serves every probe of its region.  A site inside a jump-optimized
    site's region rides on it (its head); a site that cannot take a jump of its
    own (too close to a jump target or to the function's end...) extends the
    region of the head before it, when the longer region passes the same checks.
    The detour then runs, for each probe in address order, its handlers and its
    own instructions' copy (Site.seg), each segment jumping to the next."""
    head = None
    for s in sites:
        func = s.probes[0].func
        if head is not None and func is not head.probes[0].func:
            head = None             # a region stays inside its function
        if head is not None and s.addr >= head.region_end:
            if s.decision in JUMPS or s.addr in rules.ftrace:
                head = None
            else:
                r = arch.optprobe.can_optimize(image, analysis, func, head.addr, min_end=s.addr + 1)
                if isinstance(r, list) and rules.region_refusal(arch, analysis, func, head.addr,
                                                                r[-1].addr + len(r[-1].code)) is None:
                    head.dcr = r
                else:
                    head = None
        if head is not None and s.addr < head.region_end:
            head.riders.append(s)
            s.head = head
            continue
        head = s if s.decision == OPTIMIZED else None
    for h in sites:
        if h.riders:
            _split_segments(arch, h)


_SHORT_REASONS = ("jump_into_region", "func_size", "probe_in_region", "indirect_jump")


def _short_jumps(image, analysis, arch, sites: list[Site], rules) -> None:
    """Beyond the kernel: a site whose 5-byte region is refused for want of
    room (a jump target, the function's end or another probe less than 5 bytes
    on) takes a 2-byte region instead, when its instructions pass the same
    checks: a short jump to a 5-byte jump in dead padding within reach
    (the arch's short_jump_slot(), E9Patch's tactic).  Regions and slots stay
    disjoint from every other site's bytes."""
    taken = sorted((s.addr, s.region_end if s.decision in JUMPS else s.addr + 1)
                   for s in sites if s.head is None)
    starts = [a for a, _ in taken]

    def busy(lo, hi):
        i = bisect.bisect_left(starts, hi)
        return bool(i) and taken[i - 1][1] > lo

    def take(lo, hi):
        i = bisect.bisect_left(starts, lo)
        if i < len(starts) and starts[i] == lo:
            del starts[i], taken[i]
        starts.insert(i, lo)
        taken.insert(i, (lo, hi))

    for s in sites:
        if s.decision in JUMPS or s.head is not None or getattr(s.reason, "check", None) not in _SHORT_REASONS:
            continue
        func = s.probes[0].func
        r = arch.optprobe.can_optimize(image, analysis, func, s.addr, jump_size=arch.optprobe.JMP8_INSN_SIZE)
        if not isinstance(r, list) or (s.with_post and arch.is_branch(r[0])):
            continue
        end = r[-1].addr + len(r[-1].code)
        if busy(s.addr + 1, end) or rules.region_refusal(arch, analysis, func, s.addr, end) is not None:
            continue
        mine = lambda lo, hi: busy(lo, hi) or (lo < end and s.addr < hi)   # noqa: E731
        slot = arch.optprobe.short_jump_slot(image, analysis, s.addr, mine)
        if slot is not None and rules.region_refusal(arch, analysis, func, slot, slot + arch.JUMP_SIZE) is not None:
            slot = None
        evicted = None
        if slot is None and rules.evict_neighbours:
            evicted = _evict_neighbour(image, analysis, arch, s, mine, rules)
            if evicted is None:
                continue
            slot = evicted.addr + arch.JUMP_SIZE
        if slot is None:
            continue
        if s.reason.check == "indirect_jump" and func.start < slot + arch.JUMP_SIZE and slot < func.end:
            # The 2-byte jump leaves a one-instruction region, which no jump lands inside;
            # but padding inside func could follow a label its unbounded jump targets.
            continue
        s.dcr, s.decision, s.reason, s.slot, s.evicted = r, OPTIMIZED, None, slot, evicted
        take(s.addr, end)
        if evicted is not None:
            take(evicted.addr, evicted.region_end)
        else:
            take(slot, slot + arch.JUMP_SIZE)


def _evict_neighbour(image, analysis, arch, s: Site, busy, rules) -> "EvictedRegion | None":
    """Beyond the kernel, E9Patch's neighbour eviction (T3) where no dead padding
    is in a short jump's reach: a neighbouring region N of at least two jumps'
    bytes, within reach, that passes every check a probe's region at its start
    passes (can_optimize(): relocatable instructions, a call only last, no known
    jump target inside; inside one function; region_refusal(); clear of every
    other site's and slot's bytes and of the blacklist), and holds no exit of its
    function (a kretprobe's return hooks are planned later, and its copy would
    run without one).  N's start jumps to a detour running N's copy; nothing
    else enters N, so its next 5 bytes are dead and take the probe's jump.
    Candidates nearest the probe first, then by address: deterministic."""
    opt = arch.optprobe
    for func, n0 in opt.evict_candidates(image, analysis, s.addr):
        if busy(n0, n0 + 2 * arch.JUMP_SIZE):
            continue
        r = opt.can_evict(image, analysis, func, n0)
        if not isinstance(r, list):
            continue
        end = r[-1].addr + len(r[-1].code)
        if busy(n0, end) or rules.blacklist.overlapping(n0, end) is not None:
            continue
        if rules.region_refusal(arch, analysis, func, n0, end) is not None:
            continue
        if _in_loop(analysis, func, n0, end):
            continue
        return EvictedRegion(n0, r, s)
    return None


def _in_loop(analysis, func, lo: int, hi: int) -> bool:
    """[lo, hi) lies on a loop of func (a backward direct branch spans it): an
    evicted neighbour there would take its two jumps on every iteration, with no
    probe to show for them (measured: busybox `sort` 1.15x -> 1.23x when a
    string function's loop body was evicted)."""
    return any(t <= src and t < hi and src >= lo and func.start <= t
               for t, src in analysis.decoded(func).branches)


def _split_segments(arch, head: Site) -> None:
    """Each site's part of its head's region: from its address to the next
    rider's.  A rider that is no instruction boundary of the region, or whose
    post_handler would follow a branch, sends the whole region to INT3."""
    starts = {i.addr for i in head.dcr}
    bad = next((r for r in head.riders if r.addr not in starts
                or (r.with_post and arch.is_branch(next(i for i in head.dcr if i.addr == r.addr)))), None)
    if bad is not None:
        why = arch.Refusal("probe_in_region", bad.addr, f"the probe at {bad.addr:#x} cannot share the region "
                                                        f"[{head.addr:#x}, {head.region_end:#x})")
        for s in [head] + head.riders:
            s.decision, s.dcr, s.reason, s.head = REFUSED, None, why, None
        head.riders = []
        return
    chain = [head] + head.riders
    for s, nxt in zip(chain, chain[1:] + [None]):
        end = nxt.addr if nxt else head.region_end
        s.seg = [i for i in head.dcr if s.addr <= i.addr < end]
    for r in head.riders:
        r.dcr, r.decision, r.reason = r.seg, OPTIMIZED, None


def _plan_returns(image, analysis, arch, plan: Plan, rules) -> None:
    """Return sites of every function with a placed kretprobe."""
    rp = arch.retprobe
    groups: dict[int, Group] = {}
    for site in plan.sites:
        for p in site.probes:
            if is_entry(p):
                g = groups.setdefault(site.addr, Group(p.func, site.addr, site, []))
                g.probes.append(p)
                p.group = g
    # Regions taken by probes, disjoint, sorted by start: overlap checks by bisection.
    # A shared region counts as its segments (they tile it).
    taken = sorted([(s.addr, s.segment_end) for s in plan.sites]
                   + [(s.slot, s.slot + arch.JUMP_SIZE) for s in plan.sites if s.slot and not s.evicted]
                   + [(s.evicted.addr, s.evicted.region_end) for s in plan.sites if s.evicted])
    starts = [a for a, _ in taken]
    site_at = sorted((s.addr, s.segment_end, s) for s in plan.sites if s.dcr)
    site_starts = [a for a, _, _ in site_at]

    def busy(lo, hi, extra):
        i = bisect.bisect_left(starts, hi)
        if i and taken[i - 1][1] > lo:
            return True
        return any(a < hi and lo < b for a, b in extra)

    def host_of(addr):
        i = bisect.bisect_right(site_starts, addr)
        if i and site_at[i - 1][1] > addr:
            return site_at[i - 1][2]
        return None

    plan.groups = sorted(groups.values(), key=lambda g: g.entry)
    for g in plan.groups:
        ex = rp.find_exits(image, analysis, g.func)
        g.exits = ex.exits
        if not rules.kretprobe_exits:
            # The target's kretprobes are the kernel's: the return address is swapped at entry.
            g.mode, g.reason = TRAMPOLINE, arch.Refusal(
                "kretprobe_trampoline", g.entry, "the return address is swapped at entry (the kernel's "
                "kretprobe_trampoline; instances per task)")
            continue
        if ex.refusal is not None:
            # An exit we cannot even name (a conditional tail call, a jump into
            # another function's middle): only the trampoline catches it.
            g.mode, g.reason = TRAMPOLINE, ex.refusal
            continue
        # A jump the target calls a return (a kernel's `jmp __x86_return_thunk`) is a ret.
        g.exits = [_as_return(e) if e.addr in rules.return_jumps else e for e in ex.exits]
        mine: list[tuple[int, int]] = []
        for e in g.exits:
            host = host_of(e.addr)
            if host is not None:
                if e.addr in rules.return_jumps:   # the copy in a kprobe's detour is not ours to name
                    _exits_refused(g, arch.Refusal("probe_in_region", host.addr, f"the return jump at {e.addr:#x} "
                                                   f"lies in the region of the probe at {host.addr:#x}"), e)
                    break
                g.embedded.append((host, e))
                continue
            part = next(pt for pt in ex.parts if pt.start <= e.addr < pt.end)
            r = rp.exit_region(image, analysis, part, e, lambda lo, hi: busy(lo, hi, mine))
            if isinstance(r, tuple):
                why = rules.exit_region_refusal(arch, analysis, g.func, r[0][0].addr, r[1], e.addr)
                if why is not None:
                    r = why
            if not isinstance(r, tuple):
                if not rules.kretprobe_int3_exits:
                    _exits_refused(g, r, e)
                    break
                # No jump fits: a breakpoint return hook at the exit (the return
                # address still stays where the caller put it).
                g.int3_exits.append((e, r))
                continue
            dcr, end = r
            mine.append((dcr[0].addr, end))
            g.sites.append(RetSite(e, dcr, dcr[0].addr, end, group=g))
        if g.mode == TRAMPOLINE:
            continue
        for r in mine:
            i = bisect.bisect_left(starts, r[0])
            starts.insert(i, r[0])
            taken.insert(i, r)
    # Tail calls to a function whose returns are all hooked leave the slot alone.
    hooked = {g.func.start for g in plan.groups if g.mode == OPTIMIZED} | \
             {g.entry for g in plan.groups if g.mode == OPTIMIZED}
    for g in plan.groups:
        for e in g.exits:
            g.hooks[e.addr] = HOOK_RET if e.kind == "ret" else HOOK_PENDING if e.target in hooked else HOOK_SWAP
        if g.mode != OPTIMIZED:
            continue
        for s in g.sites:
            s.hook = g.hooks[s.exit.addr]
            plan.ret_sites.append(s)
        for host, e in g.embedded:
            host.ret_hooks[e.addr] = (g, g.hooks[e.addr])
    plan.ret_sites.sort(key=lambda s: s.addr)
    _place_int3_hooks(image, arch, plan)


def _as_return(e):
    """An exit jump that is a return (Rules.return_jumps), as a ret."""
    return type(e)(e.addr, "ret", e.insn)


def _exits_refused(g: Group, why, e) -> None:
    """An exit no jump can hook where the target has no breakpoint return hooks
    (Rules.kretprobe_int3_exits off): the function keeps the trampoline, and
    `check` names the check that refused the exit and where."""
    g.mode, g.embedded, g.sites, g.int3_exits = TRAMPOLINE, [], [], []
    g.reason = type(why)(why.check, why.addr, f"the exit at {e.addr:#x} cannot take a jump: {why.detail} "
                                              "(the return address is swapped at entry)")


def _place_int3_hooks(image, arch, plan: Plan) -> None:
    """Breakpoint sites for the exits no jump could hook (arch_prepare_kprobe()
    on the ret or the tail jmp, emulated out of line), aggregated with a
    breakpoint kprobe already at that address."""
    at = {s.addr: s for s in plan.sites}
    for g in plan.groups:
        for e, why in g.int3_exits:
            site = at.get(e.addr)
            if site is None:
                site = at[e.addr] = make_int3(image, arch, Site(e.addr, [], reason=why))
            site.kret_hook = HOOK_KIND[g.hooks[e.addr]]
    plan.sites = sorted(at.values(), key=lambda s: s.addr)


def _number(plan: Plan) -> None:
    """The one numbering: sites by address, kp_probes[] and kp_kretprobes[] in spec order."""
    for i, s in enumerate(plan.sites):
        s.index = i
    plan.kprobes = sorted(((s, p) for s in plan.sites for p in s.probes if not is_entry(p)), key=lambda sp: sp[1].index)
    for i, (_, p) in enumerate(plan.kprobes):
        p.slot = i
    plan.kretprobes = sorted(((g.site, p, g) for g in plan.groups for p in g.probes), key=lambda t: t[1].index)
    for j, (_, p, _) in enumerate(plan.kretprobes):
        p.slot = j


# --- forms, once the handlers' code is known ------------------------------------

@dataclass
class HandlerCode:
    """What the arch's handler_abi read in a handler's compiled code."""
    reads_regs: bool                 # may read its pt_regs argument (unknown code may)
    clobbers: set[str] | None        # call-clobbered registers it writes (None: unknown)
    symbol: str | None = None        # its link symbol


NO_HANDLER = HandlerCode(False, set())


def choose_forms(plan: Plan, image, arch, code: dict[str, HandlerCode], traced: set, rules: Rules,
                 events: bool = False) -> None:
    """How each site and each function's returns are emitted.

    Sites: a clean call where no handler can read its pt_regs argument; the
    inlined template (dispatch in the detour) where the site has one probe and
    no post_handler.  A kretprobe's entry (pre_handler_kretprobe() reads
    regs->sp) is clean only as the template, which passes the slot itself, when
    its entry_handler is clean; or, where the target's runtime has a clean kretprobe entry
    (Rules.kretprobe_clean_entry: it passes the slot), through that when no entry_handler reads regs.

    Returns: a function with one kretprobe gets the hook inlined at each ret,
    clean when its handler never reads regs, with pt_regs otherwise; several
    kretprobes share the runtime's hooks, the clean one when no handler reads
    regs.  traced: keys of probes with a trace event (events.trace_key) whose
    generated handlers read regs (TraceEvent.reads_regs); events: whether any probe has one.

    light (Rules.light_hits): in an image with no handler at all (events count as handlers), a
    template only counts the hit (Site.light, emit.light_detour); red_zone
    (Rules.red_zone): its registers are then saved below %rsp without moving it
    where the ABI leaves that room free (a function entry)."""
    for site in plan.sites:
        # Without fast forms, detours call the runtime's shared entries: optimized_callback()
        # with pt_regs, or the clean callback where no handler reads pt_regs.
        _site_form(site, image, arch, code, traced, trace_key, rules.fast_forms, rules.kretprobe_clean_entry)
    # No handler anywhere in the image: no hit can find one running (nmissed stays 0)
    # and nothing can enable or disable a probe, so a template only counts the hit
    # (emit.light_detour).  One handler, even elsewhere, may call a probed function.
    quiet = rules.light_hits and not events and not plan.kretprobes and not any(p.spec.pre_handler or p.spec.post_handler
                                                                     for _, p in plan.kprobes)
    for site in plan.sites:
        site.light = quiet and site.template and not site.probes[0].spec.disabled
        site.red_zone = site.light and rules.red_zone and arch.optprobe.red_zone_free_at(image, site.probes[0].func,
                                                                                     site.addr)
    for g in plan.groups:
        for p in g.probes:
            p.ret_clean = trace_key(p) not in traced and not (p.kret.handler and code[p.kret.handler].reads_regs)
        if len(g.probes) != 1 or g.mode != OPTIMIZED or not rules.fast_forms:
            continue
        p = g.probes[0]
        if trace_key(p) in traced:           # the generated trace handler (it calls the user's)
            sym, clobbers = f"kp_trace_ret_{trace_key(p)}", None
        elif p.kret.handler:
            sym, clobbers = code[p.kret.handler].symbol, code[p.kret.handler].clobbers
        else:
            sym, clobbers = None, set()
        g.ret_template = {"slot": p.slot, "handler": sym, "clobbers": clobbers,
                          "aligned": arch.optprobe.stack_aligned_at(image, g.func, g.func.start)}


def _site_form(site: Site, image, arch, code: dict[str, HandlerCode], traced: set, trace_key,
               templates: bool = True, kret_clean_entry: bool = False) -> None:
    site.clean = True
    site.clobbers = set()
    for p in site.probes:
        if (is_entry(p) and not kret_clean_entry) or trace_key(p) in traced:
            site.clean = False      # pre_handler_kretprobe / the trace's pre_handler read pt_regs
        if is_entry(p) and kret_clean_entry:
            eh = p.kret.entry_handler
            site.clean = site.clean and not (eh and code[eh].reads_regs)
            site.clobbers = None
        for name in (p.spec.pre_handler, p.spec.post_handler):
            if not name:
                continue
            h = code[name]
            site.clean = site.clean and not h.reads_regs
            site.clobbers = None if h.clobbers is None or site.clobbers is None else site.clobbers | h.clobbers
    site.template = templates and site.decision in JUMPS and len(site.probes) == 1 and not site.with_post
    if site.template and is_entry(site.probes[0]):
        eh = site.probes[0].kret.entry_handler
        h = code[eh] if eh else NO_HANDLER
        site.clean = not h.reads_regs
        # The inlined entry (retprobe.kret_entry_body) uses these, and the entry_handler its own.
        site.clobbers = None if h.clobbers is None else h.clobbers | set(arch.retprobe.KRET_ENTRY_USES)
    if site.template:
        p = site.probes[0]
        site.aligned = arch.optprobe.stack_aligned_at(image, p.func, site.addr)
        if site.clean:
            site.flags_live = not arch.optprobe.arith_flags_dead(image, p.func, site.addr)
