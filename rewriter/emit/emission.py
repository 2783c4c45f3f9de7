"""Stage 6: emit code.  Reads the finished plan (forms chosen), the layout's
addresses (layout.Layout) and the linked runtime's symbols, and produces the bytes: each optimized
site's detour buffer and the jump that replaces its region (the kernel's
arch_prepare_optimized_kprobe() and arch_optimize_kprobes()), each return
site's detour, each breakpoint site's out-of-line slot and breakpoint
(arch_prepare_kprobe(), arch_arm_kprobe()).  The code of one site is the same
function whether `sym` holds the runtime's real addresses or, during layout,
placeholders (Far): only its size and internal offsets matter then.  Where the
arch logs the fields that reach the runtime (arch.base.LinkSym), the layout keeps
each detour's code and its links, and emit() patches those for the linked runtime,
as a linker applies relocations, rather than building every detour again.  Nothing
here decides or writes into the plan or the layout.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..arch.base import EMULATE, LinkSym
from ..errors import KprewriteError
from ..planner import HOOK_PENDING, HOOK_POINTER, HOOK_RET, HOOK_SWAP, BREAKPOINT, OPTIMIZED, Plan, Site
from ..probes.events import trace_key
from ..probes.resolve import is_entry

# The runtime's return hooks (runtime/arch/*/kretprobe_entry.S), by hook kind;
# the clean one (only scratch registers saved) for functions whose kretprobes'
# handlers never read regs; and the jmp form of the ret hooks, reached by jmp
# before a plain ret.
HOOK_SYMBOL = {HOOK_RET: "kp_kretprobe_ret_entry", HOOK_PENDING: "kp_kretprobe_tail_pending_entry",
               HOOK_SWAP: "kp_kretprobe_tail_swap_entry", HOOK_POINTER: "kp_kretprobe_tail_pointer_entry"}
HOOK_RET_CLEAN, HOOK_RET_JMP, HOOK_RET_CLEAN_JMP = \
    "kp_kretprobe_ret_clean_entry", "kp_kretprobe_ret_jmp_entry", "kp_kretprobe_ret_clean_jmp_entry"
JMP_FORM = {HOOK_SYMBOL[HOOK_RET]: HOOK_RET_JMP, HOOK_RET_CLEAN: HOOK_RET_CLEAN_JMP}


FAR = 0x1000000

# kp_kret_hooked[] (tables.py): an open-addressing table of the entries whose returns
# are all hooked, hashed by (address * KRET_HOOKED_MUL) >> (64 - bits), at most half full.
KRET_HOOKED_MUL = 0x9E3779B97F4A7C15


def kret_hooked_bits(n: int) -> int:
    return max(1, (2 * n - 1).bit_length())


class Far:
    """Placeholder addresses of runtime symbols, before linking: far enough from
    `at` that every reference takes its long form, as the real ones will.  Each is
    a LinkSym: the code built with them logs in `links` (address, symbol, ...)
    where it reaches one (an arch with an Emit.relink)."""
    __slots__ = ("at", "links")

    def __init__(self, at: int):
        self.at = at
        self.links: list = []

    def __getitem__(self, name: str) -> int:
        s = LinkSym(self.at + FAR)      # (LinkSym.of() written out: one per reference laid out)
        s.name, s.links = name, self.links
        return s


@dataclass
class Code:
    """What the plan's code needs besides the plan: where things are named."""
    image: object
    arch: object
    plan: Plan
    handler_symbol: dict          # handler name -> link symbol
    traced: set                   # events.trace_key of probes with a trace event
    thread_key: object = None     # arch.base.ThreadKey: the target's (templates find the thread with it)


def hook_symbol(group, kind: str) -> str:
    """The runtime hook an exit of `group` calls."""
    name = HOOK_SYMBOL[kind]
    return HOOK_RET_CLEAN if kind == HOOK_RET and group.ret_clean else name


def hook_targets(group, kind: str, sym) -> tuple[int, int | None]:
    """The shared return hook an exit calls: (call target, jmp target for a plain ret)."""
    name = hook_symbol(group, kind)
    jmp = JMP_FORM.get(name)
    return sym[name], (sym[jmp] if jmp else None)


def _hook(c: Code, group, kind: str, sym, at: int):
    """How an exit reaches its return hook: (call target, jmp target for a plain
    ret), or the inlined template (a function with one kretprobe, at a ret)."""
    hook = hook_targets(group, kind, sym)
    rp_ = c.arch.retprobe
    if kind in (HOOK_PENDING, HOOK_POINTER) and group.ret_template is not None \
            and hasattr(rp_, "inline_tail_hook"):
        # The pending mark inlined (the pointer's target looked up in kp_kret_hooked[]).
        return lambda exit, pos: rp_.inline_tail_hook(
            exit, pos, fast=sym["kp_fast"], table=sym["kp_thread_table"], key=c.thread_key, c_hook=hook[0],
            pointer=kind == HOOK_POINTER, slot=group.pointer_slots.get(exit.addr), hooked=sym["kp_kret_hooked"],
            bits=kret_hooked_bits(len(c.plan.hooked_entries)), mul=KRET_HOOKED_MUL)
    if kind == HOOK_POINTER:        # the pointer's target passed to the hook
        return lambda exit, pos: rp_.pointer_tail_hook(exit, pos, hook[0], group.pointer_slots.get(exit.addr))
    tpl = group.ret_template if kind == HOOK_RET else None
    if tpl is None:
        return hook
    rp = sym["kp_kretprobes"] + tpl["slot"] * c.arch.emit.KRETPROBE_SIZE
    handler = sym[tpl["handler"]] if tpl["handler"] else None
    # An arch whose hook frees a tail-calling caller's instance without handler inline
    # reads the handlers by position.
    more = dict(kretprobes=sym["kp_kretprobes"], handlers=sym["kp_kret_handlers"]) \
        if rp_.FREES_CALLERS_INLINE else {}
    if not group.ret_clean:
        return lambda exit, pos: rp_.full_ret_hook(
            exit, pos, fast=sym["kp_fast"], table=sym["kp_thread_table"], key=c.thread_key, rp=rp, handler=handler,
            return_c=sym["kp_kretprobe_return"], aligned=tpl["aligned"], **more)
    return lambda exit, pos: rp_.clean_ret_hook(
        exit, pos, fast=sym["kp_fast"], table=sym["kp_thread_table"], key=c.thread_key, rp=rp, handler=handler,
        return_c=sym["kp_kretprobe_return_clean"], full_hook=(sym[HOOK_SYMBOL[HOOK_RET]], sym[HOOK_RET_JMP]),
        aligned=tpl["aligned"], handler_clobbers=tpl["clobbers"], **more)


def _site_copy(c: Code, site: Site, at: int, sym):
    """How to copy a DCR holding a return-probed function's exits (None: plain relocation)."""
    if not site.ret_hooks:
        return None
    hooks = {a: _hook(c, g, kind, sym, at) for a, (g, kind) in site.ret_hooks.items()}
    if site.branch_blocks:          # branch exits: each jump's copy runs what it lands on, the hook, the exit
        return c.arch.retprobe.hook_copy(hooks, blocks=site.branch_blocks)
    return c.arch.retprobe.hook_copy(hooks)


def pre_handler_symbol(c: Code, p) -> str | None:
    """The link symbol the probe's pre_handler field holds: a trace event's generated
    pre_handler (which calls the user's, if any), else the user's."""
    if trace_key(p) in c.traced:
        return f"kp_trace_pre_{trace_key(p)}"
    return c.handler_symbol[p.spec.pre_handler] if p.spec.pre_handler else None


def detour_entries(site: Site, short: bool = False) -> tuple[str, str]:
    """The runtime's shared entries a non-template detour calls: (before, after the copy);
    short: those of the short stubs (a thread key without a red zone: a kernel's), the
    clean one before the copy keeping no flags where they are dead at the site."""
    entries = ("kp_optprobe_clean_entry", "kp_optprobe_clean_post_entry") if site.clean else \
              ("kp_optprobe_entry", "kp_optprobe_post_entry")
    if site.clean and any(is_entry(p) for p in site.probes):
        # Rules.kretprobe_clean_entry: the runtime's clean entry that passes the return-address slot.
        entries = ("kp_kretprobe_clean_entry", entries[1])
    if short:
        entries = tuple(e.replace("probe_", "probe_short_", 1) for e in entries)
        if entries[0] == "kp_optprobe_short_clean_entry" and not site.flags_live:
            entries = ("kp_optprobe_short_clean_nf_entry", entries[1])   # keeps no flags
    return entries


def copied(arch, lay, site: Site) -> list:
    """The instructions a site's detour copies (its segment), each direct branch
    to a detoured region's start sent to that detour (Site.branch_to; while laying
    out, to a detour that has no address yet, to the region: the encoding is as
    long)."""
    if not site.branch_to:
        return site.segment
    return [arch.with_branch_target(i, lay.detour(site.branch_to[i.addr]))
            if i.addr in site.branch_to and lay.detour(site.branch_to[i.addr]) else i for i in site.segment]


def site_detour(c: Code, lay, site: Site, at: int, sym) -> tuple[bytes, int, int]:
    """An optimized site's detour buffer at `at`: (code, resume, resume_post).
    lay: the layout (so far, while laying out) that names the other detours."""
    em = c.arch.emit
    back = lay.site(site).back or None
    if not site.template:
        short = c.thread_key is not None and not c.thread_key.red_zone
        entries = detour_entries(site, short)
        return em.detour(site.index, copied(c.arch, lay, site), site.with_post, at, sym[entries[0]], sym[entries[1]],
                         _site_copy(c, site, at, sym), back=back, short=short)
    p = site.probes[0]
    k = c.plan.hit_slot(p)
    if site.light:
        code, resume = em.light_detour(site.index, copied(c.arch, lay, site), at, fast=sym["kp_fast"],
                                       base=sym["kp_light_base"], hits=sym["kp_light_hits"], key=c.thread_key,
                                       counter=em.light_counter(k),
                                       slow_entry=sym["kp_optprobe_clean_entry"], flags_live=site.flags_live,
                                       red_zone=site.red_zone, copy=_site_copy(c, site, at, sym),
                                       back=back)
        return code, resume, resume
    if is_entry(p):
        # rp->kp of a kretprobe: its pre_handler is pre_handler_kretprobe(), its hit
        # counter follows the kprobes' (struct kretprobe starts with its kprobe).
        probe, handler = sym["kp_kretprobes"] + p.slot * em.KRETPROBE_SIZE, sym["kp_pre_handler_kretprobe"]
    else:
        probe = sym["kp_probes"] + p.slot * em.KPROBE_SIZE
        h = pre_handler_symbol(c, p)
        handler = sym[h] if h else None
    common = dict(fast=sym["kp_fast"], table=sym["kp_thread_table"], key=c.thread_key, probe=probe, probe_index=k,
                  handler=handler, aligned=site.aligned, red_zone=site.red_zone, copy=_site_copy(c, site, at, sym),
                  back=back)
    if site.clean or site.regs_fields is not None:
        callback, body, extra = sym["kp_optimized_clean_callback"], None, {}
        if is_entry(p):
            callback = sym["kp_kretprobe_enter_clean_slow"]
            body = _kret_entry_body(c, p, probe, sym, site.aligned, regs=False)
        if site.regs_fields is not None:    # a partial pt_regs; the slow path passes it
            callback, extra = sym["kp_optimized_callback"], {"regs_fields": site.regs_fields}
        code, resume = em.clean_detour(site.index, copied(c.arch, lay, site), at, callback=callback, flags_live=site.flags_live,
                                       handler_clobbers=site.clobbers, body=body, **common, **extra)
    else:
        # full_detour realigns the stack itself before the body.
        body = _kret_entry_body(c, p, probe, sym, True, regs=True) if is_entry(p) else None
        code, resume = em.full_detour(site.index, copied(c.arch, lay, site), at, callback=sym["kp_optimized_callback"],
                                      resume_regs=sym["kp_optprobe_resume_regs"], body=body, **common)
    return code, resume, resume


def region_ips(c: Code, lay, site: Site) -> list[tuple[int, int]]:
    """Where the instructions of a shared region that lie under its head's jump
    run in the detours (the runtime's kp_region_ips[]): a rider's own address
    maps to its detour (its probes fire, as at a breakpoint), any other
    instruction to its copy.  Copies are as long wherever they go (the arch's long
    forms: x86-64's rel32), so the layout's resume addresses place them."""
    if site.head is None and not site.riders:
        return []
    a = lay.site(site)
    out = [(site.addr, a.detour)] if site.head is not None else []
    copy = _site_copy(c, site, a.detour, Far(a.detour)) or c.arch.emit.relocate
    pos = a.resume
    for i, insn in enumerate(site.segment):
        if i:
            out.append((insn.addr, pos))
        pos += len(copy(insn, pos))
        if i == 0 and site.with_post and not site.template:
            pos = a.resume_post
    return out


def _kret_entry_body(c: Code, p, rp: int, sym, aligned: bool, regs: bool):
    """pre_handler_kretprobe() inlined in the entry template (retprobe.kret_entry_body)."""
    eh = p.kret.entry_handler
    return c.arch.retprobe.kret_entry_body(
        rp=rp, tramp=sym["kp_kretprobe_trampoline"], entry_handler=sym[c.handler_symbol[eh]] if eh else None,
        enter_c=sym["kp_kretprobe_enter"], aligned=aligned, inline=p.group.mode == OPTIMIZED, regs=regs)


def evicted_detour(c: Code, ev, at: int) -> bytes:
    """An evicted neighbour's detour at `at` (planner.EvictedRegion): its copy and the jump back."""
    return c.arch.emit.evicted_detour(ev.dcr, at)


def evicted_ips(c: Code, lay, ev) -> list[tuple[int, int]]:
    """Where the instructions inside an evicted region run (kp_region_ips[], as a
    shared region's): each to its copy, the region's start aside (its own jump
    still leads there)."""
    out, pos = [], lay.detour(ev)
    for i, insn in enumerate(ev.dcr):
        if i:
            out.append((insn.addr, pos))
        pos += len(c.arch.emit.relocate(insn, pos))
    return out


def ret_detour(c: Code, rs, at: int, sym) -> bytes:
    """A return site's detour at `at`: the DCR up to the exit, the hook, the exit; for a
    branch exit (planner/returns.py's _branch_exits()), the DCR up to the jump, then
    what it lands on, the hook and the exit."""
    if rs.block is not None:
        return c.arch.retprobe.branch_ret_detour(rs.dcr, rs.block, _hook(c, rs.group, rs.hook, sym, at), at,
                                                 rs.branch)
    return c.arch.retprobe.ret_detour(rs.dcr, _hook(c, rs.group, rs.hook, sym, at), at)


def xol_slot(c: Code, lay, site: Site, sym) -> bytes:
    """A boosted or single-stepped breakpoint site's out-of-line slot, where the layout put it."""
    slot = lay.xol[site.index]
    return c.arch.kprobe_xol.slot_code(site.xol, site.index, site.with_post, slot.addr,
                                       sym["kp_optprobe_post_entry"], slot.desc)


def unlinked(c: Code, layout) -> tuple[bytearray, list[tuple[int, bytes]]]:
    """What emit() makes that needs no linked runtime, so that it is made while the
    compiler and the linker run (pipeline.build): the new code with the layout's
    code of each detour it logged the links of (those still at the placeholders),
    the evicted regions' detours, and every patch to the image's own code (the
    jumps to the detours, the breakpoints, the branches sent to a detour)."""
    rx = bytearray(layout.text_addr - layout.rx_vaddr)
    patches = []
    em, base, links, code = c.arch.emit, layout.rx_vaddr, layout.links, layout.code
    for site in c.plan.sites:
        if site.decision == BREAKPOINT:
            patches.append((site.addr, c.arch.breakpoint))
            continue
        detour = layout.detour(site)
        key = ("site", site.index)
        if key in links:
            rx[detour - base:detour - base + len(code[key])] = code[key]
        if site.evicted is not None:    # a short jump to the jump in an evicted neighbour
            ev = site.evicted
            _put(rx, layout, layout.detour(ev), evicted_detour(c, ev, layout.detour(ev)), ("evicted", ev.addr))
            patches.append((site.addr, em.short_jump_patch(site.addr, site.region_end - site.addr, site.slot)))
            patches.append((ev.addr, em.evict_patch(ev.addr, ev.region_end - ev.addr, layout.detour(ev), detour)))
        elif site.slot:             # a short jump to the jump in the padding
            patches.append((site.addr, em.short_jump_patch(site.addr, site.region_end - site.addr, site.slot)))
            patches.append((site.slot, em.jump_patch(site.slot, c.arch.JUMP_SIZE, detour)))
        elif site.head is None:     # a rider's instruction lies under its head's jump
            at = site.jump_addr     # past a shared ftrace site (Rules.share_ftrace)
            patches.append((at, em.jump_patch(at, site.region_end - at, detour)))
    for rs in c.plan.ret_sites:
        detour = layout.detour(rs)
        key = ("ret", rs.addr)
        if key in links:
            rx[detour - base:detour - base + len(code[key])] = code[key]
        patches.append((rs.addr, em.jump_patch(rs.addr, rs.region_end - rs.addr, detour)))
    # Direct branches that enter the detour themselves (libpython: 52,000, to 6,000 detours).
    read, retarget_patch, detour = c.image.read, em.retarget_patch, layout.detour
    for r in c.plan.retargets:
        patches.append(retarget_patch(r.src, read(r.src, r.size), detour(r.to)))
    return rx, patches


def _put(rx: bytearray, layout, addr: int, code: bytes, key):
    if len(code) != layout.sizes[key]:
        raise KprewriteError(f"internal error: code at {addr:#x} is {len(code)} bytes, laid out for {layout.sizes[key]}")
    rx[addr - layout.rx_vaddr:addr - layout.rx_vaddr + len(code)] = code


def emit(c: Code, layout, sym: dict[str, int], early=None) -> tuple[bytearray, list[tuple[int, bytes]]]:
    """The new code below the runtime (stubs excluded), and the patches to the
    image's own code, where layout (layout.Layout) put each piece: (rx bytes from
    layout.rx_vaddr, [(addr, bytes)]).  early: unlinked()'s result, made before
    the runtime was linked (None: made here).  Each detour whose links the layout
    logged has them moved to `sym`'s addresses (the arch's relink: the bytes a build
    with sym gives); any other is built with sym."""
    rx, patches = early if early is not None else unlinked(c, layout)
    em, base, links = c.arch.emit, layout.rx_vaddr, layout.links
    for site in c.plan.sites:
        if site.decision == BREAKPOINT:
            if site.xol.mode != EMULATE:
                _put(rx, layout, layout.xol[site.index].addr, xol_slot(c, layout, site, sym), ("xol", site.index))
            continue
        detour = layout.detour(site)
        key = ("site", site.index)
        if key in links:
            em.relink(rx, -base, links[key], sym, detour + FAR)
        else:
            _put(rx, layout, detour, site_detour(c, layout, site, detour, sym)[0], key)
    for rs in c.plan.ret_sites:
        detour = layout.detour(rs)
        key = ("ret", rs.addr)
        if key in links:
            em.relink(rx, -base, links[key], sym, detour + FAR)
        else:
            _put(rx, layout, detour, ret_detour(c, rs, detour, sym), key)
    return rx, patches
