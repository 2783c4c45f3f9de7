"""Beyond the kernel: direct branches to a detoured region's start name the
detour itself (Rules.retarget_branches)."""
from __future__ import annotations

from .. import blacklist as bl
from .. import safety
from .model import INT3, JUMPS, OPTIMIZED, Plan, Retarget

def patched_ranges(arch, plan: Plan) -> bl.Index:
    """Every byte range the plan writes in the image's code: regions,
    breakpoints, short jumps' slots, evicted neighbours (the slot in them),
    return sites."""
    ranges = ([(s.addr, s.addr + 1) if s.decision == INT3 else (s.addr, s.region_end)
               for s in plan.sites if s.head is None]
              + [(s.slot, s.slot + arch.JUMP_SIZE) for s in plan.sites if s.slot and s.evicted is None]
              + [(s.evicted.addr, s.evicted.region_end) for s in plan.sites if s.evicted is not None]
              + [(rs.addr, rs.region_end) for rs in plan.ret_sites])
    return bl.Index([bl.BlacklistEntry(lo, hi, "", "patched") for lo, hi in ranges])


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
    patched = patched_ranges(arch, plan)
    fdes = bl.Index([bl.BlacklistEntry(f.start, f.end, "", "FDE") for f in image.fdes])

    on = []                     # safety.enabled("retargeting"), asked once (52,000 branches in libpython)

    function_at, decoded, is_boundary, covers = image.function_at, analysis.decoded, analysis.is_boundary, fdes.covers
    decodable: dict[int, bool] = {}     # by function start

    def vouched(src, size):
        if not on:
            on.append(safety.enabled("retargeting"))
        if not on[0]:
            return True
        f = function_at(src)
        if f is None:
            return False
        ok = decodable.get(f.start)
        if ok is None:
            ok = decodable[f.start] = decoded(f).undecodable is None
        return ok and is_boundary(f, src) and covers(src, src + size)

    # The copies in the detours too (not an exit whose copy a return hook makes).
    for s in plan.sites:
        if s.decision not in JUMPS:
            continue
        for insn in s.segment:
            if insn.addr not in s.ret_hooks and arch.direct_branch_target(insn) in entries:
                s.branch_to[insn.addr] = entries[arch.direct_branch_target(insn)]
    branch_disp, read, overlapping, reserved = arch.emit.branch_disp, image.read, patched.overlapping, rules.reserved_sites
    retargets, sources = plan.retargets, analysis.branch_sources
    for target, to in sorted(entries.items()):
        for src in sorted(set(sources.get(target, ()))):
            off = branch_disp(read(src, 6))
            if off is None:
                continue
            size = off + 4
            if overlapping(src, src + size) is not None or reserved(src, src + size) or not vouched(src, size):
                continue
            retargets.append(Retarget(src, size, target, to))
    plan.retargets.sort(key=lambda r: r.src)
