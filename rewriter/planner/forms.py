"""The forms, once the handlers' code is known: how each site's detour and each
function's return hooks are emitted (clean call, pt_regs, inlined template,
light hit)."""
from __future__ import annotations

from ..probes.events import trace_key
from ..probes.resolve import is_entry
from ..analysis.rules import Rules
from .model import JUMPS, NO_HANDLER, OPTIMIZED, Group, HandlerCode, Plan, Site


def light_kretprobes(probes, rules: Rules) -> bool:
    """Whether the image's placed probes leave nothing to run at any return: light hits
    (Rules.light_hits: no handler anywhere, so no hit can find one running and nothing
    can enable or disable a probe), and every kretprobe without handler, entry_handler,
    data_size, fetch (a trace event) or maxactive.

    Such a kretprobe is light (light_group()): its entry counts the hit, as a light kprobe
    does, and nothing runs at its exits -- no instance is claimed, so none is freed.  What
    the kernel's kretprobe shows of a call without handlers is its hit and nmissed; the
    hit is counted at the entry, as for every kretprobe here, and nmissed counts the
    calls whose return could not be caught for want of a free instance (the pool of
    maxactive, which exists to remember the return address): a light kretprobe remembers
    nothing and misses no return, so nmissed stays 0, as the kernel's with a pool deep
    enough.  An explicit maxactive asks for that bound, so it keeps the instances."""
    if not rules.light_hits:
        return False
    for p in probes:
        if is_entry(p):
            k = p.kret
            if k.handler or k.entry_handler or k.data_size or k.maxactive > 0 or k.fetch is not None:
                return False
        elif p.spec.pre_handler or p.spec.post_handler or p.spec.fetch is not None:
            return False
    return True


def light_group(g: Group, rules: Rules, image_light: bool) -> bool:
    """A function whose one kretprobe is light (light_kretprobes() of the whole image):
    its entry must be a light template (jump-optimized, alone at its site, no
    post_handler, enabled); an entry that is a breakpoint (or shares its site) runs
    pre_handler_kretprobe() and keeps the instance and the hooked exits."""
    s = g.site
    return (image_light and rules.fast_forms and len(g.probes) == 1 and len(s.probes) == 1
            and s.decision in JUMPS and not s.with_post and not g.probes[0].kret.disabled)

def choose_forms(plan: Plan, image, arch, code: dict[str, HandlerCode], traces: dict, rules: Rules) -> None:
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
    regs.  traces: the keys of probes with a trace event (events.trace_key), each to
    whether its generated handler reads regs (TraceEvent.reads_regs).  Either way that
    handler is C calling the runtime: it may clobber any caller-saved register.

    light (Rules.light_hits): in an image with no handler at all (events count as handlers), a
    template only counts the hit (Site.light, emit.light_detour); so does a light kretprobe's
    entry (Group.light, light_kretprobes()), whose returns run nothing; red_zone
    (Rules.red_zone), of any template: where the ABI leaves room free (a function entry), which
    the arch's template may use: x86-64's light one saves its registers below the stack pointer
    without moving it, AArch64's use IP0/IP1 (x16, x17) without saving them."""
    traced = {k for k, reads_regs in traces.items() if reads_regs}
    events = bool(traces)
    for site in plan.sites:
        # Without fast forms, detours call the runtime's shared entries: optimized_callback()
        # with pt_regs, or the clean callback where no handler reads pt_regs.
        _site_form(site, image, arch, code, traces, traced, trace_key, rules.fast_forms, rules.kretprobe_clean_entry)
    # No handler anywhere in the image: no hit can find one running (nmissed stays 0)
    # and nothing can enable or disable a probe, so a template only counts the hit
    # (emit.light_detour).  One handler, even elsewhere, may call a probed function.
    # Kretprobes with nothing to run at their returns keep that (light_kretprobes()).  A light
    # one's entry is such a template whatever else the image holds: plan_returns() hooked none
    # of its exits (Group.light), so its entry must claim no instance.  Any other kretprobe's
    # (a breakpoint entry, an aggregated site) takes its instance as before.
    quiet = not events and light_kretprobes([p for s in plan.sites for p in s.probes], rules)
    for site in plan.sites:
        p0 = site.probes[0] if site.probes else None
        if p0 is not None and is_entry(p0) and p0.group is not None and p0.group.light:
            site.light = True          # light_group() asked what site.template asks
        else:
            site.light = quiet and site.template and not (p0 is not None and is_entry(p0)) \
                and not site.probes[0].spec.disabled
        site.red_zone = (site.light or site.template) and rules.red_zone and \
            arch.optprobe.red_zone_free_at(image, site.probes[0].func, site.addr)
    for g in plan.groups:
        for p in g.probes:
            p.ret_clean = trace_key(p) not in traced and not (p.kret.handler and code[p.kret.handler].reads_regs)
        if len(g.probes) != 1 or g.mode != OPTIMIZED or not rules.fast_forms or g.light:
            continue
        p = g.probes[0]
        if trace_key(p) in traces:           # the generated trace handler (it calls the user's)
            sym, clobbers = f"kp_trace_ret_{trace_key(p)}", None
        elif p.kret.handler:
            sym, clobbers = code[p.kret.handler].symbol, code[p.kret.handler].clobbers
        else:
            sym, clobbers = None, set()
        g.ret_template = {"slot": p.slot, "handler": sym, "clobbers": clobbers,
                          "aligned": arch.optprobe.stack_aligned_at(image, g.func, g.func.start)}


def _site_form(site: Site, image, arch, code: dict[str, HandlerCode], traces: dict, traced: set, trace_key,
               templates: bool = True, kret_clean_entry: bool = False) -> None:
    site.clean = True
    site.clobbers = set()
    for p in site.probes:
        if trace_key(p) in traces:
            site.clobbers = None    # the generated trace handler: C that calls the runtime
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
    site.regs_fields = None
    if site.template:
        p = site.probes[0]
        site.aligned = arch.optprobe.stack_aligned_at(image, p.func, site.addr)
        if not site.clean and not is_entry(p) and trace_key(p) not in traces and p.spec.pre_handler:
            # A pre_handler that only loads from regs at constant offsets: a partial
            # pt_regs, those fields saved, nothing restored (emit.clean_detour's regs_fields).
            site.regs_fields = code[p.spec.pre_handler].regs_fields
        if site.clean or site.regs_fields is not None:
            site.flags_live = not arch.optprobe.arith_flags_dead(image, p.func, site.addr)
    elif site.clean and site.decision in JUMPS and site.probes:
        # The shared clean entries' variant that keeps no flags (emission.detour_entries()).
        site.flags_live = not arch.optprobe.arith_flags_dead(image, site.probes[0].func, site.addr)
