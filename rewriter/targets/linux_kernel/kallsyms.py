"""The symbols of a stripped vmlinux, read from the kernel's own kallsyms tables.

What ``/proc/kallsyms`` shows (address, type letter, name), recovered from the tables
``scripts/kallsyms.c`` writes into ``.rodata`` and ``kernel/kallsyms.c`` reads at run time,
in pure Python.  The tables are found by their structure, not by symbols (the image has
none):

- ``kallsyms_token_table``: 256 NUL-terminated strings; every character used in a symbol
  name keeps its own code as token, so tokens 0x30..0x39 are ``"0"``..``"9"``: the bytes
  ``0\\0 1\\0 ... 9\\0`` are the anchor;
- ``kallsyms_token_index``: 256 u16, the offset of each token, right after the table
  (aligned): it must agree with the strings found, which pins down the table's start;
- ``kallsyms_num_syms`` (u32, padded to 8) immediately before ``kallsyms_names`` (each
  name a length, one byte or two when the first has bit 7 set -- "big" symbols, 6.1 --
  followed by token indexes; the first expanded character is the type), then
  ``kallsyms_markers`` (the offset in names of every 256th symbol, u32 or unsigned long):
  found by trying each aligned u32 before the token table as a symbol count and keeping the
  one whose names parse and whose markers agree;
- ``kallsyms_offsets`` (s32 each) and ``kallsyms_relative_base`` (u64)
  (CONFIG_KALLSYMS_BASE_RELATIVE), or ``kallsyms_addresses`` (u64 each) without it.

Layouts (the order ``scripts/kallsyms.c`` writes them in):

- up to 6.1 (verified on Debian 12's 6.1 kernel):
  offsets, relative_base, num_syms, names, markers, token_table, token_index;
- 6.2, 6.3 (from the sources, not verified on an image): the same with
  ``kallsyms_seqs_of_names`` between markers and token_table -- handled, since names
  are located by scanning back from the token table and validated by the markers;
- 6.4 and later (from the sources, not verified): num_syms, names, markers,
  token_table, token_index, offsets, relative_base, seqs_of_names -- handled by looking
  for the offsets after token_index when they are not before num_syms.

Addresses with CONFIG_KALLSYMS_ABSOLUTE_PERCPU (x86-64 SMP): a non-negative offset is the
absolute value (the per-CPU symbols, type ``A``), a negative one means
``relative_base - 1 - offset``; without it every offset is unsigned from relative_base.
The mode is detected (any negative offset means absolute-percpu).

Function bounds: kallsyms has no sizes; a function ends where the next symbol with a
higher address starts, as ``kallsyms_lookup_size_offset()`` does, clipped at the end of
the executable section holding it.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass

from rewriter.errors import KprewriteError

from .elfview import ElfView, SHF_ALLOC, SHF_EXECINSTR, SHT_NOBITS

_DIGITS = b"0\x001\x002\x003\x004\x005\x006\x007\x008\x009\x00"
TEXT_TYPES = frozenset("tTwW")

# Bounds on the search, so that a crafted image costs seconds, not hours (a real kernel's tables
# are found at the first candidate: one token table, one symbol count, one parse of its names):
MAX_SYMS = 4_000_000            # a kallsyms_num_syms above this is not one
MAX_TOKEN_CANDIDATES = 4096     # "0\0 1\0 ... 9\0" anchors tried, per section
MAX_NAMES_SPAN = 64 << 20       # bytes before the token table searched for kallsyms_num_syms
MAX_NAMES_PARSED = MAX_SYMS       # name entries parsed in all, over every candidate symbol count


class _Budget(Exception):
    """The search for the tables passed one of the bounds above."""


@dataclass(frozen=True)
class KSym:
    addr: int
    type: str
    name: str


@dataclass(frozen=True)
class Function:
    start: int
    end: int
    name: str
    type: str

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass
class KallsymsTables:
    """Where the tables were found (virtual addresses) and how they were read."""
    layout: str
    num_syms: int
    names: int
    markers: int
    marker_size: int
    token_table: int
    token_index: int
    offsets: int | None
    relative_base: int | None
    addresses: int | None
    absolute_percpu: bool


class SymbolTable:
    """Name lookups over `self.symbols` (a list of KSym), shared by the kallsyms tables and
    System.map: local symbols may repeat a name, so a name has a list of addresses."""
    symbols: list[KSym]

    def __post_init__(self):
        self._by_name: dict[str, list[int]] = {}
        for s in self.symbols:
            self._by_name.setdefault(s.name, []).append(s.addr)

    def __len__(self) -> int:
        return len(self.symbols)

    def addresses(self, name: str) -> list[int]:
        """Every address of name (local symbols may repeat), in table order."""
        return self._by_name.get(name, [])

    def address(self, name: str) -> int | None:
        """The first address of name, or None."""
        a = self._by_name.get(name)
        return a[0] if a else None

    def __contains__(self, name: str) -> bool:
        return name in self._by_name


@dataclass
class Kallsyms(SymbolTable):
    symbols: list[KSym]
    tables: KallsymsTables


def _cstrings(data: bytes, pos: int, count: int, limit: int):
    """count NUL-terminated non-empty strings from pos: (list of offsets from pos, end)."""
    offs = []
    start = pos
    for _ in range(count):
        end = data.find(b"\0", pos, limit)
        if end <= pos:  # not found, or empty string
            return None, pos
        offs.append(pos - start)
        pos = end + 1
    return offs, pos


def _find_tokens(data: bytes, lo: int, hi: int):
    """(token_table offset, token_index offset, tokens) in data[lo:hi], or None."""
    p = data.find(_DIGITS, lo, hi)
    tried = 0
    while p >= 0:
        tried += 1
        if tried > MAX_TOKEN_CANDIDATES:
            raise _Budget(f"more than {MAX_TOKEN_CANDIDATES} candidate kallsyms token tables")
        rest, e = _cstrings(data, p, 256 - 0x30, hi)
        if rest is not None:
            for t in range(e, min(e + 16, hi - 512)):
                if t % 2:
                    continue
                idx = struct.unpack_from("<256H", data, t)
                if idx[0] != 0 or any(idx[i] >= idx[i + 1] for i in range(255)):
                    continue
                s = p - idx[0x30]
                if s < lo:
                    continue
                offs, end = _cstrings(data, s, 256, hi)
                if offs is None or end != e or tuple(offs) != idx:
                    continue
                tokens = [data[s + idx[i]:data.index(b"\0", s + idx[i])] for i in range(256)]
                return s, t, tokens
        p = data.find(_DIGITS, p + 1, hi)
    return None


def _parse_names(data: bytes, pos: int, count: int, limit: int, budget: list[int]):
    """(entry list of (offset, length), marker offsets, end) or None if it overruns;
    `budget` is a one-item list of names left to parse (raises _Budget past it)."""
    entries = []
    markers = []
    start = pos
    append = entries.append
    for i in range(count):
        if not i & 0xFF:
            markers.append(pos - start)
            budget[0] -= 256
            if budget[0] < 0:
                raise _Budget(f"more than {MAX_NAMES_PARSED} kallsyms names parsed in candidate tables")
        if pos >= limit:
            return None
        n = data[pos]
        pos += 1
        if n & 0x80:
            n = (n & 0x7F) | (data[pos] << 7)
            pos += 1
        if n == 0:
            return None
        append((pos, n))
        pos += n
    if pos > limit:
        return None
    return entries, markers, pos


def _align(x: int, a: int) -> int:
    return (x + a - 1) & -a


def _plausible_type(tokens, data, pos) -> bool:
    tok = tokens[data[pos]]
    return bool(tok) and chr(tok[0]) in "aAbBdDrRtTvVwWuUnN?"


def _find_names(data: bytes, tokens, lo: int, table: int):
    """Locate num_syms/names/markers before the token table (offset `table`), at most
    MAX_NAMES_SPAN bytes before it, parsing at most MAX_NAMES_PARSED names in all."""
    top = table - 8 - 512  # at least a little room for names
    x = (top // 8) * 8
    lo = max(lo, table - MAX_NAMES_SPAN)
    budget = [MAX_NAMES_PARSED]
    while x >= lo:
        v, pad = struct.unpack_from("<II", data, x)
        if pad == 0 and 256 <= v <= MAX_SYMS and x + 8 + 2 * v <= table:
            n = x + 8
            if _plausible_type(tokens, data, n + (2 if data[n] & 0x80 else 1)):
                parsed = _parse_names(data, n, v, table, budget)
                if parsed is not None:
                    entries, marks, end = parsed
                    for a in (8, 4):
                        m = _align(end, a)
                        for size, fmt in ((4, "<I"), (8, "<Q")):
                            if m + size * len(marks) > table:
                                continue
                            got = list(struct.unpack_from(f"<{len(marks)}{fmt[1]}", data, m))
                            if got == marks:
                                return x, v, n, entries, m, size
        x -= 8
    return None


def _decode_offsets(raw: tuple[int, ...], base: int):
    """Addresses from kallsyms_offsets, and whether absolute-percpu semantics applied."""
    if any(o < 0 for o in raw):
        return [o if o >= 0 else base - 1 - o for o in raw], True
    return [base + o for o in raw], False


def _sorted_enough(addrs: list[int]) -> bool:
    bad = sum(1 for a, b in zip(addrs, addrs[1:]) if b < a)
    return bad == 0


def read_kallsyms(data: bytes, path: str = "vmlinux", elf: ElfView | None = None) -> Kallsyms:
    """The kallsyms symbols of a vmlinux (ELF, stripped or not), in table (address) order."""
    elf = elf or ElfView(data, path)
    regions = []
    ro = elf.section(".rodata")
    if ro is not None and ro.type != SHT_NOBITS:
        regions.append(ro)
    regions += [s for s in elf.sections if s.flags & SHF_ALLOC and not s.flags & SHF_EXECINSTR
                and s.type != SHT_NOBITS and s is not ro and s.size >= 4096]
    found = None
    for sec in regions:
        lo, hi = sec.offset, sec.offset + sec.size
        try:
            tok = _find_tokens(data, lo, hi)
            if tok is None:
                continue
            table, index, tokens = tok
            nm = _find_names(data, tokens, lo, table)
        except _Budget as e:
            raise KprewriteError(f"{path}: no kallsyms tables found in {sec.name or 'a section'}: {e} "
                                 f"(a crafted image?); give its symbols with --system-map")
        if nm is None:
            continue
        found = (sec, table, index, tokens, nm)
        break
    if found is None:
        raise KprewriteError(
            f"{path}: no kallsyms tables found (a kernel without CONFIG_KALLSYMS, or a layout "
            f"kprewrite does not know); give its symbols with --system-map")
    sec, table, index, tokens, (x, count, names, entries, markers, msize) = found
    lo, hi = sec.offset, sec.offset + sec.size

    def vaddr(off: int) -> int:
        return sec.addr + off - sec.offset

    layout = None
    addrs = None
    offsets_at = base_at = addresses_at = None
    percpu = False
    # Up to 6.3: offsets, relative_base just before num_syms.
    if x - 8 - 4 * count >= lo:
        base = struct.unpack_from("<Q", data, x - 8)[0]
        o = x - 8 - _align(4 * count, 8)
        if base and o >= lo:
            cand, pc = _decode_offsets(struct.unpack_from(f"<{count}i", data, o), base)
            if _sorted_enough(cand):
                addrs, percpu, offsets_at, base_at = cand, pc, o, x - 8
                layout = "offsets-first (<= 6.3)"
        if addrs is None and x - 8 * count >= lo:
            a = x - _align(8 * count, 8)
            cand = list(struct.unpack_from(f"<{count}Q", data, a))
            if cand[-1] and _sorted_enough(cand):
                addrs, addresses_at, layout = cand, a, "addresses-first (<= 6.3, absolute)"
    # 6.4 and later: offsets, relative_base after token_index.
    if addrs is None:
        o = _align(index + 512, 8)
        if o + 4 * count + 8 <= hi:
            b = _align(o + 4 * count, 8)
            base = struct.unpack_from("<Q", data, b)[0]
            cand, pc = _decode_offsets(struct.unpack_from(f"<{count}i", data, o), base)
            if base and _sorted_enough(cand):
                addrs, percpu, offsets_at, base_at = cand, pc, o, b
                layout = "names-first (>= 6.4)"
        if addrs is None and o + 8 * count <= hi:
            cand = list(struct.unpack_from(f"<{count}Q", data, o))
            if cand[-1] and _sorted_enough(cand):
                addrs, addresses_at, layout = cand, o, "names-first (>= 6.4, absolute)"
    if addrs is None:
        raise KprewriteError(
            f"{path}: kallsyms names found at {vaddr(names):#x} but no address table that "
            f"fits them; give its symbols with --system-map")

    syms = []
    join = b"".join
    getter = tokens.__getitem__
    for (pos, n), addr in zip(entries, addrs):
        full = join(map(getter, data[pos:pos + n]))
        syms.append(KSym(addr, chr(full[0]), full[1:].decode("latin-1")))
    tables = KallsymsTables(
        layout=layout, num_syms=vaddr(x), names=vaddr(names), markers=vaddr(markers),
        marker_size=msize, token_table=vaddr(table), token_index=vaddr(index),
        offsets=vaddr(offsets_at) if offsets_at is not None else None,
        relative_base=struct.unpack_from("<Q", data, base_at)[0] if base_at is not None else None,
        addresses=vaddr(addresses_at) if addresses_at is not None else None,
        absolute_percpu=percpu)
    return Kallsyms(syms, tables)


def functions(symbols: list[KSym], elf: ElfView) -> list[Function]:
    """Text symbols (t, T, w, W) with bounds, ordered by address.

    A function ends at the next symbol (of any type) with a higher address, as the kernel's
    kallsyms_lookup_size_offset() does, clipped at the end of the executable section that
    holds it (.text ends at _etext, .init.text at _einittext, ...).  Aliases (several names
    at one address) get the same bounds; entries of size 0 (a label at a section's end such
    as _etext) and text symbols outside any executable section are dropped.
    """
    execs = sorted((s.addr, s.end) for s in elf.sections
                   if s.flags & SHF_EXECINSTR and s.flags & SHF_ALLOC and s.size)
    starts = [a for a, _ in execs]
    addrs = sorted({s.addr for s in symbols if s.type not in "aA"})
    out = []
    for s in sorted((s for s in symbols if s.type in TEXT_TYPES), key=lambda s: s.addr):
        i = bisect.bisect_right(starts, s.addr) - 1
        if i < 0 or not s.addr < execs[i][1]:
            continue
        j = bisect.bisect_right(addrs, s.addr)
        end = addrs[j] if j < len(addrs) else execs[i][1]
        end = min(end, execs[i][1])
        if end > s.addr:
            out.append(Function(s.addr, end, s.name, s.type))
    return out
