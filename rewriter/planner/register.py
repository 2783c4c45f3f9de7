"""register_kprobe()'s and register_kretprobe()'s checks, one probe at a time:
instruction boundary, blacklist, can_probe; a kretprobe's function entry and
kretprobe_blacklist."""
from __future__ import annotations

from ..analysis import blacklist as bl
from .. import safety
from ..probes.resolve import EntryProbe, Probe
from .exits import find_exits

def register_refusal(image, analysis, arch, p: Probe, blacklist) -> tuple | None:
    """register_kprobe()'s checks: (reason, check name[, address]), or None."""
    if p.func is None:
        return f"no function symbol or FDE covers {p.addr:#x}, so the instruction boundary cannot be checked", "no_function"
    if p.spec.symbol_name and not p.from_glob and not (p.func.start <= p.addr < p.func.end and p.addr - p.offset >= p.func.start):
        return f"offset {p.offset:#x} is beyond the end of {p.symbol}", "offset"
    if not analysis.is_boundary(p.func, p.addr):
        return f"{p.addr:#x} is not an instruction boundary of {p.func.name} (decoded from {p.func.start:#x})", "insn_boundary"
    e = bl.lookup(blacklist, p.addr)
    if e is not None and safety.enabled("blacklist"):
        return f"{p.addr:#x} is blacklisted: {e.reason} ({e.symbol})", "blacklist"
    r = arch.optprobe.can_probe_insn(image, p.addr)
    if r is not None and not arch.kprobe_xol.emulates_refused(image, p.addr) and safety.enabled("can_probe"):
        return str(r), r.check, r.addr
    return None


def kretprobe_refusal(image, analysis, arch, p: EntryProbe, rules) -> tuple[str, str] | None:
    """register_kretprobe()'s own checks: a function entry (kprobe_on_func_entry),
    not on the kretprobe blacklist, a function that returns; beyond the kernel,
    an entry where a call lands (its CFA rule: arch.retprobe.entry_frame_refusal())."""
    if not rules.kretprobes:
        return f"kretprobes are not supported in {image.label} yet", "kretprobe"
    f = p.func
    if f is None:
        return f"a kretprobe must be on a function entry (kprobe_on_func_entry): no function covers {p.addr:#x}", "func_entry"
    if p.addr != arch.optprobe.adjust_kprobe_addr(image, f.start, 0):
        return f"a kretprobe must be on a function entry (kprobe_on_func_entry): {p.label} is not", "func_entry"
    bad = next((n for n in [f.name] + list(f.aliases) if n in rules.kretprobe_blacklist), None)
    if bad:
        return f"{bad} is on the kretprobe blacklist: {rules.kretprobe_blacklist[bad]}", "kretprobe_blacklist"
    if ".cold" in f.name and safety.enabled("cold_parts"):
        return (f"{f.name} is a cold part of a function, entered by a jump, not a call: "
                "it has no return address"), "cold_part"
    # Blacklisted places (a PLT's FDE, say) keep the blacklist's reason.
    why = arch.retprobe.entry_frame_refusal(image, p.addr) if bl.lookup(rules.blacklist, p.addr) is None else None
    if why is not None:
        return why.detail, why.check, why.addr
    d = analysis.decoded(f)
    if d.undecodable is None and d.indirect_jump is None:
        ex = find_exits(image, analysis, arch, f)
        if not ex.exits and ex.refusal is None:
            return f"{f.name} has no ret and no tail call: it never returns", "never_returns"
    if rules.kretprobe_exits and d.undecodable is None and ".cold" not in f.name:     # a cold part: cold_part's
        # Exits that cannot all be named leave only the return-address trampoline
        # (planner/returns.py); where it is unsafe (the function reads its own return
        # address, as libgcc's _Unwind_RaiseException does to unwind from its caller,
        # or an exception may unwind through its frame), nothing can hook the returns.
        ex = find_exits(image, analysis, arch, f)
        if ex.refusal is not None and ex.refusal.check != "decode":
            why = arch.retprobe.trampoline_refusal(image, analysis, f, ex.parts, ex.exits)
            if why is not None:
                return (f"its exits cannot all be hooked ({ex.refusal.detail}) and the return-address trampoline "
                        f"is unsafe: {why.detail}"), "trampoline_unsafe", why.addr
    return None
