"""Every site a Linux x86-64 vmlinux patches at boot or reserves from kprobes: the generic
tables (../sites.py) and x86's own.

Read from the image's own tables.  In a final vmlinux many of them are merged into other
output sections (``__jump_table`` and ``.static_call_sites`` into ``.rodata``'s
ro-after-init part, ``__mcount_loc`` and ``_kprobe_blacklist`` into ``.init.data``);
each table is therefore found by the start/stop symbols the linker script defines
(through kallsyms or a System.map) and, failing those, by its section header.

Layouts, as in Linux 6.1 (checked against Debian 12's 6.1 cloud kernel, see
``verify_sites``):

=====================  ============================================================
table                  entry
=====================  ============================================================
.altinstructions       struct alt_instr, 12 bytes, packed: s32 instr_offset,
                       s32 repl_offset (both relative to the field), u16 cpuid,
                       u8 instrlen, u8 replacementlen (6.3+ has u32 ft_flags: 14)
.parainstructions      16 bytes: u8 *instr, u8 type, u8 len (struct
                       paravirt_patch_site), then the u16 clobber mask 6.1's
                       _paravirt_alt asm still emits (0x1, 0x1ff seen), padding
.retpoline_sites       s32 relative to the entry: a call/jmp/jcc to an
.return_sites          __x86_indirect_thunk_* (5 or 6 bytes, decoded), a
.call_sites            ``jmp __x86_return_thunk`` (5), a call (5, 6.2+),
.ibt_endbr_seal        an endbr64 (4, IBT kernels)
.smp_locks             s32 relative to the entry: a lock prefix (1 byte); 0 = padding
.static_call_sites     struct static_call_site: s32 addr, s32 key (both relative;
                       key's low 2 bits are TAIL|INIT flags); the site is 5 bytes
__jump_table           struct jump_entry: s32 code, s32 target, s64 key (all
                       relative; key's low 2 bits are flags); 2 or 5 bytes (checked)
__mcount_loc           u64 absolute address of a 5-byte ``call __fentry__``/nop5
__ex_table             struct exception_table_entry: s32 insn, s32 fixup, s32 data
                       (12 bytes); insn and fixup relative to their fields
__bug_table            struct bug_entry (GENERIC_BUG_RELATIVE_POINTERS,
                       DEBUG_BUGVERBOSE): s32 bug_addr_disp, s32 file_disp, u16 line,
                       u16 flags (12 bytes); the site is a 2-byte ud2
_kprobe_blacklist      unsigned long function addresses (NOKPROBE_SYMBOL)
=====================  ============================================================

Ranges: ``.noinstr.text``, ``.entry.text``, ``.kprobes.text`` and the static-call
trampolines (``.static_call.text``, rewritten at boot) by their start/end symbols, and
``__cfi_*``/``__pfx_*`` symbols by their kallsyms bounds.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from operator import attrgetter

from .. import sites as _generic
from ..elfview import ElfView
from ..sites import (BugEntry, ExEntry, McountLoc, Reserved, bug_table, cfi_symbols, ex_table,  # noqa: F401
                     functions_in, kprobe_blacklist, mcount_locs, offsets32, relative_sites, section_ranges)

# x86's tables: table name (its section's) -> (start symbol, end symbol), then the generic ones.
TABLES = {
    ".altinstructions": ("__alt_instructions", "__alt_instructions_end"),
    ".parainstructions": ("__parainstructions", "__parainstructions_end"),
    ".retpoline_sites": ("__retpoline_sites", "__retpoline_sites_end"),
    ".return_sites": ("__return_sites", "__return_sites_end"),
    ".call_sites": ("__call_sites", "__call_sites_end"),
    ".ibt_endbr_seal": ("__ibt_endbr_seal", "__ibt_endbr_seal_end"),
    ".smp_locks": ("__smp_locks", "__smp_locks_end"),
    ".static_call_sites": ("__start_static_call_sites", "__stop_static_call_sites"),
    **_generic.TABLES,
}

# Text ranges reserved whole, by their start/end symbols.
RANGES = {
    ".noinstr.text": ("__noinstr_text_start", "__noinstr_text_end"),
    ".entry.text": ("__entry_text_start", "__entry_text_end"),
    ".kprobes.text": ("__kprobes_text_start", "__kprobes_text_end"),
    ".static_call.text": ("__static_call_text_start", "__static_call_text_end"),
}
assert set(_generic.RANGES) <= set(RANGES)

NOP5 = bytes.fromhex("0f1f440000")
NOP2 = bytes.fromhex("6690")
ENDBR64 = bytes.fromhex("f30f1efa")
FTRACE_SITE = 5                     # an ftrace site: `call __fentry__` or a 5-byte nop
BUG_INSN = 2                        # a __bug_table site: ud2


class KernelImage(_generic.KernelImage):
    """An x86-64 vmlinux: the generic tables and x86's (arch_populate_kprobe_blacklist()
    adds .entry.text to the kprobe blacklist)."""
    TABLES = TABLES
    RANGES = RANGES
    BLACKLIST_RANGES = _generic.BLACKLIST_RANGES + (".entry.text",)


def _insn_len(code: bytes) -> int:
    """Length of a retpoline-site instruction: [cs] call/jmp rel32, jcc rel32, or decoded."""
    i = 1 if code[:1] == b"\x2e" else 0
    op = code[i:i + 1]
    if op in (b"\xe8", b"\xe9"):
        return i + 5
    if op == b"\x0f" and 0x80 <= code[i + 1] <= 0x8F:
        return i + 6
    if op == b"\xeb" or 0x70 <= code[i] <= 0x7F:
        return i + 2
    return _capstone_len(code)


_CS = None


def _capstone_len(code: bytes) -> int:
    global _CS
    if _CS is None:
        import capstone
        _CS = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    for insn in _CS.disasm(code, 0, 1):
        return insn.size
    return 1


# -- x86's tables ----------------------------------------------------------------------


@dataclass(frozen=True)
class AltEntry:
    site: int          # the original instruction(s)
    length: int        # instrlen
    replacement: int   # the replacement's address (in .altinstr_replacement)
    repl_length: int   # replacementlen (<= instrlen: the original is padded at build time)
    cpuid: int         # X86_FEATURE_* word*32+bit; bit 15 set: patch when the feature is absent
    entry: int


def alt_entries(k: KernelImage) -> list[AltEntry]:
    a, buf = k.table_bytes(".altinstructions", 12)
    out = []
    for i in range(0, len(buf), 12):
        instr, repl, cpuid, ilen, rlen = struct.unpack_from("<iiHBB", buf, i)
        out.append(AltEntry(a + i + instr, ilen, a + i + 4 + repl, rlen, cpuid, a + i))
    return out


def alternatives(k: KernelImage) -> list[Reserved]:
    out = []
    for e in alt_entries(k):
        feat = e.cpuid & 0x7FFF
        out.append(Reserved(e.site, e.site + max(e.length, 1), ".altinstructions",
                            f"feature {feat >> 5}*32+{feat & 31}{' (absent)' if e.cpuid & 0x8000 else ''} "
                            f"replacement {e.replacement:#x} len {e.repl_length}"))
    return out


def paravirt(k: KernelImage) -> list[Reserved]:
    a, buf = k.table_bytes(".parainstructions", 16)
    out = []
    for i in range(0, len(buf), 16):
        instr, typ, ln = struct.unpack_from("<QBB", buf, i)
        out.append(Reserved(instr, instr + max(ln, 1), ".parainstructions", f"type {typ}"))
    return out


def return_site_entries(k: KernelImage) -> dict[int, int]:
    """Each .return_sites site -> the address of its table entry (an s32 relative to the
    entry's own address, as apply_returns() reads it)."""
    a, buf = k.table_bytes(".return_sites", 4)
    return {a + 4 * i + d: a + 4 * i for i, (d,) in enumerate(offsets32(buf, 4)) if d}


def retpoline_sites(k: KernelImage) -> list[Reserved]:
    return relative_sites(k, ".retpoline_sites", lambda s: _insn_len(k.code(s, 16)))


def return_sites(k: KernelImage) -> list[Reserved]:
    return relative_sites(k, ".return_sites", lambda s: _insn_len(k.code(s, 16)))


def call_sites(k: KernelImage) -> list[Reserved]:
    return relative_sites(k, ".call_sites", lambda s: _insn_len(k.code(s, 16)))


def endbr_seal(k: KernelImage) -> list[Reserved]:
    return relative_sites(k, ".ibt_endbr_seal", lambda s: 4)


def smp_locks(k: KernelImage) -> list[Reserved]:
    return relative_sites(k, ".smp_locks", lambda s: 1)


def static_calls(k: KernelImage) -> list[Reserved]:
    a, buf = k.table_bytes(".static_call_sites", 8)
    out = []
    for i, (addr, key) in enumerate(offsets32(buf, 8, 2)):
        e = a + 8 * i
        site = e + addr
        raw = e + 4 + key
        flags = raw & 3
        out.append(Reserved(site, site + 5, ".static_call_sites",
                            f"key {raw & ~3:#x}{' tail' if flags & 1 else ''}{' init' if flags & 2 else ''}"))
    return out


def jump_labels(k: KernelImage) -> list[Reserved]:
    a, buf = k.table_bytes("__jump_table", 16)
    out = []
    for i in range(0, len(buf), 16):
        code, target, key = struct.unpack_from("<iiq", buf, i)
        e = a + i
        site = e + code
        b = k.code(site, 5)
        size = 2 if b[:1] == b"\xeb" or b[:2] == NOP2 else 5
        raw = e + 8 + key
        out.append(Reserved(site, site + size, "__jump_table",
                            f"target {e + 4 + target:#x} key {(raw & ~3) & (2**64 - 1):#x}"))
    return out


def indirect_thunk_range(k: KernelImage) -> tuple[int, int] | None:
    """[__indirect_thunk_start, __indirect_thunk_end): the retpoline thunks (and, in 6.1,
    __x86_return_thunk).  Not a reserved range: x86's opt.c counts a call/jmp into it as an
    indirect jump (insn_is_indirect_jump), which refuses optimizing the whole function."""
    a, b = k.addr.get("__indirect_thunk_start"), k.addr.get("__indirect_thunk_end")
    return (a, b) if a is not None and b is not None and b > a else None


def head_text(k: KernelImage) -> list[Reserved]:
    """.head.text, function by function: head_64.S, head64.c and the SME/SEV identity-mapped
    code (startup_64, secondary_startup_64, verify_cpu, pvh_start_xen, ...) run before the
    CPU's per-CPU base (%gs) is set, part of them on the early identity mapping, so no probe
    can run there (a detour would read its CPU's block through %gs, or jump to a kernel
    address not yet mapped).  The kernel has no bound for it in kallsyms; it is built without
    -pg, and .text proper starts with the function of the first __mcount_loc site."""
    start = k.addr.get("_text")
    sites = mcount_locs(k)
    if start is None or not sites:
        return []
    first = min(m.site for m in sites)
    f = k.function_at(first)
    end = f.start if f is not None else first
    return [Reserved(f.start, min(f.end, end), ".head.text", f.name) for f in functions_in(k, start, end)]


def thunks(k: KernelImage) -> list[Reserved]:
    """The retpoline and return thunks (indirect_thunk_range(): __x86_indirect_thunk_*,
    the ITS thunks, __x86_return_thunk and the retbleed/SRSO ones), function by function.
    Every return and indirect branch of the kernel runs one, from the first instruction of
    startup_64 on (before the breakpoint handler exists), and so does the probe's own path
    (the runtime returns through __x86_return_thunk, as the kernel's code does): a probe
    there would hit itself.  Beyond the kernel's own list."""
    r = indirect_thunk_range(k)
    return [] if r is None else [Reserved(f.start, min(f.end, r[1]), "__x86_thunks", f.name)
                                 for f in functions_in(k, *r)]


# Functions that run where the CPU has no per-CPU base (GS base 0 in kernel mode), which
# every probe's path reads (the preempt count, the CPU's block; the #BP entry's
# irqentry_nmi_enter() too): load_percpu_segment() calls wrmsrl(MSR_GS_BASE) right after
# loadsegment(gs, 0), through pv_ops (PARAVIRT_XXL) to native_write_msr(), on the boot CPU
# at setup_per_cpu_areas() and on each CPU brought up.  Beyond the kernel's own list (its
# kprobes, registered after boot, still meet it at CPU hotplug).
NO_PERCPU_BASE = ("native_write_msr",)


def no_percpu_base(k: KernelImage) -> list[Reserved]:
    """NO_PERCPU_BASE's functions, each whole."""
    out = []
    for f in k.functions():
        if f.name in NO_PERCPU_BASE:
            out.append(Reserved(f.start, f.end, "__x86_no_percpu_base", f.name))
    return out


def kernel_sites(data: bytes, symbols, path: str = "vmlinux", elf: ElfView | None = None,
                 image: KernelImage | None = None) -> list[Reserved]:
    """Every reserved or boot-patched range of the image, sorted by start (the image: a
    KernelImage of this module, which knows x86's tables).

    Tables: .altinstructions .parainstructions .retpoline_sites .return_sites .call_sites
    .ibt_endbr_seal .smp_locks .static_call_sites __jump_table __mcount_loc
    "__ex_table" (faulting instructions) "__ex_table fixup" (fixup targets, 1 byte: a
    region must not contain one) __bug_table _kprobe_blacklist, and the ranges
    .noinstr.text .entry.text .kprobes.text .static_call.text .head.text __cfi_/__pfx_
    __x86_thunks __x86_no_percpu_base.
    """
    k = image or KernelImage(data, symbols, path, elf)
    out: list[Reserved] = []
    out += alternatives(k)
    out += paravirt(k)
    out += retpoline_sites(k)
    out += return_sites(k)
    out += call_sites(k)
    out += endbr_seal(k)
    out += smp_locks(k)
    out += static_calls(k)
    out += jump_labels(k)
    out += [Reserved(m.site, m.site + FTRACE_SITE, "__mcount_loc", f"entry {m.entry:#x}") for m in mcount_locs(k)]
    for e in ex_table(k):
        n = _capstone_len(k.code(e.insn, 16)) if k.elf.has(e.insn, 16) else 1
        out.append(Reserved(e.insn, e.insn + n, "__ex_table", f"fixup {e.fixup:#x} type {e.data & 0xFF}"))
        out.append(Reserved(e.fixup, e.fixup + 1, "__ex_table fixup", f"insn {e.insn:#x}"))
    for b in bug_table(k):
        out.append(Reserved(b.addr, b.addr + BUG_INSN, "__bug_table",
                            f"{b.file}:{b.line}{' warning' if b.flags & 1 else ''}"))
    out += [Reserved(s, e, "_kprobe_blacklist", n) for s, e, n in kprobe_blacklist(k)]
    out += section_ranges(k)
    out += head_text(k)
    out += thunks(k)
    out += no_percpu_base(k)
    out += cfi_symbols(k)
    # Reserved's own order, by a key: its dataclass __lt__ is a Python call a comparison
    # (some 600,000 over a kernel's 190,000 entries: 0.3 s).
    out.sort(key=attrgetter("start", "end", "table", "detail"))
    return out


def verify_sites(k: KernelImage) -> dict[str, int]:
    """Check each table's sites against the code; {check: number of failures}.

    - every __mcount_loc site holds ``call __fentry__`` (e8 rel32 to __fentry__) or a nop5;
    - every .return_sites site holds ``jmp __x86_return_thunk`` (e9) or a ret (c3);
    - every .smp_locks site holds a lock prefix (f0);
    - every __jump_table site holds jmp rel8/rel32 or nop2/nop5;
    - every __bug_table site holds ud2 (0f 0b);
    - every .altinstructions site and replacement lies in executable code and the
      replacement is no longer than the original;
    - every .parainstructions site is a ``call *pv_ops+N(%rip)`` (ff 15);
    - every .retpoline_sites site is a call/jmp/jcc to an __x86_indirect_thunk_*;
    - every .static_call_sites site holds a call/jmp rel32 or nop5.
    """
    bad = {}
    fentry = k.addr.get("__fentry__")
    rthunk = k.addr.get("__x86_return_thunk")
    thunks = {a for n, a in k.addr.items() if n.startswith("__x86_indirect_thunk_")}

    def count(name, ok):
        bad[name] = bad.get(name, 0) + (0 if ok else 1)

    def target(site, b, i=0):
        return site + i + 5 + struct.unpack_from("<i", b, i + 1)[0]

    for m in mcount_locs(k):
        b = k.code(m.site, 5)
        count("__mcount_loc", b == NOP5 or (b[:1] == b"\xe8" and target(m.site, b) == fentry))
    for r in return_sites(k):
        b = k.code(r.start, 5)
        count(".return_sites", b[:1] == b"\xc3" or (b[:1] == b"\xe9" and target(r.start, b) == rthunk))
    for r in smp_locks(k):
        count(".smp_locks", k.code(r.start, 1) == b"\xf0")
    for r in jump_labels(k):
        b = k.code(r.start, 5)
        count("__jump_table", b[:1] in (b"\xeb", b"\xe9") or b[:2] == NOP2 or b == NOP5)
    for b in bug_table(k):
        count("__bug_table", k.code(b.addr, 2) == b"\x0f\x0b")
    for e in alt_entries(k):
        sec = k.elf.section_at(e.site)
        rsec = k.elf.section_at(e.replacement) if e.repl_length else sec
        count(".altinstructions", sec is not None and sec.executable and e.repl_length <= e.length
              and rsec is not None and rsec.executable)
    for r in paravirt(k):
        sec = k.elf.section_at(r.start)
        # 6.1 x86-64: every site is PARAVIRT_CALL, `call *pv_ops+N(%rip)` (ff 15 rel32).
        count(".parainstructions", sec is not None and sec.executable and k.code(r.start, 2) == b"\xff\x15")
    for r in retpoline_sites(k):
        b = k.code(r.start, 7)
        i = 1 if b[:1] == b"\x2e" else 0
        if b[i:i + 1] in (b"\xe8", b"\xe9"):
            t = target(r.start, b, i)
        elif b[i:i + 1] == b"\x0f":
            t = r.start + i + 6 + struct.unpack_from("<i", b, i + 2)[0]
        else:
            t = None
        count(".retpoline_sites", t in thunks)
    for r in static_calls(k):
        b = k.code(r.start, 5)
        count(".static_call_sites", b[:1] in (b"\xe8", b"\xe9") or b == NOP5)
    return bad
