"""The pipeline: load the image -> resolve probes -> analyse functions -> plan
-> emit code and data -> link handlers and runtime -> write.  Each stage is its
own module; this one only passes plain data between them."""
from __future__ import annotations

import json
import os
import struct
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from . import blacklist as bl
from . import events as ev_mod
from . import fetch as fetch_mod
from . import kretprobe as kret
from . import link, sighook, writer
from .analysis import Analysis
from .arch import get_arch
from .errors import KprewriteError
from .image import Image
from .planner import INT3, OPTIMIZED, Plan, plan
from .resolve import Probe, resolve
from .spec import Spec, load_spec

META_SECTION = ".kprewrite.meta"
STUB_ROOM = 64
DT_INIT, DT_FINI, DT_INIT_ARRAY, DT_FINI_ARRAY = 12, 13, 25, 26


@dataclass
class Session:
    image: Image
    spec: Spec
    arch: object
    analysis: Analysis
    probes: list[Probe]
    blacklist: list
    plan: Plan
    handler_symbols: dict | None = None    # handler name -> link symbol
    handler_exports: dict | None = None    # C source -> names it exports
    probe_order: dict | None = None        # id(probe) -> index in kp_probes[]
    kret_order: dict | None = None         # id(entry probe) -> index in kp_kretprobes[]
    kret: object = None                    # kretprobe.KretPlan: return sites
    traces: dict | None = None             # probe index ("rN" for kretprobes) -> events.TraceEvent


def prepare(input_path: str, spec_path: str, no_optimize: bool = False, strict: bool = True) -> Session:
    """Everything up to the plan.  strict: refused probes are an error (instrument);
    otherwise they stay in the plan to be printed (check)."""
    spec = load_spec(spec_path)
    errors = ev_mod.expand(spec)        # kprobe_events lines become probe tables
    image = Image(input_path)
    arch = get_arch(image.machine)
    probes, res_errors = resolve(image, spec, arch)
    errors += res_errors
    analysis = Analysis(image, arch)
    blist = bl.compute(image)
    kprobes_n = len(probes)
    rprobes, res_errors = kret.resolve_kretprobes(image, spec, arch, kprobes_n)
    errors += res_errors
    refused = Plan()
    rprobes = kret.refuse(image, analysis, arch, rprobes, spec.path.name, refused)
    p = plan(image, analysis, arch, probes + rprobes, blist, spec.optimize and not no_optimize, spec.path.name)
    p.errors += refused.errors
    p.rejected += refused.rejected
    for check, ps in refused.skipped.items():
        p.skipped[check].extend(ps)
    if strict:
        errors += p.errors
    s = Session(image, spec, arch, analysis, probes, blist, p)
    s.kret = kret.plan_returns(image, analysis, arch, p)
    s.traces = {}
    for pr in probes:                   # fetch programs, compiled once at rewrite time
        t, terr = ev_mod.compile_probe(image, arch, pr, spec.path.name)
        if terr and terr[0] not in errors:    # a syntax error is already reported by expand()
            errors += terr
        if t is not None:
            s.traces[pr.index] = t
    for _, pr, _ in kret.placed(s):     # kretprobes with fetch, and r events
        t, terr = ev_mod.compile_return(image, pr.kret, pr.func, spec.path.name)
        if terr and terr[0] not in errors:
            errors += terr
        if t is not None:
            s.traces[f"r{pr.index}"] = t
    if strict:
        errors += _resolve_handlers(s)
    if errors:
        raise KprewriteError(*errors)
    return s


def _resolve_handlers(s: Session) -> list[str]:
    """Every handler the placed probes name must be defined in a handler file."""
    names = {n for k in s.spec.kprobes for n in (k.pre_handler, k.post_handler) if n} | kret.handler_names(s.spec)
    if not names:
        s.handler_symbols, s.handler_exports = {}, {}
        return []
    s.handler_symbols, s.handler_exports, missing = link.resolve_handlers(link.compiler(), s.spec.handlers, names)
    lines = []
    # Detours save no SSE/AVX/x87 state, so handler code must not touch it: C
    # sources are compiled with -mgeneral-regs-only, prebuilt objects are read.
    for h in s.spec.handlers:
        if h.suffix == ".o":
            for sec in link.executable_sections(h):
                at = s.arch.handler_abi.vector_use(sec, 0)
                if at is not None:
                    lines.append(f"{s.spec.path.name}: handlers: {h.name} uses SSE/AVX/x87 registers at "
                                 f"{at:#x}, which detours do not save; compile it with -mgeneral-regs-only")
                    break
    for k in s.spec.kprobes:
        for key in ("pre_handler", "post_handler"):
            n = getattr(k, key)
            if n in missing:
                lines.append(f"{s.spec.path.name}: {k.table}: {key} '{n}' is not defined in any handler file "
                             f"({', '.join(h.name for h in s.spec.handlers) or 'none listed'})")
    return lines + kret.missing_handler_lines(s.spec, missing)


def prepare_for_check(input_path: str, spec_path: str, no_optimize: bool = False) -> Session:
    return prepare(input_path, spec_path, no_optimize, strict=False)


def check_lines(s: Session) -> list[str]:
    rows = []
    for site in s.plan.sites:
        for p in site.probes:
            if kret.is_entry(p):
                continue
            if site.decision == INT3:   # breakpoint probe: why not optimized, and how it runs out of line
                rows.append((p.index, f"{p.label}  k  {INT3}  {site.reason}  [{site.xol.mode}]"))
                continue
            rows.append((p.index, f"{p.label}  k  {OPTIMIZED}"))
    rows += kret.check_rows(s)
    for p, decision, reason in s.plan.rejected:
        rows.append((p.index, f"{p.label}  {getattr(p, 'kind', 'k')}  {decision}  {reason}"))
    return [r for _, r in sorted(rows)]


def skipped_summary(s: Session) -> list[str]:
    if not s.plan.skipped:
        return []
    n = sum(len(v) for v in s.plan.skipped.values())
    placed = sum(len(site.probes) for site in s.plan.sites)
    lines = [f"{placed} probes placed, {n} from globs skipped:"]
    for check, ps in sorted(s.plan.skipped.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"  {len(ps):6d}  {check}")
    return lines


def _probe_table_c(s: Session, link_sym: dict[str, str]) -> str:
    """The generated C: struct kprobe per probe, one kp_site per address."""
    placed = [(site, p) for site in s.plan.sites for p in site.probes if not kret.is_entry(p)]
    placed.sort(key=lambda sp: sp[1].index)
    order = {id(p): i for i, (_, p) in enumerate(placed)}
    out = ['#include "kp_internal.h"']
    for name in sorted(set(link_sym.values())):
        out.append(f"extern char {name}[];")
    out.append(f"struct kprobe kp_probes[{max(1, len(placed))}] = {{")
    for site, p in placed:
        flags = (["KPROBE_FLAG_OPTIMIZED"] if site.decision == OPTIMIZED else ["0"]) + (["KPROBE_FLAG_DISABLED"] if p.spec.disabled else [])
        pre = f"(kprobe_pre_handler_t){link_sym[p.spec.pre_handler]}" if p.spec.pre_handler else "0"
        if s.traces and p.index in s.traces:     # trace event: its pre_handler runs the fetch
            pre = f"kp_trace_pre_{p.index}"
            out.insert(1, f"int {pre}(struct kprobe *, struct pt_regs *);")
        post = f"(kprobe_post_handler_t){link_sym[p.spec.post_handler]}" if p.spec.post_handler else "0"
        sym = link.c_string(p.symbol if (p.spec.symbol_name or p.func) else None)
        out.append(f"  {{ .addr = (kprobe_opcode_t *){p.addr:#x}UL, .symbol_name = {sym}, .offset = {p.offset}, "
                   f".pre_handler = {pre}, .post_handler = {post}, .flags = {'|'.join(flags)}, "
                   f".name = {link.c_string(p.event_name)}, .index = {order[id(p)]}, .site = {site.index} }},")
    out.append("};")
    out.append(f"const unsigned int kp_nprobes = {len(placed)};")
    out.append(f"struct kp_site kp_sites[{max(1, len(s.plan.sites))}] = {{")
    first = 0
    for site in s.plan.sites:
        out.append(f"  {{ {site.addr:#x}UL, {site.post_ip:#x}UL, {site.resume:#x}UL, {site.resume_post:#x}UL, {first}, {len(site.probes)} }},")
        first += len(site.probes)
    out.append("};")
    out.append(f"const unsigned int kp_nsites = {len(s.plan.sites)};")
    kret_c, kret_refs = kret.table_c(s, link_sym, len(placed))
    out.append(kret_c)
    refs = ", ".join(kret_refs.get(id(p)) or f"&kp_probes[{order[id(p)]}]" for site in s.plan.sites for p in site.probes) or "0"
    out.append(f"struct kprobe *const kp_site_probes[] = {{ {refs} }};")
    out.append(s.arch.kprobe_xol.table_c(s.plan.sites))
    out.append(sighook.table_c(s.image, any(site.decision == INT3 for site in s.plan.sites)))
    out.append("unsigned long kp_link_anchor_addr = (unsigned long)&kp_link_anchor;")
    em = s.arch.emit   # layouts the clean-call template reads directly
    out.append(f"_Static_assert(sizeof(struct kprobe) == {em.KPROBE_SIZE} && "
               f"__builtin_offsetof(struct kprobe, flags) == {em.KPROBE_FLAGS} && "
               f"sizeof(struct kretprobe) == {em.KRETPROBE_SIZE} && __builtin_offsetof(struct kretprobe, kp) == 0 && "
               f"__builtin_offsetof(struct kp_thread, active) == {em.THREAD_ACTIVE} && "
               f"__builtin_offsetof(struct kp_thread, hits) == {em.THREAD_HITS} && "
               f"KP_TABLE_MASK == {em.THREAD_TABLE_MASK} && KP_HASH(1UL << 12) == 1 && KP_HASH(0xfffUL) == 0, "
               f"\"kprewrite's clean-call template is out of date\");")
    off = "__builtin_offsetof"
    out.append(f"_Static_assert({off}(struct kp_thread, kret) == {em.THREAD_KRET} && "
               f"{off}(struct kp_kret_thread, depth) == {em.KRET_DEPTH} && "
               f"{off}(struct kp_kret_thread, tail_slot) == {em.KRET_TAIL_SLOT} && "
               f"{off}(struct kp_kret_thread, stack) == {em.KRET_STACK} && "
               f"{off}(struct kretprobe, maxactive) == {em.RP_MAXACTIVE} && {off}(struct kretprobe, kp_stride) == {em.RP_STRIDE} && "
               f"{off}(struct kretprobe, kp_pool) == {em.RP_POOL} && {off}(struct kretprobe, kp_hint) == {em.RP_HINT} && "
               f"{off}(struct kretprobe_instance, rp) == {em.RI_RP} && {off}(struct kretprobe_instance, ret_addr) == {em.RI_RET_ADDR} && "
               f"{off}(struct kretprobe_instance, fp) == {em.RI_FP} && {off}(struct kretprobe_instance, kp_state) == {em.RI_STATE} && "
               f"{off}(struct kretprobe_instance, kp_flags) == {em.RI_FLAGS} && KP_RI_TRAMP == {em.RI_TRAMP}, "
               f"\"kprewrite's kretprobe templates are out of date\");")
    traces = s.traces or {}
    if traces:
        users = {p.index: link_sym[p.spec.pre_handler] for _, p in placed if p.spec.pre_handler}
        users.update({f"r{p.index}": link_sym[p.kret.handler] for _, p, _ in kret.placed(s) if p.kret.handler})
        out += ev_mod.trace_c(traces, users, fetch_mod.symbol_table(s.image)).splitlines()
    else:
        out += ev_mod.trace_c({}, {}, []).splitlines()
    return "\n".join(out) + "\n"


def _slot_hook(image: Image, tag_array: int, tag_single: int):
    """Where to hook a shared object's init (or fini): the first DT_*_ARRAY
    slot's R_X86_64_RELATIVE addend, else DT_INIT/DT_FINI itself.  Returns
    (file offset of the 8 bytes to rewrite, the function it held)."""
    arr = image.dynamic.get(tag_array)
    if arr:
        for rel_off, r_offset, addend in image.relative_relocations():
            if r_offset == arr:
                return rel_off + 16, addend
    single = image.dynamic.get(tag_single)
    if single:
        dyn = image.section_named(".dynamic")
        if dyn is not None:
            for i in range(dyn.size // 16):
                o = dyn.offset + i * 16
                if int.from_bytes(image.data[o:o + 8], "little") == tag_single:
                    return o + 8, single
    return None


def emit(s: Session, workdir: Path) -> bytes:
    image, arch, em = s.image, s.arch, s.arch.emit
    layout = writer.plan_layout(image)
    pos = layout.after_phdrs
    # Start-up stubs: one for executables, init and fini for shared objects.
    stub_at = {}
    for name in (["entry"] if image.is_executable else ["init", "fini"]):
        stub_at[name] = pos
        pos += STUB_ROOM
    # Handlers first: whether a site may use the clean call depends on their code.
    cc = link.compiler()
    hobjs = link.compile_handlers(cc, workdir, s.spec.handlers, s.handler_exports)
    code = _handler_code(s, hobjs)
    for site in s.plan.sites:
        _choose_entry(s, site, code)
    kret.choose_return_hooks(s, lambda p: f"r{p.index}" not in (s.traces or {})
                             and not (p.kret.handler and code[p.kret.handler].reads_regs),
                             lambda name: (s.handler_symbols[name], code[name].clobbers))
    # Detours: addresses first (their size does not depend on where the runtime lands).
    far = pos + 0x1000000
    placeholder = defaultdict(lambda: far)      # every runtime symbol, before linking
    for site in s.plan.sites:
        if site.decision == INT3:
            continue
        pos = (pos + 15) & ~15
        code, site.resume, site.resume_post = _detour(s, site, pos, placeholder)
        site.detour = pos
        pos += len(code)
    pos = kret.layout(s, pos)
    # Out-of-line slots of breakpoint probes (the kernel's insn slots).
    for site in s.plan.sites:
        if site.decision == INT3 and site.xol.mode != "emulate":
            code = arch.kprobe_xol.slot_code(site.xol, site.index, site.with_post, pos, pos + 0x1000000)
            site.resume, site.resume_post = site.xol.slot, site.xol.slot_post
            site.detour = pos
            pos += len(code)
    text_addr = (pos + 63) & ~63
    # Handlers and runtime.
    objs = link.compile_runtime(cc, workdir) + hobjs + \
        [link.compile_table(cc, workdir, _probe_table_c(s, s.handler_symbols))]
    blob = link.link(workdir, objs, text_addr)
    sym = blob.symbols
    # Final code, now that the runtime's addresses are known.
    rx = bytearray(text_addr - layout.rx_vaddr)
    def put(addr, code, room=None):
        if room is not None and len(code) > room:
            raise KprewriteError(f"internal error: stub at {addr:#x} is {len(code)} bytes")
        rx[addr - layout.rx_vaddr:addr - layout.rx_vaddr + len(code)] = code
    file_patches = []
    entry = None
    if image.is_executable:
        put(stub_at["entry"], em.entry_stub(stub_at["entry"], sym["kp_user_start"], int.from_bytes(image.data[24:32], "little")), STUB_ROOM)
        entry = stub_at["entry"]
    else:
        for name, arr, single, fn in (("init", DT_INIT_ARRAY, DT_INIT, "kp_user_lib_init"), ("fini", DT_FINI_ARRAY, DT_FINI, "kp_user_lib_fini")):
            hook = _slot_hook(image, arr, single)
            if hook is None:
                if name == "init":
                    raise KprewriteError(f"{image.path}: shared object has neither DT_INIT_ARRAY nor DT_INIT to start the runtime from")
                continue
            off, old = hook
            put(stub_at[name], em.chain_stub(stub_at[name], sym[fn], old), STUB_ROOM)
            file_patches.append((off, struct.pack("<Q", stub_at[name])))
    patches = []
    for site in s.plan.sites:
        if site.decision == INT3:
            if site.xol.mode != "emulate":
                put(site.detour, arch.kprobe_xol.slot_code(site.xol, site.index, site.with_post, site.detour,
                                                           sym["kp_optprobe_post_entry"]))
            patches.append((site.addr, b"\xcc"))
            continue
        code, resume, resume_post = _detour(s, site, site.detour, sym)
        assert (resume, resume_post) == (site.resume, site.resume_post)
        put(site.detour, code)
        patches.append((site.addr, em.jump_patch(site.addr, site.region_end - site.addr, site.detour)))
    kret.emit_sites(s, sym, put, patches)
    rx += blob.text
    sections = [
        writer.NewSection(".kprewrite.text", 1, 6, layout.rx_vaddr, bytes(rx)),
        writer.NewSection(".kprewrite.data", 1, 3, blob.data_addr, blob.data),
    ]
    if blob.data_memsz > len(blob.data):
        sections.append(writer.NewSection(".kprewrite.bss", 8, 3, blob.data_addr + len(blob.data), b"", blob.data_memsz - len(blob.data)))
    sections.append(writer.NewSection(META_SECTION, 1, 0, 0, metadata(s), align=1))
    return writer.write_image(image, layout, patches, bytes(rx), blob.data_addr, blob.data, blob.data_memsz,
                              sections, entry, file_patches)


@dataclass
class HandlerCode:
    """What handler_abi read in a handler's compiled code."""
    reads_regs: bool                 # may read its pt_regs argument (unknown code may)
    clobbers: set[str] | None        # call-clobbered registers it writes (None: unknown)


def _handler_code(s: Session, hobjs) -> dict[str, HandlerCode]:
    """Every handler the spec names, its object code read once."""
    abi = s.arch.handler_abi
    funcs = link.object_functions(hobjs)
    out = {}
    for name, sym in (s.handler_symbols or {}).items():
        fn = funcs.get(sym)
        if fn is None:
            out[name] = HandlerCode(True, None)
        else:
            off, body = fn
            out[name] = HandlerCode(abi.may_use_regs(body, off, off + len(body)), abi.clobbered_scratch(body, off))
    return out


def _choose_entry(s: Session, site, code: dict[str, HandlerCode]) -> None:
    """Clean call where no handler of the site can read its pt_regs argument
    (handler_abi reads their compiled code).  The inlined template (dispatch in
    the detour) where the site has one probe and no post_handler.  A kretprobe's
    entry (pre_handler_kretprobe() reads regs->sp) is clean only as the
    template, which passes the slot itself, when its entry_handler is clean."""
    site.clean = True
    site.clobbers = set()
    for p in site.probes:
        if kret.is_entry(p):
            site.clean = False
        if s.traces and p.index in s.traces:      # the trace's pre_handler reads pt_regs
            site.clean = False
        for name in (p.spec.pre_handler, p.spec.post_handler):
            if not name:
                continue
            h = code[name]
            site.clean = site.clean and not h.reads_regs
            site.clobbers = None if h.clobbers is None or site.clobbers is None else site.clobbers | h.clobbers
    site.template = site.decision == OPTIMIZED and len(site.probes) == 1 and not site.with_post
    if site.template and kret.is_entry(site.probes[0]):
        eh = site.probes[0].kret.entry_handler
        h = code[eh] if eh else HandlerCode(False, set())
        site.clean = not h.reads_regs
        # The inlined entry (retprobe.kret_entry_body) uses these, and the entry_handler its own.
        site.clobbers = None if h.clobbers is None else h.clobbers | set(s.arch.retprobe.KRET_ENTRY_USES)


def _pre_handler_symbol(s: Session, p) -> str | None:
    """The link symbol the probe's pre_handler field holds: a trace event's generated
    pre_handler (which calls the user's, if any), else the user's."""
    if s.traces and p.index in s.traces:
        return f"kp_trace_pre_{p.index}"
    return s.handler_symbols[p.spec.pre_handler] if p.spec.pre_handler else None


def _detour(s: Session, site, at: int, sym: dict[str, int]) -> tuple[bytes, int, int]:
    em, opt = s.arch.emit, s.arch.optprobe
    if site.template:
        p = site.probes[0]
        if kret.is_entry(p):
            # rp->kp of a kretprobe: its pre_handler is pre_handler_kretprobe(), its hit
            # counter follows the kprobes' (struct kretprobe starts with its kprobe).
            j, nk = _kret_order(s)[id(p)], len(_probe_order(s))
            probe, k, handler = sym["kp_kretprobes"] + j * em.KRETPROBE_SIZE, nk + j, sym["kp_pre_handler_kretprobe"]
        else:
            k = _probe_order(s)[id(p)]
            probe = sym["kp_probes"] + k * em.KPROBE_SIZE
            h = _pre_handler_symbol(s, p)
            handler = sym[h] if h else None
        common = dict(fast=sym["kp_fast"], table=sym["kp_thread_table"], probe=probe, probe_index=k,
                      handler=handler, aligned=opt.stack_aligned_at(s.image, p.func, site.addr),
                      copy=kret.site_copy(s, site, at, sym))
        if site.clean:
            kret_entry = kret.is_entry(p)
            callback, body = sym["kp_optimized_clean_callback"], None
            if kret_entry:
                callback = sym["kp_kretprobe_enter_clean_slow"]
                body = _kret_entry_body(s, p, probe, sym, common["aligned"], regs=False)
            code, resume = em.clean_detour(site.index, site.dcr, at, callback=callback,
                                           flags_live=not opt.arith_flags_dead(s.image, p.func, site.addr),
                                           handler_clobbers=site.clobbers, body=body, **common)
        else:
            # full_detour realigns the stack itself before the body.
            body = _kret_entry_body(s, p, probe, sym, True, regs=True) if kret.is_entry(p) else None
            code, resume = em.full_detour(site.index, site.dcr, at, callback=sym["kp_optimized_callback"],
                                          resume_regs=sym["kp_optprobe_resume_regs"], body=body, **common)
        return code, resume, resume
    entries = ("kp_optprobe_clean_entry", "kp_optprobe_clean_post_entry") if site.clean else \
              ("kp_optprobe_entry", "kp_optprobe_post_entry")
    # A DCR holding a return-probed function's exit embeds its return hook.
    return em.detour(site.index, site.dcr, site.with_post, at, sym[entries[0]], sym[entries[1]],
                     kret.site_copy(s, site, at, sym))


def _kret_entry_body(s: Session, p, rp: int, sym, aligned: bool, regs: bool):
    """pre_handler_kretprobe() inlined in the entry template (retprobe.kret_entry_body)."""
    eh = p.kret.entry_handler
    return s.arch.retprobe.kret_entry_body(
        rp=rp, tramp=sym["kp_kretprobe_trampoline"], entry_handler=sym[s.handler_symbols[eh]] if eh else None,
        enter_c=sym["kp_kretprobe_enter"], aligned=aligned, inline=p.group.mode == kret.OPTIMIZED,
        regs=regs)


def _kret_order(s: Session) -> dict[int, int]:
    """Position of each kretprobe's entry probe in kp_kretprobes[]."""
    if s.kret_order is None:
        s.kret_order = {id(p): j for j, (_, p, _) in enumerate(kret.placed(s))}
    return s.kret_order


def _probe_order(s: Session) -> dict[int, int]:
    """Position of each placed probe in kp_probes[] (spec order)."""
    if s.probe_order is None:
        placed = sorted((p for site in s.plan.sites for p in site.probes if not kret.is_entry(p)),
                        key=lambda p: p.index)
        s.probe_order = {id(p): i for i, p in enumerate(placed)}
    return s.probe_order


def metadata(s: Session) -> bytes:
    probes = []
    for site in s.plan.sites:
        for p in site.probes:
            if kret.is_entry(p):
                continue
            probes.append({"index": p.index, "addr": p.addr, "kind": "k", "symbol": p.symbol, "offset": p.offset,
                           "name": p.event_name, "optimized": site.decision == OPTIMIZED, "disabled": p.spec.disabled,
                           "detour": site.detour, "region": [site.addr, site.region_end]})
            if site.decision == OPTIMIZED:
                probes[-1].update({"call": "clean" if site.clean else "pt_regs", "inline_dispatch": site.template})
            if site.decision == INT3:
                probes[-1].update({"int3": site.xol.mode, "reason": str(site.reason)})
    probes += kret.metadata(s)
    probes.sort(key=lambda d: d["index"])
    doc = {"format": "kprewrite-1", "input": s.image.label, "probes": probes}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def instrument(input_path: str, spec_path: str, output: str, no_optimize: bool = False) -> Session:
    s = prepare(input_path, spec_path, no_optimize)
    keep = os.environ.get("KPREWRITE_KEEP")   # debugging: keep the linked runtime (gdb add-symbol-file)
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        data = emit(s, Path(keep))
    else:
        with tempfile.TemporaryDirectory(prefix="kprewrite-") as d:
            data = emit(s, Path(d))
    writer.write_atomically(output, data, input_path)
    return s


def read_metadata(path: str) -> dict:
    from elftools.elf.elffile import ELFFile
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"\x7fELF":
                raise KprewriteError(f"{path}: not an ELF file")
            f.seek(0)
            sec = ELFFile(f).get_section_by_name(META_SECTION)
            if sec is None:
                raise KprewriteError(f"{path}: not rewritten by kprewrite (no {META_SECTION} section)")
            return json.loads(sec.data())
    except OSError as e:
        raise KprewriteError(f"{path}: cannot read: {e.strerror}")
    except (ValueError, KeyError):
        raise KprewriteError(f"{path}: malformed {META_SECTION} section or ELF file")


def list_lines(path: str) -> list[str]:
    """debugfs kprobes/list: ADDRESS  k|r  SYMBOL+0xOFF  [DISABLED] [OPTIMIZED] [FTRACE]."""
    out = []
    for p in read_metadata(path)["probes"]:
        flags = (" [DISABLED]" if p["disabled"] else "") + (" [OPTIMIZED]" if p["optimized"] else "")
        flags += {"emulate": " [EMULATED]", "boost": " [BOOSTED]", "single-step": " [SINGLESTEP]"}.get(p.get("int3"), "")
        out.append(f"{p['addr']:016x}  {p['kind']}  {p['symbol']}+{p['offset']:#x}{flags}")
    return out


def blacklist_lines(path: str) -> list[str]:
    image = Image(path)
    return [f"{e.start:#x}-{e.end:#x}  {e.symbol}  {e.reason}" for e in bl.compute(image)]
