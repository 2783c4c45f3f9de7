"""kretprobes: resolve, refuse, plan the return sites, and describe them.

The entry half of a kretprobe is an ordinary kprobe at the function's entry
(the kernel's rp->kp with pre_handler_kretprobe), so it is planned, aggregated
and jump-optimized with the other kprobes; a kprobe on the same function shares
its detour.  The return half is planned here, once per function: every exit
(ret, tail-call jmp) gets a jump-optimized return hook (arch retprobe.py), or,
where no jump fits, a breakpoint return hook (an INT3 site at the exit,
`_place_int3_hooks()`).  Only a function whose exits cannot all be named (an indirect jump,
a conditional tail call) falls back to the kernel's return-address trampoline
(the entry swaps the return address).  How each hook is emitted (inlined
templates, clean or with pt_regs, or the shared hooks) is chosen once the
handlers are compiled: choose_return_hooks().
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from types import SimpleNamespace

from . import link
from .resolve import Probe, resolve
from .spec import KprobeSpec

OPTIMIZED, TRAMPOLINE = "optimized", "trampoline"
MODE_C = {OPTIMIZED: 0, TRAMPOLINE: 1}
HOOK_RET, HOOK_PENDING, HOOK_SWAP = "kp_kretprobe_ret_entry", "kp_kretprobe_tail_pending_entry", "kp_kretprobe_tail_swap_entry"
HOOK_RET_JMP = "kp_kretprobe_ret_jmp_entry"       # HOOK_RET reached by jmp before a plain ret
# The clean return hook (only scratch registers saved) of a function whose
# kretprobes' handlers never read regs; and its jmp form.
HOOK_RET_CLEAN, HOOK_RET_CLEAN_JMP = "kp_kretprobe_ret_clean_entry", "kp_kretprobe_ret_clean_jmp_entry"
# A breakpoint return hook's kind (KP_KRET_HOOK_* in kp_internal.h).
HOOK_KIND = {HOOK_RET: 1, HOOK_PENDING: 2, HOOK_SWAP: 3}
JMP_FORM = {HOOK_RET: HOOK_RET_JMP, HOOK_RET_CLEAN: HOOK_RET_CLEAN_JMP}

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
class EntryProbe(Probe):
    """The entry half of a kretprobe: rp->kp."""
    kret: object = None          # KretprobeSpec
    kind: str = "r"
    ret_clean: bool = False      # its handler never reads regs (emission decides)
    group: object = None         # its Group (plan_returns)

    @property
    def event_name(self) -> str:
        # trace_kprobe's default name for a return probe: r_SYMBOL_OFFSET.
        if self.kret.name:
            return self.kret.name
        if self.kret.addr is not None and not self.kret.symbol_name:
            return f"r_0x{self.kret.addr + self.kret.offset:x}"
        sym = "".join(c if c.isalnum() or c == "_" else "_" for c in self.symbol)
        return f"r_{sym}_{self.kret.offset}"


@dataclass
class RetSite:
    """A return site with its own detour: a 5-byte jmp at `addr`."""
    exit: object                 # arch Exit
    dcr: list
    addr: int
    region_end: int
    hook: str = HOOK_RET
    detour: int = 0


@dataclass
class Group:
    """The kretprobes of one function, and how its returns are caught."""
    func: object
    entry: int
    probes: list[EntryProbe]
    mode: str = OPTIMIZED
    reason: object = None
    exits: list = field(default_factory=list)
    sites: list[RetSite] = field(default_factory=list)
    embedded: list = field(default_factory=list)     # (kprobe Site, Exit)
    int3_exits: list = field(default_factory=list)   # (Exit, why no jump): breakpoint return hooks

    @property
    def ret_clean(self) -> bool:
        """No handler of its kretprobes reads regs at return (set at emission)."""
        return all(p.ret_clean for p in self.probes)


@dataclass
class KretPlan:
    groups: list[Group] = field(default_factory=list)
    sites: list[RetSite] = field(default_factory=list)
    site_hooks: dict = field(default_factory=dict)    # kprobe site addr -> {exit addr: hook symbol}
    ret_templates: dict = field(default_factory=dict)  # exit addr -> inlined clean hook's parameters
    _hooked: set = field(default_factory=set)         # starts of functions with every exit hooked

    def hook_of(self, g: Group, e) -> str:
        return HOOK_RET if e.kind == "ret" else self._tail_hook(e)

    def _tail_hook(self, e) -> str:
        return HOOK_PENDING if e.target in self._hooked else HOOK_SWAP


def is_entry(p) -> bool:
    return isinstance(p, EntryProbe)


def resolve_kretprobes(image, spec, arch, first_index: int) -> tuple[list[EntryProbe], list[str]]:
    """rp->kp of each [[kretprobe]], resolved as kprobes are."""
    ks = [KprobeSpec(k.table, k.symbol_name, k.addr, k.offset, None, None, k.disabled, k.name, None, k.is_glob)
          for k in spec.kretprobes]
    probes, errors = resolve(image, SimpleNamespace(path=spec.path, kprobes=ks), arch)
    out = []
    for p in probes:
        k = spec.kretprobes[ks.index(p.spec)]
        out.append(EntryProbe(p.spec, first_index + p.index, p.addr, p.func, p.symbol, p.offset, p.from_glob, k))
    return out, errors


def refuse(image, analysis, arch, probes: list[EntryProbe], spec_name: str, plan) -> list[EntryProbe]:
    """register_kretprobe()'s own checks: a function entry (kprobe_on_func_entry),
    not on the kretprobe blacklist, a function that returns."""
    from .arch.x86_64.retprobe import find_exits
    keep = []
    for p in probes:
        reason, check = None, None
        f = p.func
        if f is None:
            reason, check = f"a kretprobe must be on a function entry (kprobe_on_func_entry): no function covers {p.addr:#x}", "func_entry"
        elif p.addr != arch.optprobe.adjust_kprobe_addr(image, f.start, 0):
            reason, check = f"a kretprobe must be on a function entry (kprobe_on_func_entry): {p.label} is not", "func_entry"
        else:
            names = [f.name] + list(f.aliases)
            bad = next((n for n in names if n in KRETPROBE_BLACKLIST), None)
            if bad:
                reason, check = f"{bad} is on the kretprobe blacklist: {KRETPROBE_BLACKLIST[bad]}", "kretprobe_blacklist"
            elif ".cold" in f.name:
                reason, check = (f"{f.name} is a cold part of a function, entered by a jump, not a call: "
                                 "it has no return address"), "cold_part"
            elif analysis.decoded(f).undecodable is None and analysis.decoded(f).indirect_jump is None:
                ex = find_exits(image, analysis, f)
                if not ex.exits and ex.refusal is None:
                    reason, check = f"{f.name} has no ret and no tail call: it never returns", "never_returns"
        if reason is None:
            keep.append(p)
            continue
        plan.rejected.append((p, "refused", reason))
        if p.from_glob:
            plan.skipped[check].append(p)
        else:
            plan.errors.append(f"{spec_name}: {p.spec.table} ({p.label}): {reason}")
    return keep


def plan_returns(image, analysis, arch, plan) -> KretPlan:
    """Return sites of every function with a placed kretprobe."""
    rp = arch.retprobe
    kp = KretPlan()
    groups: dict[int, Group] = {}
    for site in plan.sites:
        for p in site.probes:
            if is_entry(p):
                g = groups.setdefault(site.addr, Group(p.func, site.addr, []))
                g.probes.append(p)
                p.group = g
    # Regions taken by probes, disjoint, sorted by start: overlap checks by bisection.
    taken = sorted((s.addr, s.region_end) for s in plan.sites)
    starts = [a for a, _ in taken]
    site_at = sorted((s.addr, s.region_end, s) for s in plan.sites if s.dcr)
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

    for g in sorted(groups.values(), key=lambda g: g.entry):
        ex = rp.find_exits(image, analysis, g.func)
        g.exits = ex.exits
        if ex.refusal is not None:
            # An exit we cannot even name (a conditional tail call, a jump into
            # another function's middle): only the trampoline catches it.
            g.mode, g.reason = TRAMPOLINE, ex.refusal
            continue
        mine: list[tuple[int, int]] = []
        for e in ex.exits:
            host = host_of(e.addr)
            if host is not None:
                g.embedded.append((host, e))
                continue
            part = next(pt for pt in ex.parts if pt.start <= e.addr < pt.end)
            r = rp.exit_region(image, analysis, part, e, lambda lo, hi: busy(lo, hi, mine))
            if not isinstance(r, tuple):
                # No jump fits: a breakpoint return hook at the exit (the return
                # address still stays where the caller put it).
                g.int3_exits.append((e, r))
                continue
            dcr, end = r
            mine.append((dcr[0].addr, end))
            g.sites.append(RetSite(e, dcr, dcr[0].addr, end))
        for r in mine:
            i = bisect.bisect_left(starts, r[0])
            starts.insert(i, r[0])
            taken.insert(i, r)
    # Tail calls to a function whose returns are all hooked leave the slot alone.
    kp._hooked = {g.func.start for g in groups.values() if g.mode == OPTIMIZED} | \
                 {g.entry for g in groups.values() if g.mode == OPTIMIZED}
    for g in sorted(groups.values(), key=lambda g: g.entry):
        kp.groups.append(g)
        for s in g.sites:
            s.hook = kp.hook_of(g, s.exit)
            kp.sites.append(s)
        for host, e in g.embedded:
            kp.site_hooks.setdefault(host.addr, {})[e.addr] = kp.hook_of(g, e)
    kp.sites.sort(key=lambda s: s.addr)
    _place_int3_hooks(image, arch, plan, kp)
    return kp


def _place_int3_hooks(image, arch, plan, kp: KretPlan) -> None:
    """Breakpoint sites for the exits no jump could hook (arch_prepare_kprobe()
    on the ret or the tail jmp, emulated out of line), aggregated with a
    breakpoint kprobe already at that address; the sites are re-indexed."""
    from .planner import Site, make_int3
    at = {s.addr: s for s in plan.sites}
    added = False
    for g in kp.groups:
        for e, why in g.int3_exits:
            site = at.get(e.addr)
            if site is None:
                site = at[e.addr] = make_int3(image, arch, Site(e.addr, [], reason=why))
                added = True
            site.kret_hook = HOOK_KIND[kp.hook_of(g, e)]
    if added:
        plan.sites = sorted(at.values(), key=lambda s: s.addr)
        for i, s in enumerate(plan.sites):
            s.index = i


# --- emission ---------------------------------------------------------------

def site_copy(s, site, at, sym):
    """For a per-site template: how to copy the DCR (None: plain relocation)."""
    hooks = s.kret.site_hooks.get(site.addr) if s.kret else None
    if not hooks:
        return None
    return s.arch.retprobe.hook_copy({a: _hook(s, n, sym, at, a) for a, n in hooks.items()})


def _hook(s, name: str, sym, at: int, exit_addr: int):
    """How the exit at exit_addr reaches its hook: (call target, jmp target for
    a plain ret), or the inlined template; placeholders before linking."""
    addr = (lambda n: sym[n]) if sym else (lambda n: at + 0x1000000)
    jmp = JMP_FORM.get(name)
    hook = addr(name), (addr(jmp) if jmp else None)
    tpl = s.kret.ret_templates.get(exit_addr) if name in (HOOK_RET, HOOK_RET_CLEAN) else None
    if tpl is None:
        return hook
    em = s.arch.emit
    rp = addr("kp_kretprobes") + tpl["index"] * em.KRETPROBE_SIZE
    if name == HOOK_RET:
        return lambda exit, pos: s.arch.retprobe.full_ret_hook(
            exit, pos, fast=addr("kp_fast"), table=addr("kp_thread_table"), rp=rp,
            handler=addr(tpl["handler"]) if tpl["handler"] else None, return_c=addr("kp_kretprobe_return"),
            aligned=tpl["aligned"])
    return lambda exit, pos: s.arch.retprobe.clean_ret_hook(
        exit, pos, fast=addr("kp_fast"), table=addr("kp_thread_table"), rp=rp,
        handler=addr(tpl["handler"]) if tpl["handler"] else None, return_c=addr("kp_kretprobe_return_clean"),
        full_hook=(addr(HOOK_RET), addr(HOOK_RET_JMP)), aligned=tpl["aligned"], handler_clobbers=tpl["clobbers"])


def choose_return_hooks(s, ret_clean, handler_info) -> None:
    """How each function's returns are hooked.  A function with one kretprobe
    gets the hook inlined at each ret (per-site templates): clean_ret_hook
    when its handler never reads regs (ret_clean(entry probe) says so),
    full_ret_hook otherwise.  Several kretprobes share the hooks of
    kretprobe_entry.S: the clean one when no handler reads regs.
    handler_info(name) gives the handler's (link symbol, clobbered scratch
    registers or None)."""
    kp = s.kret
    if kp is None:
        return
    index = {id(p): j for j, (_, p, _) in enumerate(placed(s))}
    for g in kp.groups:
        for p in g.probes:
            p.ret_clean = ret_clean(p)
        if g.ret_clean:
            for rs in g.sites:
                if rs.hook == HOOK_RET:
                    rs.hook = HOOK_RET_CLEAN
            for host, e in g.embedded:
                hooks = kp.site_hooks[host.addr]
                if hooks[e.addr] == HOOK_RET:
                    hooks[e.addr] = HOOK_RET_CLEAN
        if len(g.probes) != 1 or g.mode != OPTIMIZED:
            continue
        p = g.probes[0]
        trace = f"r{p.index}" in (s.traces or {})
        if trace:            # the generated trace handler (it calls the user's)
            sym, clobbers = f"kp_trace_ret_r{p.index}", None
        elif p.kret.handler:
            sym, clobbers = handler_info(p.kret.handler)
        else:
            sym, clobbers = None, set()
        tpl = {"index": index[id(p)], "handler": sym, "clobbers": clobbers,
               "aligned": s.arch.optprobe.stack_aligned_at(s.image, g.func, g.func.start)}
        for e in g.exits:
            if e.kind == "ret":
                kp.ret_templates[e.addr] = tpl


def layout(s, pos: int) -> int:
    """Addresses of the return-site detours."""
    for rs in s.kret.sites if s.kret else []:
        pos = (pos + 15) & ~15
        rs.detour = pos
        pos += len(s.arch.retprobe.ret_detour(rs.dcr, _hook(s, rs.hook, None, pos, rs.exit.addr), pos))
    return pos


def emit_sites(s, sym, put, patches) -> None:
    for rs in s.kret.sites if s.kret else []:
        put(rs.detour, s.arch.retprobe.ret_detour(rs.dcr, _hook(s, rs.hook, sym, rs.detour, rs.exit.addr), rs.detour))
        patches.append((rs.addr, s.arch.emit.jump_patch(rs.addr, rs.region_end - rs.addr, rs.detour)))


def placed(s) -> list[tuple[object, EntryProbe, Group]]:
    out = []
    by_addr = {x.addr: x for x in s.plan.sites}
    for g in s.kret.groups if s.kret else []:
        for p in g.probes:
            out.append((by_addr[g.entry], p, g))
    out.sort(key=lambda t: t[1].index)
    return out


def handler_names(spec) -> set[str]:
    return {n for k in spec.kretprobes for n in (k.handler, k.entry_handler) if n}


def missing_handler_lines(spec, missing) -> list[str]:
    lines = []
    for k in spec.kretprobes:
        for key in ("handler", "entry_handler"):
            n = getattr(k, key)
            if n in missing:
                lines.append(f"{spec.path.name}: {k.table}: {key} '{n}' is not defined in any handler file "
                             f"({', '.join(h.name for h in spec.handlers) or 'none listed'})")
    return lines


def table_c(s, link_sym: dict[str, str], first_index: int) -> tuple[str, dict[int, str]]:
    """struct kretprobe per placed kretprobe; and each entry probe's C reference."""
    rows = placed(s)
    refs = {}
    out = ["int kp_pre_handler_kretprobe(struct kprobe *, struct pt_regs *);",
           f"struct kretprobe kp_kretprobes[{max(1, len(rows))}] = {{"]
    for j, (site, p, g) in enumerate(rows):
        k = p.kret
        flags = ["KPROBE_FLAG_OPTIMIZED"] + (["KPROBE_FLAG_DISABLED"] if k.disabled else [])
        h = f"(kretprobe_handler_t){link_sym[k.handler]}" if k.handler else "0"
        if s.traces and f"r{p.index}" in s.traces:     # fetch / r event: the trace handler calls k.handler
            h = f"kp_trace_ret_r{p.index}"
            out.insert(0, f"int {h}(struct kretprobe_instance *, struct pt_regs *);")
        eh = f"(kretprobe_handler_t){link_sym[k.entry_handler]}" if k.entry_handler else "0"
        sym = link.c_string(p.symbol if (k.symbol_name or p.func) else None)
        out.append(f"  {{ .kp = {{ .addr = (kprobe_opcode_t *){p.addr:#x}UL, .symbol_name = {sym}, .offset = {p.offset}, "
                   f".pre_handler = kp_pre_handler_kretprobe, .flags = {'|'.join(flags)}, "
                   f".name = {link.c_string(p.event_name)}, .index = {first_index + j}, .site = {site.index} }}, "
                   f".handler = {h}, .entry_handler = {eh}, .maxactive = {k.maxactive}, .data_size = {k.data_size}, "
                   f".kp_mode = {MODE_C[g.mode]}, .kp_ret_clean = {int(p.ret_clean)} }},")
        refs[id(p)] = f"&kp_kretprobes[{j}].kp"
    out.append("};")
    out.append(f"const unsigned int kp_nkretprobes = {len(rows)};")
    return "\n".join(out) + "\n", refs


# --- reporting --------------------------------------------------------------

def describe(g: Group, s) -> str:
    # The decision word is the entry's (interface.md: optimized, ftrace, int3,
    # refused); how the returns are caught follows it.
    if g.mode == TRAMPOLINE:
        return f"{OPTIMIZED}  returns: {TRAMPOLINE}  {g.reason}"
    parts = []
    hooks = {}
    for rs in g.sites:
        hooks[rs.exit.addr] = rs.hook
    for host, e in g.embedded:
        hooks[e.addr] = s.kret.site_hooks[host.addr][e.addr]
    int3 = {e.addr for e, _ in g.int3_exits}
    for e in g.exits:
        if e.kind != "ret":
            hooks.setdefault(e.addr, s.kret.hook_of(g, e))
        what = "ret" if e.kind == "ret" else f"tail->{e.target:#x}" + (" (pending)" if hooks.get(e.addr) == HOOK_PENDING else " (trampoline)")
        parts.append(f"{e.addr:#x} {what}" + (" (int3)" if e.addr in int3 else ""))
    return f"{OPTIMIZED}  returns: {', '.join(parts)}"


def check_rows(s) -> list[tuple[int, str]]:
    return [(p.index, f"{p.label}  r  {describe(g, s)}") for _, p, g in placed(s)]


def metadata(s) -> list[dict]:
    out = []
    for site, p, g in placed(s):
        out.append({"index": p.index, "addr": p.addr, "kind": "r", "symbol": p.symbol, "offset": p.offset,
                    "name": p.event_name, "optimized": True, "disabled": p.kret.disabled,
                    "detour": site.detour, "region": [site.addr, site.region_end], "returns": g.mode,
                    "call": "clean" if site.clean else "pt_regs",
                    "inline_dispatch": site.template,
                    "return_hook": ("inline " if any(e.addr in s.kret.ret_templates for e in g.exits) else "")
                    + ("clean" if g.ret_clean else "pt_regs"),
                    "return_sites": [[rs.addr, rs.region_end, rs.exit.addr] for rs in g.sites]
                    + [[h.addr, h.region_end, e.addr] for h, e in g.embedded],
                    "int3_exits": [e.addr for e, _ in g.int3_exits]})
    return out
