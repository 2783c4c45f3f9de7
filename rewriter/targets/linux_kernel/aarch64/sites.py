"""Every site a Linux arm64 kernel reserves from kprobes or patches at boot: the generic tables
(../sites.py) and arm64's own, read from an Image (image.py) or a vmlinux.

In Debian's Image (KALLSYMS_ALL off) the linker's table symbols (``__start_mcount_loc``,
``__start___ex_table``, ...) are not in kallsyms: the tables that are lists of pointers are
found by their relocations (image.py: the ftrace sites, ``__patchable_function_entries``, and
NOKPROBE_SYMBOL's ``_kprobe_blacklist``) and named as sections of the Image's view; the text
ranges are bounded by kallsyms' text markers.  Tables of relative entries (``__ex_table``,
``__bug_table``, ``__jump_table``, ``.altinstructions``) have neither there: they are read
when a System.map names them, else found by the form of their entries (tables.py).

The ftrace site (``-fpatchable-function-entry=2``): two NOPs at a function's entry, the
first rewritten to ``mov x9, x30`` by ftrace_init_nop() at boot (which fails unless it is a
NOP), the second (rec->ip, ftrace_call_adjust() = entry + 4) to ``bl ftrace_caller`` when
traced.  Both are patched at boot; registration refuses the second (ftrace_location(), no
KPROBES_ON_FTRACE on arm64).  The entries are what mcount_locs() reads for ``__mcount_loc``
(the planner's ftrace sites: a probe on a function's entry; the arm64 build takes it past
the NOPs, build.py).

Ranges reserved whole (arch_populate_kprobe_blacklist() in arch/arm64/kernel/probes/kprobes.c,
populate_kprobe_blacklist() in kernel/kprobes.c): ``.entry.text``, ``.irqentry.text``,
``.idmap.text``, ``.hyp.text``, ``.hyp.idmap.text``, ``.kprobes.text``, ``.noinstr.text``;
and ``.head.text`` ([_text, _stext): not kernel text for kernel_text_address()).
"""
from __future__ import annotations

import struct

from .. import sites as _generic
from ..elfview import ElfView
from ..sites import (BugEntry, ExEntry, McountLoc, Reserved, bug_table, cfi_symbols, ex_table,  # noqa: F401
                     functions_in, kprobe_blacklist, mcount_locs, offsets32, relative_sites, section_ranges)

TABLES = {
    ".altinstructions": ("__alt_instructions", "__alt_instructions_end"),
    "__patchable_function_entries": ("__start_mcount_loc", "__stop_mcount_loc"),
    **_generic.TABLES,
}
RANGES = {
    ".noinstr.text": ("__noinstr_text_start", "__noinstr_text_end"),
    ".kprobes.text": ("__kprobes_text_start", "__kprobes_text_end"),
    ".entry.text": ("__entry_text_start", "__entry_text_end"),
    ".irqentry.text": ("__irqentry_text_start", "__irqentry_text_end"),
    ".idmap.text": ("__idmap_text_start", "__idmap_text_end"),
    ".hyp.text": ("__hyp_text_start", "__hyp_text_end"),
    ".hyp.idmap.text": ("__hyp_idmap_text_start", "__hyp_idmap_text_end"),
    ".head.text": ("_text", "_stext"),
}
assert set(_generic.RANGES) <= set(RANGES)

NOP = struct.pack("<I", 0xD503201F)
FTRACE_SITE = 8                     # the two NOPs
FTRACE_LOCATION = 4                 # rec->ip: the second NOP (ftrace_call_adjust())
BRK_BUG = 0xD4210000                # brk #0x800: a __bug_table site


class KernelImage(_generic.KernelImage):
    """An arm64 kernel: the generic tables and arm64's (arch_populate_kprobe_blacklist()'s
    ranges added to the kprobe blacklist)."""
    TABLES = TABLES
    RANGES = RANGES
    BLACKLIST_RANGES = _generic.BLACKLIST_RANGES + (".entry.text", ".irqentry.text", ".idmap.text",
                                                    ".hyp.text", ".hyp.idmap.text")

    def __init__(self, data: bytes, symbols, path: str = "vmlinux", elf: ElfView | None = None):
        super().__init__(data, symbols, path, elf)
        if "_text" not in self.addr:        # not in kallsyms: .head.text's section in the view
            sec = self.elf.section(".head.text")
            if sec is not None:
                self.addr["_text"] = sec.addr

    def bounds(self, table: str):
        if table == "__mcount_loc":         # arm64's: the patchable entries (each function's first NOP)
            table = "__patchable_function_entries"
        return super().bounds(table)


def ftrace_sites(k: KernelImage) -> list[int]:
    """The entry of every function's ftrace NOPs (a 0 entry: a site ftrace dropped)."""
    a, buf = k.table_bytes("__patchable_function_entries", 8)
    return [s for (s,) in struct.iter_unpack("<Q", buf) if s]


def jump_labels(k: KernelImage) -> list[Reserved]:
    a, buf = k.table_bytes("__jump_table", 16)
    out = []
    for i in range(0, len(buf), 16):
        code, = struct.unpack_from("<i", buf, i)
        out.append(Reserved(a + i + code, a + i + code + 4, "__jump_table"))
    return out


def alternatives(k: KernelImage) -> list[Reserved]:
    """struct alt_instr (arm64): s32 orig_offset, s32 alt_offset, u16 cpufeature, u8 orig_len, u8 alt_len."""
    a, buf = k.table_bytes(".altinstructions", 12)
    out = []
    for i in range(0, len(buf), 12):
        orig, _alt, feat, olen, _alen = struct.unpack_from("<iiHBB", buf, i)
        out.append(Reserved(a + i + orig, a + i + orig + max(olen, 4), ".altinstructions", f"cpufeature {feat}"))
    return out


def kernel_sites(data: bytes, symbols, path: str = "vmlinux", elf: ElfView | None = None,
                 image: KernelImage | None = None) -> list[Reserved]:
    """Every reserved or boot-patched range of the image, sorted by start.

    Tables: __patchable_function_entries (both NOPs, patched at boot) and "ftrace_location"
    (the second NOP, refused at registration), __ex_table and "__ex_table fixup",
    __bug_table, __jump_table, .altinstructions, _kprobe_blacklist, and the ranges of RANGES
    and __cfi_/__pfx_."""
    k = image or KernelImage(data, symbols, path, elf)
    out: list[Reserved] = []
    for s in ftrace_sites(k):
        out.append(Reserved(s, s + FTRACE_SITE, "__patchable_function_entries", "ftrace NOPs (ftrace_init_nop)"))
        out.append(Reserved(s + FTRACE_LOCATION, s + FTRACE_SITE, "ftrace_location"))
    for e in ex_table(k):
        out.append(Reserved(e.insn, e.insn + 4, "__ex_table", f"fixup {e.fixup:#x}"))
        out.append(Reserved(e.fixup, e.fixup + 1, "__ex_table fixup", f"insn {e.insn:#x}"))
    for b in bug_table(k):
        out.append(Reserved(b.addr, b.addr + 4, "__bug_table", f"{b.file}:{b.line}"))
    out += jump_labels(k)
    out += alternatives(k)
    out += [Reserved(s, e, "_kprobe_blacklist", n) for s, e, n in kprobe_blacklist(k)]
    out += section_ranges(k)
    out += cfi_symbols(k)
    out.sort()
    return out


def verify_sites(k: KernelImage) -> dict[str, int]:
    """{check: failures}: every ftrace site holds two NOPs; every __bug_table site a brk #0x800;
    every __jump_table site a NOP or a B."""
    bad = {"__patchable_function_entries": 0}
    for s in ftrace_sites(k):
        bad["__patchable_function_entries"] += k.code(s, 8) != NOP * 2
    for b in bug_table(k):
        bad["__bug_table"] = bad.get("__bug_table", 0) + (k.code(b.addr, 4) != struct.pack("<I", BRK_BUG))
    for r in jump_labels(k):
        w = struct.unpack("<I", k.code(r.start, 4) or b"\0" * 4)[0]
        bad["__jump_table"] = bad.get("__jump_table", 0) + (w != 0xD503201F and w >> 26 != 0b000101)
    return bad
