"""Stage 4: plan each probe, kprobes and kretprobes together.

Registration checks first (kernel/kprobes.c: instruction boundary, blacklist,
can_probe; register_kretprobe()'s own checks for rp->kp), then probes at one
address aggregate into a site, and each site is either jump-optimized (opt.c's
can_optimize) or a breakpoint probe, with the check that refused the jump and the
offending address.  Explicit probes that cannot be placed are errors
(register_kprobes() is all or nothing); probes from a glob are skipped.

Then the return sites of every function with a kretprobe: every exit (ret,
tail-call jmp, a jump the target calls a return: Rules.return_jumps) gets a
jump-optimized return hook (a short function's exit may ride in the entry's
region).  A function whose exits cannot all be named, or with an exit no jump
fits, falls back to the kernel's return-address trampoline; where the
trampoline is unsafe for it (arch.retprobe.trampoline_refusal()) and the target
has breakpoint return hooks (Rules.kretprobe_breakpoint_exits), such an exit gets a
breakpoint return hook instead (a breakpoint site at the exit, aggregated with the
sites above).  The plan ends with one numbering: site
indices, kp_probes[] and kp_kretprobes[] slots.

choose_forms() finishes the plan once the handlers' code is known: the detour
form of each site (clean call, pt_regs, inlined template) and of each return
hook.  Nothing after planning decides or renumbers anything.
"""
from __future__ import annotations

import bisect
from collections import defaultdict

from .. import safety
from ..probes.resolve import Probe, is_entry
from ..probes.spec import where
from .forms import choose_forms
from .model import (EvictedRegion, FTRACE, Group, HOOK_KIND, HOOK_PENDING, HOOK_POINTER, HOOK_RET, HOOK_SWAP, HandlerCode,
                    BREAKPOINT, JUMPS, NO_HANDLER, OPTIMIZED, Plan, REFUSED, RetSite, Retarget, Site, TRAMPOLINE)
from .register import kretprobe_refusal, register_refusal
from .retarget import retarget_branches
from .returns import plan_returns
from .short_jumps import short_jumps
from .sites import make_breakpoint, optimize_site, share_regions, unshare_ftrace_site

# What the later stages read: the plan's data (model.py) and the two entry points.
__all__ = ["EvictedRegion", "FTRACE", "Group", "HOOK_KIND", "HOOK_PENDING", "HOOK_RET",
           "HOOK_POINTER", "HOOK_SWAP", "HandlerCode", "BREAKPOINT", "JUMPS", "NO_HANDLER",
           "OPTIMIZED", "Plan", "REFUSED", "RetSite", "Retarget", "Site", "TRAMPOLINE",
           "choose_forms", "make_breakpoint", "plan"]


def plan(image, analysis, arch, probes: list[Probe], rules, optimize: bool, spec_name: str) -> Plan:
    out = Plan()
    kret_refused = Plan()
    by_addr: dict[int, list[Probe]] = defaultdict(list)

    def fail(p: Probe, decision: str, reason: str, check: str, addr: int | None = None, into: Plan = out):
        into.rejected.append((p, decision, reason, check, p.addr if addr is None else addr))
        if p.from_glob:
            into.skipped[check].append(p)
        else:
            # Named as `check` names it (report.check_line()): the check and its address, so
            # the two say the same of a probe.
            text = str(reason)
            if not text.startswith(check):
                text = f"{check} at {p.addr if addr is None else addr:#x}: {text}"
            into.errors.append(f"{where(spec_name, p.spec.table)} ({p.label}): {text}")

    for p in probes:
        if is_entry(p):
            why = kretprobe_refusal(image, analysis, arch, p, rules)
            if why is not None:
                fail(p, REFUSED, *why, into=kret_refused)
                continue
        why = register_refusal(image, analysis, arch, p, rules.blacklist)
        if why is None and rules.ftrace_ops_globs and p.from_glob and p.addr not in rules.ftrace:
            why = (f"{p.addr:#x} is not an ftrace site: a glob reaches the functions ftrace reaches "
                   "(available_filter_functions)", "ftrace_location")
        if why is not None:
            fail(p, REFUSED, *why)
            continue
        by_addr[p.addr].append(p)

    sites = [Site(a, ps) for a, ps in sorted(by_addr.items())]
    for s in sites:
        optimize_site(image, analysis, arch, s, optimize, rules)
    if rules.shared_regions and optimize:
        share_regions(image, analysis, arch, sites, rules)
    # Another probe inside the region keeps the site unoptimized (the kernel's
    # pre-optimization check); every site is placed (optimized or breakpoint), so all count.
    placed = sorted(s.addr for s in sites if s.head is None)
    for s in sites:
        if s.decision not in JUMPS or s.head is not None:
            continue
        i = bisect.bisect_right(placed, s.addr)
        inside = i < len(placed) and placed[i] < s.region_end
        if inside and s.jump_at:
            # The jump past a shared ftrace site would cover the other probe: the site is
            # taken instead (whatever the safety rules say: two jumps cannot share bytes),
            # or refused where it may not be (Rules.take_ftrace).
            unshare_ftrace_site(s, arch.Refusal("probe_in_region", placed[i], "another probe sits in "
                                                f"[{s.jump_at:#x}, {s.region_end:#x}), where the jump past the "
                                                "ftrace site would go"), rules)
            continue                # the site's own bytes hold no other probe's
        if inside and safety.enabled("probe_in_region"):
            s.reason = arch.Refusal("probe_in_region", placed[i], f"another probe sits inside the region [{s.addr:#x}, {s.region_end:#x})")
            s.decision, s.dcr = REFUSED, None
    if rules.short_jumps and optimize and arch.optprobe.SHORT_JUMP_SIZE:
        short_jumps(image, analysis, arch, sites, rules)
    for s in sites:
        if s.decision not in JUMPS:
            if not rules.breakpoints or (s.addr in rules.ftrace and not rules.take_ftrace):
                # No breakpoint probes in this target (yet), or on a site the kernel rewrites
                # at boot (Rules.take_ftrace): refused, with the check that refused the jump.
                for p in s.probes:
                    fail(p, REFUSED, str(s.reason), getattr(s.reason, "check", "kprobes_optimization"),
                         getattr(s.reason, "addr", s.addr))
                continue
            # A breakpoint on a site patched at boot (a kernel's paravirt call, lock prefix,
            # return thunk...) would be overwritten or trip the patcher's checks, and an
            # instruction with an exception fixup must not fault in an out-of-line copy.
            e = next(iter(rules.reserved_sites(s.addr, s.addr + 1)), None)
            if e is not None:
                why = arch.Refusal(e.reason, e.start, f"the {arch.breakpoint_name} at {s.addr:#x} would sit on " + (
                    "an instruction with an exception fixup (its out-of-line copy could fault)"
                    if e.reason == "__ex_table" else f"a site patched at boot ({e.symbol})"))
                for p in s.probes:
                    fail(p, REFUSED, str(why), why.check, why.addr)
                continue
            make_breakpoint(image, arch, s, rules.singlestep_breakpoint, rules.boost_post_handler)
            why = rules.breakpoint_refusal(arch, s) if rules.breakpoint_refusal is not None else None
            if why is not None:         # the target cannot write this breakpoint's copy
                for p in s.probes:
                    fail(p, REFUSED, str(why), why.check, why.addr)
                s.decision, s.xol, s.dcr = REFUSED, None, None
                continue
        out.sites.append(s)
    out.errors += kret_refused.errors
    out.rejected += kret_refused.rejected
    for check, ps in kret_refused.skipped.items():
        out.skipped[check].extend(ps)
    plan_returns(image, analysis, arch, out, rules)
    if rules.retarget_branches:
        retarget_branches(image, analysis, arch, out, rules)
    if rules.signal_syscalls and any(s.decision == BREAKPOINT for s in out.sites):
        out.signal_syscalls = signal_syscalls(image, analysis, arch, out)
    _number(out)
    return out


def signal_syscalls(image, analysis, arch, plan: Plan) -> list:
    """The image's system calls that set a signal mask or action (arch.signal_syscalls()),
    but those under a site's region, slot or evicted neighbour, or a return site: those
    bytes are the plan's already."""
    taken = sorted([(s.addr, max(s.region_end, s.addr + 1)) for s in plan.sites]
                   + [(s.slot, s.slot + arch.JUMP_SIZE) for s in plan.sites if s.slot]
                   + [(s.evicted.addr, s.evicted.region_end) for s in plan.sites if s.evicted]
                   + [(r.addr, r.region_end) for g in plan.groups for r in g.sites]
                   + [(r.src, r.src + r.size) for r in plan.retargets])
    starts = [a for a, _ in taken]
    out = []
    for sc in arch.signal_syscalls(image, analysis):
        i = bisect.bisect_left(starts, sc.end)
        if any(lo < sc.end and sc.addr < hi for lo, hi in taken[max(0, i - 64):i]):
            continue
        out.append(sc)
    return out


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
