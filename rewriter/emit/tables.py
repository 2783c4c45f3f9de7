"""The generated tables, from the finished plan and its layout: struct kprobe per
kprobe (kp_probes[]), struct kretprobe per kretprobe (kp_kretprobes[]), one
kp_site per address with its probes (the aggregator's list), the arch's
breakpoint-site descriptors, the target's own tables, the trace events' fetch
programs.  What the kernel builds at register_kprobe() time, built at rewrite
time and linked with the runtime: C, but for a process's per-probe arrays,
which emit/tables_data.py writes as assembler data (a kernel's are records its
runtime builds the structs from at boot)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..probes import events as ev_mod
from ..probes import fetch as fetch_mod
from . import breakpoints, tables_data
from .emission import KRET_HOOKED_MUL, Code, evicted_ips, kret_hooked_bits, pre_handler_symbol, region_ips
from ..probes.events import trace_key
from .cstring import c_string
from ..planner import FTRACE, BREAKPOINT, OPTIMIZED, TRAMPOLINE
from ..probes.resolve import event_symbol, is_entry
from ..errors import KprewriteError

KRET_MODE = {OPTIMIZED: 0, TRAMPOLINE: 1}     # KP_KRET_OPTIMIZED / KP_KRET_TRAMPOLINE
DECISION_FLAG = {OPTIMIZED: "KPROBE_FLAG_OPTIMIZED", FTRACE: "KPROBE_FLAG_FTRACE"}


@dataclass(frozen=True)
class TableSource:
    """The probe table's sources: C, and the per-probe arrays as assembly
    (emit/tables_data.py; "" for a target whose tables are records built at boot)."""
    c: str
    asm: str


def generate(c: Code, lay, target, traces: dict) -> TableSource:
    """The probe table's sources: what the plan placed, at the addresses lay
    (layout.Layout) gave it."""
    plan, link_sym = c.plan, c.handler_symbol
    # An address in the image, as C: a number, or for a target whose image moves at
    # boot (a kernel's KASLR) an expression the linker relocates.
    A = functools.partial(target.address_c, c.image)
    out = ['#include "kp_internal.h"']
    for name in sorted(set(link_sym.values())):
        out.append(f"extern char {name}[];")
    # Hit counters per thread (or CPU): kprobes, then kretprobes.
    out.append(f"#define KP_NHITS {len(plan.kprobes) + len(plan.kretprobes)}")
    # The counters of light sites (emit.light_detour), KP_LIGHT_INDEX(slot, shard);
    # summed into the profile.  None (and no pointer to relocate) in an image
    # without light sites: a kernel's.
    nhits = len(plan.kprobes) + len(plan.kretprobes)
    if any(s.light for s in plan.sites):
        out.append(f"unsigned long kp_light_hits[KP_LIGHT_INDEX({nhits - 1}UL, KP_LIGHT_SHARDS - 1) + 1] "
                   "__attribute__((aligned(4096)));")
        out.append("unsigned long *kp_light_base = kp_light_hits;")
        out.append(f"const unsigned int kp_nlight_hits = {nhits};")
    else:
        out.append("unsigned long kp_light_hits[1];\nunsigned long *kp_light_base;")
        out.append("const unsigned int kp_nlight_hits = 0;")
    # Where the runtime rewrites light detours at start-up for the CPU it runs on (the
    # arch's alternatives: AArch64's LSE increment, emit.light_alternatives_c()); an arch
    # without them (x86-64) gets no table.
    alternatives = getattr(c.arch.emit, "light_alternatives_c", None)
    light = [(lay.site(s).detour, s.red_zone) for s in plan.sites if s.light] if alternatives else []
    if light:
        out.append(alternatives(c.image, light, A))
    data = ""
    if getattr(target, "TABLES_AT_BOOT", False):
        out += _records_c(c, lay, target, traces)
    else:
        structs, data = _structs(c, lay, target, traces)
        out += structs
    # Shared detours (planner.sites.share_regions()): where an address under a region's jump runs.
    ips = sorted([pair for site in plan.sites if site.decision == OPTIMIZED for pair in region_ips(c, lay, site)]
                 + [pair for site in plan.sites if site.evicted is not None for pair in evicted_ips(c, lay, site.evicted)])
    out.append(f"const struct kp_region_ip kp_region_ips[{max(1, len(ips))}] = {{")
    out += [f"  {{ {a:#x}UL, {b:#x}UL }}," for a, b in ips]
    out.append("};")
    out.append(f"const unsigned int kp_nregion_ips = {len(ips)};")
    # Read-only once the runtime runs (link.RELRO: once relocated; a kernel: from mark_rodata_ro()).
    if not getattr(target, "TABLES_AT_BOOT", False):     # else among the records (_kret_records_c())
        out.append(_kretprobes_c(c, traces, A, True))
    out.append(_kret_hooked_c(plan.hooked_entries))
    out.append(breakpoints.table_c(plan.sites, lay.xol, c.arch.kprobe_xol, True))
    out.append(target.tables_c(c.image, c.arch, any(site.decision == BREAKPOINT for site in plan.sites)))
    out.append("unsigned long kp_link_anchor_addr = (unsigned long)&kp_link_anchor;")
    out += _layout_asserts(c.arch.emit)
    if traces:
        users = {trace_key(p): link_sym[p.spec.pre_handler] for _, p in plan.kprobes if p.spec.pre_handler}
        users.update({trace_key(p): link_sym[p.kret.handler] for _, p, _ in plan.kretprobes if p.kret.handler})
        symtab = [] if target.RUNTIME_KALLSYMS else fetch_mod.symbol_table(c.image)
        out += ev_mod.trace_c(traces, users, symtab).splitlines()
    else:
        out += ev_mod.trace_c({}, {}, []).splitlines()
    return TableSource("\n".join(out) + "\n", data)


def _probe_fields(c: Code, site, p, traces: dict, decl: list[str]) -> dict:
    """One kprobe's struct kprobe fields: pre and post as link symbols (None: no
    handler), flags as KPROBE_FLAG_* names, symbol (decl gets the prototypes a trace
    event's generated pre_handler needs in C)."""
    flags = [DECISION_FLAG[site.decision]] if site.decision in DECISION_FLAG else []
    if p.spec.disabled:
        flags.append("KPROBE_FLAG_DISABLED")
    pre = pre_handler_symbol(c, p)
    if trace_key(p) in traces:      # trace event: its pre_handler runs the fetch
        decl.append(f"int {pre}(struct kprobe *, struct pt_regs *);")
    post = c.handler_symbol[p.spec.post_handler] if p.spec.post_handler else None
    return dict(pre=pre, post=post, flags=flags, symbol=p.symbol if (p.spec.symbol_name or p.func) else None)


def _handlers_c(f: dict) -> tuple[str, str]:
    """A kprobe's (pre_handler, post_handler) as C initializers (f: _probe_fields())."""
    return (f"(kprobe_pre_handler_t){f['pre']}" if f["pre"] else "0",
            f"(kprobe_post_handler_t){f['post']}" if f["post"] else "0")


def _kprobe_c(site, p, f: dict, A) -> str:
    """One struct kprobe initializer (f: _probe_fields()), its fields in declaration
    order (tables_data.KPROBE_FIELDS, which the compiler checks): positional, as a
    table of thousands of probes compiles a quarter faster than with designators."""
    pre, post = _handlers_c(f)
    return (f"  {{ (kprobe_opcode_t *){A(p.addr)}, {c_string(f['symbol'])}, {p.offset}, {pre}, {post}, 0, "
            f"{'|'.join(f['flags']) or '0'}, {c_string(p.event_name)}, {p.slot}, {site.index} }},")


def _site_c(site, a, first: int, count: int, A) -> str:
    """One struct kp_site initializer (a: its layout.SiteAddrs): its probes are
    kp_site_probes[first..first + count)."""
    return f"  {{ {A(site.addr)}, {A(site.post_ip)}, {A(a.resume)}, {A(a.resume_post)}, {first}, {count} }},"


def _structs(c: Code, lay, target, traces: dict) -> tuple[list[str], str]:
    """kp_probes[], kp_sites[], kp_site_probes[] and kp_site_handlers[] as the runtime
    reads them: (the C part: their counts and the prototypes the data names, the
    arrays' assembly: tables_data.structs())."""
    plan = c.plan
    decl, fields = [], {}
    for site, p in plan.kprobes:
        fields[id(p)] = _probe_fields(c, site, p, traces, decl)
    out = [f"const unsigned int kp_nprobes = {len(plan.kprobes)};",
           f"const unsigned int kp_nsites = {len(plan.sites)};"]
    return decl + out, tables_data.structs(plan, lay, fields, c.arch.emit.KRETPROBE_SIZE)


def _records_c(c: Code, lay, target, traces: dict) -> list[str]:
    """The same tables as compact records, for a target that builds them at boot
    (TABLES_AT_BOOT: a kernel, whose gaps could not hold every probe's structures):
    addresses as 32-bit offsets from the target's table base (no relocation: KASLR
    moves base and all), handlers as an index into a small table of pairs, a symbol
    name left out where the image's own symbol table gives it at the probed address
    (target.derived_symbol()), an event name left out where it is the kernel's
    default p_SYMBOL_OFFSET.  The runtime's own probes (boot hooks) are also written
    in full: they run before the tables are built."""
    plan, image = c.plan, c.image
    base = target.table_base(image)
    off = lambda a: (a - base) & 0xFFFFFFFF if a else 0  # noqa: E731  (no address: 0)
    out, decl, string_at, handlers, handler_at = [], [], {}, [], {}
    strings_size = 0

    def string(s: str) -> int:
        """1 + the string's offset in kp_rec_strings (each written once, in first-use order)."""
        nonlocal strings_size
        if s not in string_at:
            string_at[s] = 1 + strings_size
            strings_size += len(s.encode()) + 1
        return string_at[s]

    def derived_name(p, sym: str | None, kind: str) -> tuple[str, str]:
        """A record's symbol and name fields: left out (KP_REC_DERIVED) where the running
        kernel's kallsyms gives the symbol and the name is the default KIND_SYMBOL_OFFSET."""
        derived = sym is not None and target.derived_symbol(image, p.addr - p.offset) == sym
        symbol = "KP_REC_NONE" if sym is None else "KP_REC_DERIVED" if derived else str(string(sym))
        default = derived and p.event_name == f"{kind}_{event_symbol(sym)}_{p.offset}"
        return symbol, "KP_REC_DERIVED" if default else str(string(p.event_name))

    early_sites, fields = [], {}    # the sites of the runtime's own probes; each kprobe's fields
    # Not const: the probe records go with the data, in the rodata/data gap (the code gap
    # holds the detours), read-only from mark_rodata_ro() on (RO_AFTER_INIT, link.RELRO).
    out.append(f"struct kp_probe_rec kp_probe_recs[{max(1, len(plan.kprobes))}]{RO_AFTER_INIT} = {{")
    for site, p in plan.kprobes:
        f = _probe_fields(c, site, p, traces, decl)
        pair = _handlers_c(f)
        if pair not in handler_at:
            handler_at[pair] = len(handlers)
            handlers.append(pair)
        symbol, name = derived_name(p, f["symbol"], "p")
        out.append(f"  {{ {p.offset}, {symbol}, {name}, {site.index}, {handler_at[pair]}, {'|'.join(f['flags']) or '0'} }},")
        fields[id(p)] = f
        if p.spec.pre_handler in target.RUNTIME_HANDLERS and site.index not in early_sites:
            early_sites.append(site.index)
    out.append("};")
    out.append(f"const unsigned int kp_nprobes = {len(plan.kprobes)};")
    out += _kret_records_c(c, traces, target, string, derived_name)
    # Const: rodata, in the code gap, where the short stubs left room (with a probe on every
    # function the data gap could not hold them beside the probe records), unless the
    # detours leave too little there (a kretprobe on every function: its return detours),
    # then with the data, read-only from mark_rodata_ro() on (.data.rel.ro, in link.RELRO).
    room = target.code_room(image, lay)
    need = SITE_REC_SIZE * len(plan.sites) + 4 * sum(len(site.probes) for site in plan.sites) + RUNTIME_CODE_ROOM
    where = "" if room is None or need <= room else ' __attribute__((section(".data.rel.ro.kp_site_recs")))'
    out.append(f"const struct kp_site_rec kp_site_recs[{max(1, len(plan.sites))}]{where} = {{")
    for site in plan.sites:
        a = lay.site(site)
        out.append(f"  {{ {off(site.addr):#x}, {off(a.resume):#x}, {off(a.resume_post):#x}, "
                   f"{site.post_ip - site.addr}, {len(site.probes)} }},")
    out.append("};")
    out.append(f"const unsigned int kp_nsites = {len(plan.sites)};")
    refs = ", ".join(f"KP_REC_KRET | {p.slot}" if is_entry(p) else str(p.slot)
                     for site in plan.sites for p in site.probes) or "0"
    out.append(f"const unsigned int kp_site_probe_recs[] = {{ {refs} }};")
    out.append(f"const unsigned int kp_nsite_probes = {sum(len(site.probes) for site in plan.sites)};")
    out.append("const struct kp_handler_rec kp_rec_handlers[] = {"
               + ", ".join(f"{{ {pre}, {post} }}" for pre, post in handlers) + (" " if handlers else "{ 0, 0 } ") + "};")
    out.append("const char kp_rec_strings[] = " + (" ".join(c_string(s + "\0") for s in string_at) or '""') + ";")
    # The runtime's own probes, and every kprobe sharing their sites, whole, until the
    # tables are built (a kretprobe's entry there waits for the tables).
    by_index = {site.index: site for site in plan.sites}
    groups = [(by_index[i], [q for q in by_index[i].probes if not is_entry(q)]) for i in early_sites]
    early = [(site, q) for site, qs in groups for q in qs]
    A = functools.partial(target.address_c, image)
    out.append(f"struct kprobe kp_early_probes[{max(1, len(early))}] = {{")
    out += [_kprobe_c(site, q, fields[id(q)], A) for site, q in early]
    out.append("};")
    out.append(f"struct kprobe *const kp_early_site_probes[{max(1, len(early))}] = {{ "
               + (", ".join(f"&kp_early_probes[{i}]" for i in range(len(early))) or "0") + " };")
    out.append(f"const struct kp_handler_rec kp_early_site_handlers[{max(1, len(early))}] = {{ "
               + (", ".join("{{ {}, {} }}".format(*_handlers_c(fields[id(q)])) for _, q in early) or "{ 0, 0 }")
               + " };")
    out.append(f"struct kp_site kp_early_sites[{max(1, len(groups))}]{RO_AFTER_INIT} = {{")
    first = 0
    for site, qs in groups:
        out.append(_site_c(site, lay.site(site), first, len(qs), A))
        first += len(qs)
    out.append("};")
    out.append(f"const unsigned int kp_early_site_index[{max(1, len(groups))}] = {{ "
               + (", ".join(str(site.index) for site, _ in groups) or "0") + " };")
    out.append(f"const unsigned int kp_nearly_sites = {len(groups)}, kp_nearly_probes = {len(early)};")
    out.append(f"struct kprobe *kp_probes{RO_AFTER_INIT};\nstruct kp_site *kp_sites{RO_AFTER_INIT};\n"
               f"struct kprobe *const *kp_site_probes{RO_AFTER_INIT} = kp_early_site_probes;\n"
               f"const struct kp_handler_rec *kp_site_handlers{RO_AFTER_INIT} = kp_early_site_handlers;\n"
               f"volatile int kp_tables_built{RO_AFTER_INIT};")
    return decl + out


RO_AFTER_INIT = ' __attribute__((section(".data..ro_after_init")))'
SITE_REC_SIZE = 16          # struct kp_site_rec
# What the runtime's own code and rodata take in the code gap beside the records, with
# room to spare (some 60 KiB in Debian's 6.1 kernel): where the site records go.
RUNTIME_CODE_ROOM = 128 << 10


def _kret_records_c(c: Code, traces: dict, target, string, derived_name) -> list[str]:
    """The kretprobes as records (TABLES_AT_BOOT; struct kp_kret_rec, 16 bytes each, in
    .data..ro_after_init), their struct kretprobe built at boot: the site gives the
    address, the kind (kp_kret_kinds[], const) what the spec's entry shares with others
    (the handlers, maxactive, data_size, offset), the flags kp.flags and the return's way.
    string, derived_name: _records_c()'s."""
    plan = c.plan
    decl, kinds, kind_at, recs = [], [], {}, []
    for site, p, g in plan.kretprobes:
        k = p.kret
        if p.addr != site.addr:
            raise KprewriteError(f"internal error: kretprobe {p.event_name} at {p.addr:#x}, its site at {site.addr:#x}")
        h = f"(kretprobe_handler_t){c.handler_symbol[k.handler]}" if k.handler else "0"
        if trace_key(p) in traces:     # fetch / r event: the trace handler calls k.handler
            h = f"kp_trace_ret_{trace_key(p)}"
            decl.append(f"int {h}(struct kretprobe_instance *, struct pt_regs *);")
        eh = f"(kretprobe_handler_t){c.handler_symbol[k.entry_handler]}" if k.entry_handler else "0"
        kind = (h, eh, k.maxactive, p.offset, k.data_size)
        if kind not in kind_at:
            kind_at[kind] = len(kinds)
            kinds.append(kind)
        flags = ["KPROBE_FLAG_OPTIMIZED"] + (["KPROBE_FLAG_DISABLED"] if k.disabled else [])
        flags += ["KP_KRET_REC_TRAMPOLINE"] if KRET_MODE[g.mode] else []
        flags += ["KP_KRET_REC_RET_CLEAN"] if p.ret_clean else []
        symbol, name = derived_name(p, p.symbol if (k.symbol_name or p.func) else None, "r")
        recs.append(f"  {{ {symbol}, {name}, {site.index}, {kind_at[kind]}, {'|'.join(flags)} }},")
    if len(kinds) > 0xFFFF:
        raise KprewriteError(f"{c.image.path}: {len(kinds)} kretprobes with handlers, maxactive, data_size or "
                             "offset of their own: a kernel's records hold 65,535")
    out = decl + [f"struct kp_kret_rec kp_kret_recs[{max(1, len(recs))}]{RO_AFTER_INIT} = {{", *recs, "};",
                  f"const unsigned int kp_nkretprobes = {len(recs)};",
                  "const struct kp_kret_kind kp_kret_kinds[] = {"
                  + ", ".join(f"{{ {h}, {eh}, {m}, {o}, {d} }}" for h, eh, m, o, d in kinds)
                  + (" " if kinds else "{ 0, 0, 0, 0, 0 } ") + "};",
                  f"struct kretprobe *kp_kretprobes{RO_AFTER_INIT};",
                  f"const struct kp_kret_handler_rec *kp_kret_handler_table{RO_AFTER_INIT};"]
    return out


def _kretprobes_c(c: Code, traces: dict, A=lambda a: f"{a:#x}UL", ro_handlers: bool = False) -> str:
    """struct kretprobe per placed kretprobe; rp->kp's hit slot follows the kprobes'.
    ro_handlers: and kp_kret_handlers[], the {handler, entry_handler} the runtime calls
    (read-only once relocated), by position."""
    link_sym, nk = c.handler_symbol, len(c.plan.kprobes)
    out = ["int kp_pre_handler_kretprobe(struct kprobe *, struct pt_regs *);",
           f"struct kretprobe kp_kretprobes[{max(1, len(c.plan.kretprobes))}] = {{"]
    recs = []
    for site, p, g in c.plan.kretprobes:
        k = p.kret
        flags = ["KPROBE_FLAG_OPTIMIZED"] + (["KPROBE_FLAG_DISABLED"] if k.disabled else [])
        h = f"(kretprobe_handler_t){link_sym[k.handler]}" if k.handler else "0"
        if trace_key(p) in traces:     # fetch / r event: the trace handler calls k.handler
            h = f"kp_trace_ret_{trace_key(p)}"
            out.insert(0, f"int {h}(struct kretprobe_instance *, struct pt_regs *);")
        eh = f"(kretprobe_handler_t){link_sym[k.entry_handler]}" if k.entry_handler else "0"
        recs.append(f"{{ {h}, {eh} }}")
        sym = c_string(p.symbol if (k.symbol_name or p.func) else None)
        out.append(f"  {{ .kp = {{ .addr = (kprobe_opcode_t *){A(p.addr)}, .symbol_name = {sym}, .offset = {p.offset}, "
                   f".pre_handler = kp_pre_handler_kretprobe, .flags = {'|'.join(flags)}, "
                   f".name = {c_string(p.event_name)}, .index = {nk + p.slot}, .site = {site.index} }}, "
                   f".handler = {h}, .entry_handler = {eh}, .maxactive = {k.maxactive}, .data_size = {k.data_size}, "
                   f".kp_mode = {KRET_MODE[g.mode]}, .kp_ret_clean = {int(p.ret_clean)} }},")
    out.append("};")
    out.append(f"const unsigned int kp_nkretprobes = {len(c.plan.kretprobes)};")
    if ro_handlers:
        out.append(f"const struct kp_kret_handler_rec kp_kret_handlers[] = {{ {', '.join(recs) or '{ 0, 0 }'} }};")
    return "\n".join(out) + "\n"


def _kret_hooked_c(entries: list[int]) -> str:
    """kp_kret_hooked[]: the entries whose returns are all hooked, as link-time
    addresses in an open-addressing hash table (linear probing, 0 empty, at
    most half full) that kp_kretprobe_tail_pointer() reads: a tail call through
    a pointer to one of them leaves the instances pending."""
    bits = kret_hooked_bits(len(entries))
    table = [0] * (1 << bits)
    for a in entries:
        h = ((a * KRET_HOOKED_MUL) & (1 << 64) - 1) >> (64 - bits)
        while table[h]:
            h = (h + 1) & (len(table) - 1)
        table[h] = a
    rows = ", ".join(f"{a:#x}UL" for a in table)
    return (f"const unsigned long kp_kret_hooked[{len(table)}] = {{ {rows} }};\n"
            f"const unsigned int kp_kret_hooked_bits = {bits};\n")


def _layout_asserts(em) -> list[str]:
    """The struct layouts the emitted templates read directly, checked by the compiler."""
    off = "__builtin_offsetof"
    return [
        f"_Static_assert(sizeof(struct kprobe) == {em.KPROBE_SIZE} && "
        f"__builtin_offsetof(struct kprobe, flags) == {em.KPROBE_FLAGS} && "
        f"sizeof(struct kretprobe) == {em.KRETPROBE_SIZE} && __builtin_offsetof(struct kretprobe, kp) == 0 && "
        f"__builtin_offsetof(struct kp_thread, active) == {em.THREAD_ACTIVE} && "
        f"__builtin_offsetof(struct kp_thread, hits) == {em.THREAD_HITS} && "
        f"KP_TABLE_MASK == {em.THREAD_TABLE_MASK} && KP_HASH(1UL << 12) == 1 && KP_HASH(0xfffUL) == 0 && "
        f"KP_LIGHT_INDEX(1000UL, 5UL) * 8 == {em.light_counter(1000)} + 5 * 4096, "
        f"\"kprewrite's clean-call template is out of date\");",
        f"_Static_assert({off}(struct kp_thread, kret) == {em.THREAD_KRET} && "
        f"{off}(struct kp_kret_thread, depth) == {em.KRET_DEPTH} && "
        f"{off}(struct kp_kret_thread, tail_slot) == {em.KRET_TAIL_SLOT} && "
        f"{off}(struct kp_kret_thread, stack) == {em.KRET_STACK} && "
        f"{off}(struct kretprobe, maxactive) == {em.RP_MAXACTIVE} && {off}(struct kretprobe, kp_stride) == {em.RP_STRIDE} && "
        f"{off}(struct kretprobe, kp_pool) == {em.RP_POOL} && {off}(struct kretprobe, kp_hint) == {em.RP_HINT} && "
        f"{off}(struct kretprobe_instance, rp) == {em.RI_RP} && {off}(struct kretprobe_instance, ret_addr) == {em.RI_RET_ADDR} && "
        f"{off}(struct kretprobe_instance, fp) == {em.RI_FP} && {off}(struct kretprobe_instance, kp_state) == {em.RI_STATE} && "
        f"{off}(struct kretprobe_instance, kp_flags) == {em.RI_FLAGS} && KP_RI_TRAMP == {em.RI_TRAMP}, "
        f"\"kprewrite's kretprobe templates are out of date\");",
    ] + tables_data.asserts()
