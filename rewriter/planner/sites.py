"""Each site's decision: jump-optimized (opt.c's can_optimize()), its region
shared with the probes on the next instructions, or the breakpoint fallback."""
from __future__ import annotations

from .. import safety
from ..probes.resolve import is_entry
from .model import FTRACE, BREAKPOINT, JUMPS, OPTIMIZED, REFUSED, Site

def make_breakpoint(image, arch, s: Site, ss_breakpoint: bool = False, boost_post_handler: bool = True) -> Site:
    """The breakpoint fallback (arch_prepare_kprobe()): a breakpoint probe whose
    instruction is emulated, boosted or single-stepped out of line (ss_breakpoint: the
    single-stepped copy ends with a breakpoint, Rules.singlestep_breakpoint; boost_post_handler
    False: a site with a post_handler is not boosted, Rules.boost_post_handler)."""
    s.xol = arch.kprobe_xol.prepare(image, s.addr, ss_breakpoint, boost=boost_post_handler or not s.with_post)
    s.dcr = [s.xol.insn]
    s.decision = BREAKPOINT
    return s


def optimize_site(image, analysis, arch, s: Site, optimize: bool, rules) -> None:
    """An ftrace site (KPROBE_FLAG_FTRACE: the jump takes the 5-byte site, the
    function's own code is not touched, whatever the optimization setting), else
    can_optimize() for the site: its DCR, or the refusal."""
    if s.addr in rules.ftrace:
        s.dcr, s.decision = [arch.ftrace_site_insn(s.addr)], FTRACE
        if rules.ftrace_ops_globs and all(p.from_glob and not is_entry(p) for p in s.probes):
            s.ftrace_ops = True     # through ftrace itself, as kprobe_ftrace_handler()
            return
        # A glob's probes take the site where they may: sharing costs each detour the copy of
        # the displaced instructions, and a probe on every function must fit the kernel's gaps.
        if rules.share_ftrace and (not rules.take_ftrace or not all(p.from_glob for p in s.probes)):
            share_ftrace_site(image, analysis, arch, s, rules)
        return
    if not optimize:
        s.reason = "kprobes_optimization: jump optimization is off (--no-optimize or optimize = false)"
        return
    r = arch.optprobe.can_optimize(image, analysis, s.probes[0].func, s.addr)
    if not isinstance(r, list):
        s.reason = r
        return
    with_post = s.with_post
    if with_post and arch.is_branch(r[0]):
        s.reason = arch.Refusal("post_handler", s.addr, "a post_handler cannot run after a branch in a detour")
        return
    if with_post and not rules.optimized_post_handler:
        s.reason = arch.Refusal("post_handler", s.addr, "the kernel optimizes no kprobe with a post_handler "
                                "(optimize_kprobe())")
        return
    why = rules.region_refusal(arch, analysis, s.probes[0].func, s.addr, r[-1].addr + len(r[-1].code))
    if why is not None:
        s.reason = why
        return
    s.dcr = r
    s.decision = OPTIMIZED


def share_ftrace_site(image, analysis, arch, s: Site, rules) -> None:
    """Beyond the kernel, which gives an ftrace site to one user at a time through ftrace
    itself (KPROBE_FLAG_FTRACE): the site stays the kernel's, in __mcount_loc, so ftrace's
    function tracer, its own kprobes on the function and BPF on them keep working, and the
    jump takes the instructions right after it (can_optimize() from there).  The probe is
    still the site's (its address, regs->ip, FTRACE), for the site is a nop when not traced
    and ftrace returns past it when traced.  Where the instructions after the site cannot
    be detoured, the jump takes the site itself (s.reason says why); so does a site whose
    probes all come from globs (optimize_site())."""
    after = s.addr + rules.share_ftrace
    r = arch.optprobe.can_optimize(image, analysis, s.probes[0].func, after)
    if isinstance(r, list) and s.with_post and arch.is_branch(r[0]):
        # As optimize_site(): the detour's post_handler call follows the copy, which a branch leaves.
        r = arch.Refusal("post_handler", after, "a post_handler cannot run after a branch in a detour")
    if isinstance(r, list):
        why = rules.region_refusal(arch, analysis, s.probes[0].func, after, r[-1].addr + len(r[-1].code))
        if why is None:
            s.dcr, s.jump_at = s.dcr + r, after
            return
        r = why
    unshare_ftrace_site(s, r, rules)


def unshare_ftrace_site(s: Site, why, rules) -> None:
    """Back to taking the site itself (share_ftrace_site()'s fallback), or, where the site
    may not be taken (Rules.take_ftrace), refused: `why` names the check."""
    s.jump_at, s.reason = 0, why
    if rules.take_ftrace:
        s.dcr = s.dcr[:1]
    else:
        s.dcr, s.decision = None, REFUSED


def share_regions(image, analysis, arch, sites: list[Site], rules) -> None:
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
            split_segments(arch, h)


def split_segments(arch, head: Site) -> None:
    """Each site's part of its head's region: from its address to the next
    rider's.  A rider that is no instruction boundary of the region, or whose
    post_handler would follow a branch, sends the whole region to a breakpoint."""
    starts = {i.addr for i in head.dcr}
    bad = next((r for r in head.riders if r.addr not in starts
                or (r.with_post and safety.enabled("shared_regions") and arch.is_branch(next(i for i in head.dcr if i.addr == r.addr)))), None)
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
