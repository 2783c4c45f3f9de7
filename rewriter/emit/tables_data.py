"""The probe table's per-probe arrays as assembler data: kp_probes[], kp_sites[],
kp_site_probes[] and kp_site_handlers[] for a target whose tables are the
runtime's structs at link-time addresses (not TABLES_AT_BOOT: a process's; the
runtime adds the load bias).  What the kernel fills in at register_kprobe()
time, written as .quad/.long directives rather than C initializers: the compiler
took 0.25 s over libpython's 6,100 probes, the assembler takes 0.03 s.

The layouts below are the runtime's (runtime/include/kprewrite/kprobes.h,
runtime/kp_internal.h; LP64, little-endian: x86-64 and AArch64 alike); the C
part of the table checks each against the headers (asserts()), so a field
added or moved there fails the build rather than shifting the values."""
from __future__ import annotations

from .cstring import c_string
from ..probes.resolve import is_entry

# struct kprobe's fields as kprobe_data() writes them: (name, offset) in order, and its size.
KPROBE_FIELDS = (("addr", 0), ("symbol_name", 8), ("offset", 16), ("pre_handler", 24), ("post_handler", 32),
                 ("nmissed", 40), ("flags", 48), ("name", 56), ("index", 64), ("site", 68))
KPROBE_SIZE = 72
# struct kp_site: addr, post_ip, resume, resume_post, then first and count.
KP_SITE_FIELDS = (("addr", 0), ("post_ip", 8), ("resume", 16), ("resume_post", 24), ("first", 32), ("count", 36))
KP_SITE_SIZE = 40
KP_HANDLER_REC_SIZE = 16    # struct kp_handler_rec: { pre, post }
# KPROBE_FLAG_* (kprobes.h), by the names emit/tables.py gives them.
KPROBE_FLAGS = {"KPROBE_FLAG_DISABLED": 2, "KPROBE_FLAG_OPTIMIZED": 4, "KPROBE_FLAG_FTRACE": 8}


def asserts() -> list[str]:
    """C the table's C part compiles: each layout above as the headers have it."""
    off = "__builtin_offsetof"
    return [
        "_Static_assert(" + " && ".join(f"{off}(struct kprobe, {name}) == {at}" for name, at in KPROBE_FIELDS)
        + f" && sizeof(struct kprobe) == {KPROBE_SIZE}, \"tables_data.KPROBE_FIELDS is not struct kprobe\");",
        "_Static_assert(" + " && ".join(f"{off}(struct kp_site, {name}) == {at}" for name, at in KP_SITE_FIELDS)
        + f" && sizeof(struct kp_site) == {KP_SITE_SIZE} && sizeof(struct kp_handler_rec) == {KP_HANDLER_REC_SIZE} "
        f"&& {off}(struct kp_handler_rec, post) == 8, \"tables_data's kp_site or kp_handler_rec is out of date\");",
        "_Static_assert(" + " && ".join(f"{name} == {value}" for name, value in KPROBE_FLAGS.items())
        + ", \"tables_data.KPROBE_FLAGS is out of date\");",
    ]


def _strings_asm(label: dict[str, str]) -> list[str]:
    """The strings the arrays point at (label: string -> its local label, in first-use
    order), each once, in a mergeable string section (as the compiler puts C string
    literals); c_string()'s escapes (\\" \\\\ \\ooo) are the assembler's too."""
    return ['\t.section .rodata.str1.1,"aMS",%progbits,1'] + [f"{name}:\n\t.string {c_string(s)}"
                                                               for s, name in label.items()]


def _array(name: str, section: str, align: int, size: int, body: list[str]) -> list[str]:
    """A global (hidden: -fvisibility=hidden, as the C is compiled) array of `size`
    bytes; an empty one is a zeroed element, as `T name[max(1, n)]` in C."""
    return [f"\t.section {section}", f"\t.balign {align}", f"\t.globl {name}", f"\t.hidden {name}",
            f"\t.type {name}, %object", f"\t.size {name}, {size}", f"{name}:", *body]


def structs(plan, lay, fields: dict, kretprobe_size: int) -> str:
    """The arrays' assembly.  fields: each kprobe's fields by id (tables._probe_fields():
    pre and post as link symbols or None, flags as KPROBE_FLAGS names, symbol);
    kretprobe_size: sizeof(struct kretprobe), for kp_site_probes[]' pointers into
    kp_kretprobes[] (defined in the C part).  Numbers in decimal, each string's label
    looked up inline: this runs before the assembler can start."""
    label: dict[str, str] = {}

    def string(s: str | None) -> str:
        if s is None:
            return "0"
        got = label.get(s)
        if got is None:
            got = label[s] = f".Lkp_str{len(label)}"
        return got

    probes = []
    for site, p in plan.kprobes:
        f = fields[id(p)]
        flags = sum(map(KPROBE_FLAGS.__getitem__, f["flags"]))
        probes.append(f"\t.quad {p.addr},{string(f['symbol'])}\n\t.long {p.offset},0\n"
                      f"\t.quad {f['pre'] or 0},{f['post'] or 0},0\n\t.long {flags},0\n"
                      f"\t.quad {string(p.event_name)}\n\t.long {p.slot},{site.index}")
    sites, first = [], 0
    for site in plan.sites:
        a = lay.site(site)
        n = len(site.probes)
        sites.append(f"\t.quad {site.addr},{site.post_ip},{a.resume},{a.resume_post}\n\t.long {first},{n}")
        first += n
    refs, handlers = [], []
    for site in plan.sites:
        for p in site.probes:
            if is_entry(p):         # a kretprobe's entry probe: its struct kretprobe's kp
                refs.append(f"\t.quad kp_kretprobes+{p.slot * kretprobe_size}")
                # A light kretprobe's entry only counts (planner.forms.light_kretprobes()).
                handlers.append("\t.quad 0,0" if p.group.light else "\t.quad kp_pre_handler_kretprobe,0")
            else:
                refs.append(f"\t.quad kp_probes+{p.slot * KPROBE_SIZE}")
                f = fields[id(p)]
                handlers.append(f"\t.quad {f['pre'] or 0},{f['post'] or 0}")
    nk, ns, nr = len(probes), len(sites), len(refs)
    out = [*_array("kp_probes", '.data.rel.local,"aw"', 32, max(1, nk) * KPROBE_SIZE,
                   probes or [f"\t.zero {KPROBE_SIZE}"]),
           # Written only by the runtime's relocation, then read-only (link.RELRO): so are
           # the two below, which hold pointers the relocation adjusts.
           *_array("kp_sites", '.data..ro_after_init,"aw"', 32, max(1, ns) * KP_SITE_SIZE,
                   sites or [f"\t.zero {KP_SITE_SIZE}"]),
           *_array("kp_site_probes", '.data.rel.ro.local,"aw"', 32, max(1, nr) * 8, refs or ["\t.quad 0"]),
           *_array("kp_site_handlers", '.data.rel.ro.local,"aw"', 32, max(1, nr) * KP_HANDLER_REC_SIZE,
                   handlers or ["\t.quad 0,0"]),
           *_strings_asm(label),
           '\t.section .note.GNU-stack,"",%progbits']
    return "\n".join(out) + "\n"
