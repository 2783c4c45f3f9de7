"""The `.kprewrite.meta` section a rewritten image carries: every placed probe, its
decision and where its code went, as one JSON document that `kprewrite list` and
`diff` read back (report.py) and each target's writer adds to its output."""
from __future__ import annotations

import json

from ..planner import FTRACE, BREAKPOINT, JUMPS, OPTIMIZED, Plan

META_SECTION = ".kprewrite.meta"


def metadata(plan: Plan, lay, label: str) -> bytes:
    """What `list` reads back: every placed probe, its decision and where its code went
    (lay: the layout.Layout; None for a target that places its own code, a module
    linked by `ld -r`, whose detours have no address before the module loader's)."""
    detour = lay.detour if lay is not None else (lambda x: 0)
    probes = []
    for site, p in plan.kprobes:
        d = {"index": p.index, "addr": p.addr, "kind": "k", "symbol": p.symbol, "offset": p.offset,
             "name": p.event_name, "optimized": site.decision == OPTIMIZED, "disabled": p.spec.disabled,
             "detour": detour(site), "region": [site.addr, site.region_end]}
        if site.decision == FTRACE:
            d["ftrace"] = True
            if site.jump_at:            # the site stays ftrace's; the jump is after it
                d["jump_at"] = site.jump_at
        if site.decision in JUMPS:
            d.update({"call": "clean" if site.clean else "pt_regs", "inline_dispatch": site.template})
            if site.light:              # counts its hits, nothing else (emit.light_detour)
                d["light"] = True
            if site.regs_fields is not None:    # a partial pt_regs: only these fields are saved
                d["regs_fields"] = sorted(site.regs_fields)
        if site.head is not None:       # rides on the detour of the probe whose jump covers it
            d["shared_with"] = site.head.addr
        if site.slot:                   # a short jump to the jump at the slot
            d["jump_slot"] = site.slot
        if site.evicted is not None:    # the slot lies in a neighbour moved to a detour of its own
            d["evicted"] = [site.evicted.addr, site.evicted.region_end, detour(site.evicted)]
        if site.decision == BREAKPOINT:
            d.update({"int3": site.xol.mode, "reason": str(site.reason)})
        probes.append(d)
    for site, p, g in plan.kretprobes:
        probes.append({"index": p.index, "addr": p.addr, "kind": "r", "symbol": p.symbol, "offset": p.offset,
                       "name": p.event_name, "optimized": site.decision == OPTIMIZED, "disabled": p.kret.disabled,
                       "detour": detour(site), "region": [site.addr, site.region_end], "returns": g.mode,
                       "call": "clean" if site.clean else "pt_regs",
                       "inline_dispatch": site.template,
                       "return_hook": ("inline " if g.ret_template and any(e.kind == "ret" for e in g.exits) else "")
                       + ("clean" if g.ret_clean else "pt_regs"),
                       "return_sites": [[rs.addr, rs.region_end, rs.exit.addr] for rs in g.sites]
                       + [[h.addr, h.region_end, e.addr] for h, e in g.embedded]
                       + [[h.addr, h.region_end, e.addr] for h, _, _, e in g.embedded_branches],
                       "int3_exits": [e.addr for e, _ in g.breakpoint_exits]})
        if g.light:                     # nothing runs at its returns (planner.forms.light_kretprobes)
            probes[-1].update({"light": True, "returns": "light"})
        if site.decision == FTRACE:
            probes[-1]["ftrace"] = True
            if site.jump_at:
                probes[-1]["jump_at"] = site.jump_at
        if site.decision == BREAKPOINT:       # the entry is a breakpoint (list: [BOOSTED]..., not [OPTIMIZED])
            probes[-1].update({"int3": site.xol.mode, "reason": str(site.reason)})
        if site.head is not None:
            probes[-1]["shared_with"] = site.head.addr
        if site.slot:
            probes[-1]["jump_slot"] = site.slot
        if site.evicted is not None:
            probes[-1]["evicted"] = [site.evicted.addr, site.evicted.region_end, detour(site.evicted)]
    probes.sort(key=lambda d: d["index"])
    doc = {"format": "kprewrite-1", "input": label, "probes": probes}
    if plan.retargets:      # direct branches sent to a detour (`diff` attributes their bytes)
        doc["branches"] = [[r.src, r.size, r.target] for r in plan.retargets]
    if plan.signal_syscalls:    # rt_sigprocmask/rt_sigaction sent to the runtime (a user process)
        doc["signal_syscalls"] = [[sc.addr, sc.end, sc.nr] for sc in plan.signal_syscalls]
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
