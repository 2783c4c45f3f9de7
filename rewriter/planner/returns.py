"""The return sites of every function with a placed kretprobe: a jump-optimized
return hook at each exit (or in the entry's region, for a short function), else
the kernel's return-address trampoline, or a breakpoint return hook where the
trampoline is unsafe; none at all for a light kretprobe (forms.light_kretprobes():
nothing to run at its returns)."""
from __future__ import annotations

import bisect

from ..probes.resolve import is_entry
from .exits import find_exits
from .forms import light_group, light_kretprobes
from .model import HOOK_KIND, HOOK_LIGHT, HOOK_PENDING, HOOK_POINTER, HOOK_RET, HOOK_SWAP, BREAKPOINT, OPTIMIZED, TRAMPOLINE, Group, Plan, RetSite, Site
from .sites import make_breakpoint

def plan_returns(image, analysis, arch, plan: Plan, rules) -> None:
    """Return sites of every function with a placed kretprobe."""
    rp = arch.retprobe
    groups: dict[int, Group] = {}
    for site in plan.sites:
        for p in site.probes:
            if is_entry(p):
                g = groups.setdefault(site.addr, Group(p.func, site.addr, site, []))
                g.probes.append(p)
                p.group = g
    plan.groups = sorted(groups.values(), key=lambda g: g.entry)
    if not groups:                  # no kretprobe placed: no exit to find, no hook to place
        return
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

    image_light = light_kretprobes([p for s in plan.sites for p in s.probes], rules)
    for g in plan.groups:
        ex = find_exits(image, analysis, arch, g.func)
        g.exits = ex.exits
        g.light = rules.kretprobe_exits and light_group(g, rules, image_light)
        if g.light:
            # Nothing runs at its returns (no handler, no instance): the exits are listed
            # for `check`, and left as they are -- no hook, no trampoline, no breakpoint.
            g.exits = [_as_return(e) if e.addr in rules.return_jumps else e for e in ex.exits]
            continue
        if not rules.kretprobe_exits:
            # The target's kretprobes are the kernel's: the return address is swapped at entry.
            g.mode, g.reason = TRAMPOLINE, arch.Refusal(
                "kretprobe_trampoline", g.entry, "the return address is swapped at entry (the kernel's "
                "kretprobe_trampoline)")
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
            if not isinstance(r, tuple) and _entry_covers(image, analysis, arch, g, e, rules, taken, starts,
                                                          site_at, site_starts, lambda lo, hi: busy(lo, hi, mine)):
                # A short function: the entry's region grows to take the exit (its hook in that detour).
                g.embedded.append((g.site, e))
                continue
            if not isinstance(r, tuple) and r.check == "jump_into_region" and e.kind == "ret" \
                    and rules.kretprobe_branch_exits and hasattr(rp, "branch_ret_detour"):
                got = _branch_exits(image, analysis, arch, g, ex.parts, part, e, rules,
                                    lambda lo, hi, more: busy(lo, hi, mine + more), host_of)
                if isinstance(got, tuple):
                    got, inside = got
                    for rs in got:
                        mine.append((rs.addr, rs.region_end))
                        g.sites.append(rs)
                    g.embedded_branches += inside
                    g.branch_exits[e.addr] = sorted([rs.branch for rs in got if rs.block is not None]
                                                    + [a for _, a, _, _ in inside])
                    continue
                r = type(r)(r.check, r.addr, f"{r.detail}; the jumps there not hooked: {got.check} at "
                                             f"{got.addr:#x}: {got.detail}")
            if not isinstance(r, tuple):
                if not rules.kretprobe_breakpoint_exits:
                    _exits_refused(g, r, e)
                    break
                # No jump fits: a breakpoint return hook at the exit (the return
                # address still stays where the caller put it), unless the
                # trampoline is safe for this function (below).
                g.breakpoint_exits.append((e, r))
                continue
            dcr, end = r
            mine.append((dcr[0].addr, end))
            g.sites.append(RetSite(e, dcr, dcr[0].addr, end, group=g))
        if g.breakpoint_exits and g.mode != TRAMPOLINE:
            # A trap costs microseconds, the kernel's trampoline nanoseconds: it
            # takes the whole function wherever it is safe (arch.retprobe.trampoline_refusal()).
            why = rp.trampoline_refusal(image, analysis, g.func, ex.parts, g.exits)
            if why is None:
                _exits_refused(g, g.breakpoint_exits[0][1], g.breakpoint_exits[0][0])
            else:
                g.breakpoint_exits = [(e, type(r)(r.check, r.addr, f"{r.detail}; no trampoline: {why}"))
                                for e, r in g.breakpoint_exits]
        if g.mode == TRAMPOLINE:
            continue
        for r in mine:
            i = bisect.bisect_left(starts, r[0])
            starts.insert(i, r[0])
            taken.insert(i, r)
    # Tail calls to a function whose returns are all hooked leave the slot alone.
    # A light function's returns are not (an instance left pending for them would never fire).
    hooked = {g.func.start for g in plan.groups if g.mode == OPTIMIZED and not g.light} | \
             {g.entry for g in plan.groups if g.mode == OPTIMIZED and not g.light}
    # A tail call through a pointer: the arch's hook reads the pointer and asks at run time
    # (the runtime's kp_kret_hooked[], from plan.hooked_entries).
    pointer = HOOK_POINTER if rules.kretprobe_pointer_tails and hasattr(rp, "pointer_tail_hook") else HOOK_SWAP
    if pointer == HOOK_POINTER:
        plan.hooked_entries = sorted(hooked)
    for g in plan.groups:
        if g.light:
            g.hooks = {e.addr: HOOK_LIGHT for e in g.exits}
            continue
        for e in g.exits:
            g.hooks[e.addr] = HOOK_RET if e.kind == "ret" else HOOK_PENDING if e.target in hooked else \
                pointer if e.target is None else HOOK_SWAP
            if g.hooks[e.addr] == HOOK_SWAP and pointer == HOOK_POINTER:
                # A tail call to a PLT stub: through the pointer in its GOT slot (our own
                # exported function, or another object's).
                slot = rp.plt_slot(image, analysis, e.target)
                if slot is not None:
                    g.hooks[e.addr], g.pointer_slots[e.addr] = HOOK_POINTER, slot
        if g.mode != OPTIMIZED:
            continue
        for s in g.sites:
            s.hook = g.hooks[s.exit.addr]
            plan.ret_sites.append(s)
        for host, e in g.embedded:
            if host.decision == BREAKPOINT:
                # A breakpoint kprobe at the exit: its site takes the hook (aggregation), as
                # _place_breakpoint_hooks() does; ret_hooks is read only by a detour's emitter.
                host.kret_hook = HOOK_KIND[g.hooks[e.addr]]
            else:
                host.ret_hooks[e.addr] = (g, g.hooks[e.addr])
        for host, a, block, e in g.embedded_branches:
            host.ret_hooks[a] = (g, g.hooks[e.addr])
            host.branch_blocks[a] = block
    plan.ret_sites.sort(key=lambda s: s.addr)
    _place_breakpoint_hooks(image, arch, plan)


def _branch_exits(image, analysis, arch, g: Group, parts, part, e, rules, busy, host_of) -> tuple | object:
    """Beyond the kernel: a `ret` whose region jumps land in (`je 1f; ...; 1: ret`
    with code right after it) takes that region anyway, and each such jump, a
    `jcc` or `jmp` of the function, becomes an exit of its own: a region ending
    with the jump, whose detour runs the jump's copy (a `jcc` inverted, back to the
    instruction after it) and then what the jump lands on (the `ret`, or the
    instructions up to it), its hook and the exit.  A jump inside the exit's own
    region goes to its copy in the detour.  Anything else that may land in the
    region (a call, a jump table, a landing pad, a jump of another function), or
    a jump's region refused, refuses the whole (the arch Refusal, its check named).
    A jump inside a jump-optimized probe's region (the entry's: `test %rdi,%rdi;
    je 1f` at the start) is hooked in that detour's copy instead.  Returns
    ([the exit's RetSite, a RetSite per jump], [(host Site, jump, block, exit)])
    or that Refusal."""
    rp = arch.retprobe
    sources = analysis.branch_sources
    why = []

    def jump_at(src):
        p = next((p for p in parts if p.start <= src < p.end), None)
        insn = rp.exit_insn(image, analysis, p, src) if p is not None else None
        return (p, insn) if insn is not None and insn.addr == src and rp.branch_exit(insn) else None

    def landed(x):
        srcs = sources.get(x, ())
        if x in analysis.entered or not srcs:
            why.append(arch.Refusal("branch_exit", x, f"{x:#x} may be entered other than by a jump "
                                                      f"({analysis.targets.get(x, 'unknown')})"))
            return False
        bad = next((s for s in srcs if jump_at(s) is None), None)
        if bad is not None:
            why.append(arch.Refusal("branch_exit", bad, f"the branch at {bad:#x} to {x:#x} is not a plain jmp or "
                                                        f"jcc of {g.func.name}"))
            return False
        return True
    r = rp.exit_region(image, analysis, part, e, lambda lo, hi: busy(lo, hi, []), landed=landed)
    if not isinstance(r, tuple):
        return why[-1] if why and r.check == "jump_into_region" and why[-1].addr in (r.addr, *sources.get(r.addr, ())) \
            else r
    dcr, end = r
    r = rules.exit_region_refusal(arch, analysis, g.func, dcr[0].addr, end, e.addr)
    if r is not None:
        return r
    start = dcr[0].addr
    out = [RetSite(e, dcr, start, end, group=g)]
    inside = []
    taken = [(start, end)]
    for k, x in enumerate(dcr[1:], 1):
        if not analysis.targets_in(x.addr, x.addr + 1):
            continue
        for src in sorted(sources.get(x.addr, ())):
            if start <= src < end:
                if src < x.addr:
                    continue            # its copy in the detour goes to x's copy
                return arch.Refusal("branch_exit", src, f"the jump at {src:#x} goes back to {x.addr:#x} inside "
                                                        "the return region")
            host = host_of(src)
            if host is not None:
                # In a probe's region: its detour's copy of the jump takes the hook.
                if host.decision != OPTIMIZED or host.head is not None or host.riders or host.with_post \
                        or not any(i.addr == src for i in host.dcr):
                    return arch.Refusal("probe_in_region", src, f"the jump at {src:#x} to {x.addr:#x} lies in "
                                                                f"the region of the probe at {host.addr:#x}")
                inside.append((host, src, dcr[k:], e))
                continue
            p, j = jump_at(src)
            jr = rp.exit_region(image, analysis, p, type(e)(src, "tail", j, x.addr),
                                lambda lo, hi: busy(lo, hi, taken))
            if isinstance(jr, tuple):
                bad = rules.exit_region_refusal(arch, analysis, g.func, jr[0][0].addr, jr[1], src)
                jr = bad if bad is not None else jr
            if not isinstance(jr, tuple):
                # A region that starts at the jump instead, as a probe's would (the detour
                # runs on after the jump's copy, then jumps back).
                fw = arch.optprobe.can_optimize(image, analysis, p, src)
                if isinstance(fw, list):
                    fend = fw[-1].addr + len(fw[-1].code)
                    if busy(src, fend, taken):
                        fw = arch.Refusal("probe_in_region", src, f"another probe overlaps the region "
                                                                  f"[{src:#x}, {fend:#x})")
                    else:
                        fw = rules.region_refusal(arch, analysis, p, src, fend) or (fw, fend)
                if isinstance(fw, tuple):
                    jr = fw
            if not isinstance(jr, tuple):
                return type(jr)(jr.check, jr.addr, f"the jump at {src:#x} to {x.addr:#x}: {jr.detail}")
            taken.append((jr[0][0].addr, jr[1]))
            out.append(RetSite(e, jr[0], jr[0][0].addr, jr[1], group=g, block=dcr[k:], branch=src))
    return out, inside


def _entry_covers(image, analysis, arch, g: Group, e, rules, taken, starts, site_at, site_starts, busy) -> bool:
    """An exit no region of its own can take, a few bytes after the function's
    jump-optimized entry (a 6-byte `lea 0x1(%rdi,%rdi,1),%rax; ret` with no
    padding after it): the entry's region grows to end with the exit, if the
    longer region passes can_optimize() and the target's checks, and nothing
    else lies in the bytes it adds.  The lists of taken regions follow."""
    s = g.site
    end = e.addr + len(e.insn.code)
    if (s.decision != OPTIMIZED or s.head is not None or s.riders or s.slot or s.evicted is not None
            or not s.region_end <= e.addr < g.func.end or end - s.addr > arch.optprobe.MAX_OPTIMIZED_LENGTH
            or any(s.region_end <= x.addr < end for x, _ in g.breakpoint_exits) or busy(s.region_end, end)):
        return False
    r = arch.optprobe.can_optimize(image, analysis, g.func, s.addr, min_end=end)
    if not isinstance(r, list) or r[-1].addr + len(r[-1].code) != end \
            or rules.region_refusal(arch, analysis, g.func, s.addr, end) is not None:
        return False
    s.dcr = r
    i = bisect.bisect_left(starts, s.addr)
    while taken[i][0] != s.addr:
        i += 1
    taken[i] = (s.addr, end)
    i = bisect.bisect_left(site_starts, s.addr)
    site_at[i] = (s.addr, end, s)
    return True


def _as_return(e):
    """An exit jump that is a return (Rules.return_jumps), as a ret."""
    return type(e)(e.addr, "ret", e.insn)


def _exits_refused(g: Group, why, e) -> None:
    """An exit no jump can hook where the target has no breakpoint return hooks
    (Rules.kretprobe_breakpoint_exits off): the function keeps the trampoline, and
    `check` names the check that refused the exit and where."""
    g.mode, g.embedded, g.sites, g.breakpoint_exits = TRAMPOLINE, [], [], []
    g.branch_exits, g.embedded_branches = {}, []
    g.reason = type(why)(why.check, why.addr, f"the exit at {e.addr:#x} cannot take a jump: {why.detail} "
                                              "(the return address is swapped at entry)")


def _place_breakpoint_hooks(image, arch, plan: Plan) -> None:
    """Breakpoint sites for the exits no jump could hook (arch_prepare_kprobe()
    on the ret or the tail jmp, emulated out of line), aggregated with a
    breakpoint kprobe already at that address."""
    at = {s.addr: s for s in plan.sites}
    for g in plan.groups:
        for e, why in g.breakpoint_exits:
            site = at.get(e.addr)
            if site is None:
                site = at[e.addr] = make_breakpoint(image, arch, Site(e.addr, [], reason=why))
            site.kret_hook = HOOK_KIND[g.hooks[e.addr]]
    plan.sites = sorted(at.values(), key=lambda s: s.addr)
