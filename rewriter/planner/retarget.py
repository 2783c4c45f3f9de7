"""Beyond the kernel: direct branches to a detoured region's start name the
detour itself (Rules.retarget_branches)."""
from __future__ import annotations

import bisect

from .. import safety
from .model import BREAKPOINT, JUMPS, OPTIMIZED, Plan, Retarget

def patched_ranges(arch, plan: Plan) -> list[tuple[int, int]]:
    """Every byte range the plan writes in the image's code: regions,
    breakpoints, short jumps' slots, evicted neighbours (the slot in them),
    return sites."""
    return ([(s.addr, s.addr + 1) if s.decision == BREAKPOINT else (s.addr, s.region_end)
             for s in plan.sites if s.head is None]
            + [(s.slot, s.slot + arch.JUMP_SIZE) for s in plan.sites if s.slot and s.evicted is None]
            + [(s.evicted.addr, s.evicted.region_end) for s in plan.sites if s.evicted is not None]
            + [(rs.addr, rs.region_end) for rs in plan.ret_sites])


def _reach(ranges: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(starts, reach) of ranges sorted by start, reach[i] the furthest end among the
    first i + 1 (blacklist.Index's bisection, asked inline for 52,000 branches): some
    range overlaps [lo, hi) iff, i = bisect_left(starts, hi), i and reach[i - 1] > lo;
    one holds [lo, hi) iff, i = bisect_right(starts, lo) - 1, i >= 0 and reach[i] >= hi."""
    starts, reach, hi = [], [], 0
    for lo, end in sorted(ranges):
        hi = max(hi, end)
        starts.append(lo)
        reach.append(hi)
    return starts, reach


def retarget_branches(image, analysis, arch, plan: Plan, rules) -> None:
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
    p_starts, p_reach = _reach(patched_ranges(arch, plan))
    f_starts, f_reach = _reach([(f.start, f.end) for f in image.fdes])

    # The copies in the detours too (not an exit whose copy a return hook makes).
    direct_target = arch.direct_branch_target
    for s in plan.sites:
        if s.decision not in JUMPS:
            continue
        for insn in s.segment:
            to = direct_target(insn)
            if to in entries and insn.addr not in s.ret_hooks:
                s.branch_to[insn.addr] = entries[to]

    # Every branch to a region's start, by source address (libpython: 52,000), so that
    # consecutive sources share their function's checks (function_at, decoded()).
    sources = analysis.branch_sources
    target_of = {src: target for target in entries for src in sources.get(target, ())}   # one target a branch
    branches = sorted(target_of)
    if not branches:
        return
    vouch = safety.enabled("retargeting")
    branch_disp, read, bisect_left, bisect_right = arch.emit.branch_disp, image.read, bisect.bisect_left, bisect.bisect_right
    # The target's reserved sites (none in a user image): asked per branch only where
    # some lie among the branches at all.
    reserved = rules.reserved_sites if rules.reserved_sites(branches[0], branches[-1] + 16) else None
    function_span, decoded = image.function_span, analysis.decoded
    f_lo = f_hi = 0                 # the branch before's function_at() holds for [f_lo, f_hi)
    f_ok, f_start, bounds, n_bounds, f_fde = False, 0, (), 0, False
    out = []
    for src in branches:
        off = branch_disp(read(src, 6))
        if off is None:
            continue
        size = off + 4
        i = bisect_left(p_starts, src + size)          # clear of every patched byte
        if i and p_reach[i - 1] > src or (reserved is not None and reserved(src, src + size)):
            continue
        if vouch:
            # Only branches the decoding vouches for: an instruction boundary of a function
            # decoded to its end, in code an FDE covers.
            if not f_lo <= src < f_hi:
                f, f_hi = function_span(src)
                f_lo = src
                if f is None:
                    f_ok = False
                else:
                    d = decoded(f)
                    f_ok, f_start, bounds = d.undecodable is None, f.start, d.boundaries
                    n_bounds = len(bounds)
                    # One FDE holds the whole function (the common case): so it holds each of
                    # its instructions (decoded from its bytes alone, none runs past its end).
                    i = bisect_right(f_starts, f.start) - 1
                    f_fde = i >= 0 and f_reach[i] >= f.end
            if not f_ok:
                continue
            o = src - f_start
            i = bisect_left(bounds, o)
            if i == n_bounds or bounds[i] != o:
                continue
            if not f_fde:
                i = bisect_right(f_starts, src) - 1     # inside one FDE
                if i < 0 or f_reach[i] < src + size:
                    continue
        target = target_of[src]
        out.append(Retarget(src, size, target, entries[target]))
    plan.retargets += out           # by source address
    if len(plan.retargets) > len(out):
        plan.retargets.sort(key=lambda r: r.src)
