"""What cannot be probed, and why: check_kprobe_address_safe()'s blacklist for
a user image (.kprobes.text, NOKPROBE_SYMBOL's _kprobe_blacklist, PLT stubs,
kernel-only sections, __cfi_/__pfx_ symbols) plus kprewrite's own runtime in an
already rewritten image."""
from __future__ import annotations

import bisect
import re
from itertools import accumulate
from operator import attrgetter
from dataclasses import dataclass

from ..elf.image import Image

SECTION_REASONS = {
    ".kprobes.text": "in .kprobes.text (__kprobes)",
    ".noinstr.text": "in .noinstr.text (noinstr)",
    ".entry.text": "in .entry.text (entry code)",
    ".plt": "PLT stub",
    ".plt.got": "PLT stub",
    ".plt.sec": "PLT stub",
    ".iplt": "PLT stub",
}
FUNCTION_SECTIONS = (".kprobes.text", ".noinstr.text", ".entry.text")
RUNTIME_PREFIX = ".kprewrite"
CLONE_SUFFIX = re.compile(r"\.(constprop|isra|part|cold|localalias)(\.\d+)*")


@dataclass(frozen=True)
class BlacklistEntry:
    start: int
    end: int
    symbol: str
    reason: str


def _symbol_at(image: Image, addr: int) -> str:
    f = image.function_at(addr)
    if f is None:
        return "-"
    return f.name if f.start == addr else f"{f.name}+{addr - f.start:#x}"


def _nokprobe_addresses(image: Image) -> list[int]:
    sec = image.section_named("_kprobe_blacklist")
    if sec is None or sec.type == 8:
        return []
    raw = image.data[sec.offset:sec.offset + sec.size]
    addrs = {sec.addr + i: int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw) - 7, 8)}
    for _, r_offset, addend in image.relative_relocations():   # PIE: the values live in relocations
        if r_offset in addrs:
            addrs[r_offset] = addend
    return [a for a in addrs.values() if a]


def compute(image: Image) -> list[BlacklistEntry]:
    out: list[BlacklistEntry] = []
    for s in image.sections:
        reason = SECTION_REASONS.get(s.name)
        if reason is None and s.name.startswith(RUNTIME_PREFIX) and s.flags & 2:
            reason = "kprewrite runtime and detour buffers"
        if not reason or not s.size:
            continue
        # A section of functions (__kprobes, noinstr) is listed function by function, as
        # populate_kprobe_blacklist() -> kprobe_add_area_blacklist() does from kallsyms; a
        # section with no function known (no symbols, no FDEs) stays one range.
        funcs = [f for f in image.functions if s.addr <= f.start < s.addr + s.size] if s.name in FUNCTION_SECTIONS else []
        for f in funcs:
            out.append(BlacklistEntry(f.start, min(f.end, s.addr + s.size), f.name, reason))
        if not funcs:
            out.append(BlacklistEntry(s.addr, s.addr + s.size, s.name, reason))
    # The sigreturn trampoline (an FDE whose CIE says 'S'; glibc starts it one byte early, in
    # the padding before __restore_rt, for unwinders that look up return address - 1): the
    # kernel jumps to it from a signal frame, and a 5-byte jump laid from the FDE's start
    # would overwrite its first instruction.  A kernel never probes its vDSO's either.
    for fde in image.fdes:
        if fde.signal_frame:
            out.append(BlacklistEntry(fde.start, fde.end, _symbol_at(image, fde.start), "signal return trampoline"))
    names = set()
    for a in _nokprobe_addresses(image):
        f = image.function_at(a)
        if f is not None:
            out.append(BlacklistEntry(f.start, f.end, f.name, "NOKPROBE_SYMBOL"))
            names.add(f.name)
    for f in image.functions:
        if f.name.startswith(("__cfi_", "__pfx_")):
            out.append(BlacklistEntry(f.start, f.end, f.name, "CFI/padding symbol"))
        elif names and f.name not in names and CLONE_SUFFIX.sub("", f.name) in names:
            out.append(BlacklistEntry(f.start, f.end, f.name, f"clone of NOKPROBE_SYMBOL {CLONE_SUFFIX.sub('', f.name)}"))
    out.sort(key=lambda e: (e.start, e.end, e.symbol))
    return out


class Index:
    """Entries sorted by start, for point and range queries by bisection (a kernel
    image has tens of thousands)."""

    def __init__(self, entries: list[BlacklistEntry]):
        self.entries = sorted(entries, key=attrgetter("start", "end", "symbol"))
        self._starts = [e.start for e in self.entries]
        # The furthest end among entries[:i+1].
        self._reach = list(accumulate(map(attrgetter("end"), self.entries), max, initial=0))[1:]

    def overlapping(self, lo: int, hi: int) -> BlacklistEntry | None:
        """The first entry (by start) overlapping [lo, hi)."""
        i = bisect.bisect_left(self._starts, hi)
        found = None
        while i > 0 and self._reach[i - 1] > lo:
            i -= 1
            if self.entries[i].end > lo:
                found = self.entries[i]
        return found

    def all_overlapping(self, lo: int, hi: int) -> list[BlacklistEntry]:
        """Every entry overlapping [lo, hi), by start."""
        i = bisect.bisect_left(self._starts, hi)
        out = []
        while i > 0 and self._reach[i - 1] > lo:
            i -= 1
            if self.entries[i].end > lo:
                out.append(self.entries[i])
        return out[::-1]

    def lookup(self, addr: int) -> BlacklistEntry | None:
        return self.overlapping(addr, addr + 1)

    def covers(self, lo: int, hi: int) -> bool:
        """Whether one entry holds all of [lo, hi): the furthest end among the
        entries starting at or before lo reaches hi."""
        i = bisect.bisect_right(self._starts, lo) - 1
        return i >= 0 and self._reach[i] >= hi


def lookup(entries, addr: int) -> BlacklistEntry | None:
    if isinstance(entries, Index):
        return entries.lookup(addr)
    for e in entries:
        if e.start <= addr < e.end:
            return e
    return None
