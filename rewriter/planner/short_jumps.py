"""Beyond the kernel, E9Patch's tactics for a site with no room for a jump: a
short jump to a jump in dead padding nearby (T1), or to one in an evicted
neighbour (T3)."""
from __future__ import annotations

import bisect

from .model import JUMPS, OPTIMIZED, EvictedRegion, Site

_SHORT_REASONS = ("jump_into_region", "func_size", "probe_in_region", "indirect_jump")


def short_jumps(image, analysis, arch, sites: list[Site], rules) -> None:
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
        r = arch.optprobe.can_optimize(image, analysis, func, s.addr, jump_size=arch.optprobe.SHORT_JUMP_SIZE)
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
            evicted = evict_neighbour(image, analysis, arch, s, mine, rules)
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


def evict_neighbour(image, analysis, arch, s: Site, busy, rules) -> "EvictedRegion | None":
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
        if in_loop(analysis, func, n0, end):
            continue
        return EvictedRegion(n0, r, s)
    return None


def in_loop(analysis, func, lo: int, hi: int) -> bool:
    """[lo, hi) lies on a loop of func (a backward direct branch spans it): an
    evicted neighbour there would take its two jumps on every iteration, with no
    probe to show for them (measured: busybox `sort` 1.15x -> 1.23x when a
    string function's loop body was evicted)."""
    return any(t <= src and t < hi and src >= lo and func.start <= t
               for t, src in analysis.decoded(func).branches)
