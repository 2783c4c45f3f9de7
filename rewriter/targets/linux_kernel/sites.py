"""The tables every Linux vmlinux has, whatever its architecture, and the image they are read from.

Read from the image's own tables.  In a final vmlinux many of them are merged into other
output sections (``__jump_table`` into ``.rodata``'s ro-after-init part, ``__mcount_loc``
and ``_kprobe_blacklist`` into ``.init.data``); each table is therefore found by the
start/stop symbols the linker script defines (through kallsyms or a System.map) and,
failing those, by its section header.  An architecture's own tables (x86's alternatives,
paravirt, retpoline and return sites, ...) and the sizes of the instructions the generic
tables point at are in its folder (x86_64/sites.py), whose KernelImage subclass names them.

Layouts, as in Linux 6.1:

=====================  ============================================================
table                  entry
=====================  ============================================================
__mcount_loc           u64 absolute address of an ftrace site
__ex_table             struct exception_table_entry: s32 insn, s32 fixup, s32 data
                       (12 bytes); insn and fixup relative to their fields
__bug_table            struct bug_entry (GENERIC_BUG_RELATIVE_POINTERS,
                       DEBUG_BUGVERBOSE): s32 bug_addr_disp, s32 file_disp, u16 line,
                       u16 flags (12 bytes)
_kprobe_blacklist      unsigned long function addresses (NOKPROBE_SYMBOL)
=====================  ============================================================

Ranges: ``.noinstr.text`` and ``.kprobes.text`` by their start/end symbols, and
``__cfi_*``/``__pfx_*`` symbols by their kallsyms bounds.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass
from typing import Mapping

from rewriter.errors import KprewriteError

from .elfview import ElfView
from .kallsyms import Function, KSym, functions as _functions


@dataclass(frozen=True, order=True)
class Reserved:
    """[start, end) reserved by `table`; detail says which entry and what it holds."""
    start: int
    end: int
    table: str
    detail: str = ""


@dataclass(frozen=True)
class McountLoc:
    site: int          # address of the ftrace site (a call of __fentry__ or a nop)
    entry: int         # address of its __mcount_loc entry
    entry_offset: int  # file offset of that entry (zero it to drop the site from ftrace)


@dataclass(frozen=True)
class ExEntry:
    insn: int
    fixup: int
    data: int          # the architecture's (x86: type and imm, EX_DATA_*)
    entry: int


@dataclass(frozen=True)
class BugEntry:
    addr: int
    file: str
    line: int
    flags: int
    entry: int


# table name (its section's) -> (start symbol, end symbol)
TABLES = {
    "__jump_table": ("__start___jump_table", "__stop___jump_table"),
    "__mcount_loc": ("__start_mcount_loc", "__stop_mcount_loc"),
    "__ex_table": ("__start___ex_table", "__stop___ex_table"),
    "__bug_table": ("__start___bug_table", "__stop___bug_table"),
    "_kprobe_blacklist": ("__start_kprobe_blacklist", "__stop_kprobe_blacklist"),
}

# Text ranges reserved whole, by their start/end symbols.
RANGES = {
    ".noinstr.text": ("__noinstr_text_start", "__noinstr_text_end"),
    ".kprobes.text": ("__kprobes_text_start", "__kprobes_text_end"),
}
# The ranges populate_kprobe_blacklist() lists function by function (an architecture's
# arch_populate_kprobe_blacklist() adds its own).
BLACKLIST_RANGES = (".kprobes.text", ".noinstr.text")


class KernelImage:
    """A vmlinux's bytes with a symbol lookup: what every reader here works on.  An
    architecture's subclass adds its tables and ranges to these class attributes."""
    TABLES = TABLES
    RANGES = RANGES
    BLACKLIST_RANGES = BLACKLIST_RANGES

    def __init__(self, data: bytes, symbols, path: str = "vmlinux", elf: ElfView | None = None):
        self.data = data
        self.path = path
        self.elf = elf or ElfView(data, path)
        syms = symbols.symbols if hasattr(symbols, "symbols") else symbols
        if isinstance(syms, Mapping):
            self.addr = dict(syms)
            self.symbols = [KSym(a, "?", n) for n, a in syms.items()]
        else:
            self.symbols = list(syms)
            self.addr = {}
            for s in self.symbols:
                self.addr.setdefault(s.name, s.addr)
        self._funcs: list[Function] | None = None

    # -- plumbing ---------------------------------------------------------------------

    def bounds(self, table: str) -> tuple[int, int] | None:
        """[start, end) of a table by its symbols, else its section, else None."""
        lo, hi = self.TABLES.get(table) or self.RANGES[table]
        a, b = self.addr.get(lo), self.addr.get(hi)
        if a is not None and b is not None and b >= a:
            return a, b
        sec = self.elf.section(table)
        if sec is not None and sec.size:
            return sec.addr, sec.end
        return None

    def table_bytes(self, table: str, entsize: int) -> tuple[int, bytes]:
        b = self.bounds(table)
        if b is None:
            return 0, b""
        a, e = b
        n = (e - a) // entsize * entsize
        if not self.elf.has(a, max(n, 1)):
            raise KprewriteError(
                f"{self.path}: table {table} at {a:#x}..{e:#x} is not in the file's loaded bytes")
        return a, self.elf.read(a, n)

    def functions(self) -> list[Function]:
        if self._funcs is None:
            self._funcs = _functions(self.symbols, self.elf)
            self._fstarts = [f.start for f in self._funcs]
        return self._funcs

    def function_at(self, addr: int) -> Function | None:
        """The function containing addr (the first name among aliases), as kallsyms finds it."""
        fs = self.functions()
        i = bisect.bisect_right(self._fstarts, addr) - 1
        if i < 0 or not fs[i].start <= addr < fs[i].end:
            return None
        i = bisect.bisect_left(self._fstarts, fs[i].start)
        return fs[i]

    def code(self, addr: int, n: int) -> bytes:
        return self.elf.read(addr, n) if self.elf.has(addr, n) else b""


def offsets32(buf: bytes, entsize: int, nfields: int = 1):
    """Rows of signed 32-bit fields (first nfields of each entsize-byte entry)."""
    fmt = "<" + "i" * nfields
    return [struct.unpack_from(fmt, buf, i) for i in range(0, len(buf), entsize)]


# -- individual tables -------------------------------------------------------------------


def relative_sites(k: KernelImage, table: str, size_of) -> list[Reserved]:
    a, buf = k.table_bytes(table, 4)
    out = []
    for i, (d,) in enumerate(offsets32(buf, 4)):
        if d == 0:
            continue
        site = a + 4 * i + d
        out.append(Reserved(site, site + size_of(site), table))
    return out


def mcount_locs(k: KernelImage) -> list[McountLoc]:
    """Every ftrace site: its address, its __mcount_loc entry's address and file offset.

    Zero entries (linker padding, or sites already dropped) are skipped, as ftrace does.
    """
    a, buf = k.table_bytes("__mcount_loc", 8)
    if not buf:
        return []
    base = k.elf.offset_of(a, len(buf))
    out = []
    for i, (site,) in enumerate(struct.iter_unpack("<Q", buf)):
        if site:
            out.append(McountLoc(site, a + 8 * i, base + 8 * i))
    return out


def ex_table(k: KernelImage) -> list[ExEntry]:
    """__ex_table entries: (faulting instruction, fixup, data), addresses absolute."""
    a, buf = k.table_bytes("__ex_table", 12)
    out = []
    for i in range(0, len(buf), 12):
        insn, fixup, data = struct.unpack_from("<iii", buf, i)
        e = a + i
        out.append(ExEntry(e + insn, e + 4 + fixup, data, e))
    return out


def bug_table(k: KernelImage) -> list[BugEntry]:
    a, buf = k.table_bytes("__bug_table", 12)
    out = []
    for i in range(0, len(buf), 12):
        disp, fdisp, line, flags = struct.unpack_from("<iiHH", buf, i)
        e = a + i
        faddr = e + 4 + fdisp
        name = ""
        if k.elf.has(faddr, 1):
            off = k.elf.offset_of(faddr)
            end = k.data.find(b"\0", off, off + 4096)
            name = k.data[off:end if end >= 0 else off].decode("latin-1")
        out.append(BugEntry(e + disp, name, line, flags, e))
    return out


def kprobe_blacklist(k: KernelImage) -> list[tuple[int, int, str]]:
    """(start, end, symbol) for every function the kernel's kprobe blacklist holds.

    As populate_kprobe_blacklist() builds it in 6.1: each NOKPROBE_SYMBOL address
    (``_kprobe_blacklist``) with its kallsyms bounds, then every function of
    ``.kprobes.text`` and ``.noinstr.text`` and the architecture's ranges
    (k.BLACKLIST_RANGES).  An address with no function around it is listed as 1 byte.
    """
    a, buf = k.table_bytes("_kprobe_blacklist", 8)
    out = []
    seen = set()
    for (addr,) in struct.iter_unpack("<Q", buf):
        if not addr:
            continue
        f = k.function_at(addr)
        key = (f.start, f.end) if f else (addr, addr + 1)
        if key in seen:
            continue
        seen.add(key)
        out.append((key[0], key[1], f.name if f else f"{addr:#x}"))
    for rng in k.BLACKLIST_RANGES:
        b = k.bounds(rng)
        if b is None:
            continue
        for f in functions_in(k, *b):
            if (f.start, f.end) not in seen:
                seen.add((f.start, f.end))
                out.append((f.start, f.end, f.name))
    return out


def functions_in(k: KernelImage, lo: int, hi: int) -> list[Function]:
    """One entry per distinct function start in [lo, hi) (the first name of aliases), with its
    kallsyms bounds (not clipped at hi: the kernel's kprobe_add_area_blacklist does not)."""
    out, last = [], None
    for f in k.functions():
        if lo <= f.start < hi and f.start != last:
            out.append(f)
            last = f.start
    return out


def section_ranges(k: KernelImage) -> list[Reserved]:
    out = []
    for rng in k.RANGES:
        b = k.bounds(rng)
        if b is not None and b[1] > b[0]:
            out.append(Reserved(b[0], b[1], rng))
    return out


def cfi_symbols(k: KernelImage) -> list[Reserved]:
    """__cfi_* and __pfx_* symbols (kCFI preambles, 6.1+ clang; function padding, 6.2+)."""
    return [Reserved(f.start, f.end, "__cfi_/__pfx_", f.name) for f in k.functions()
            if f.name.startswith(("__cfi_", "__pfx_"))]
