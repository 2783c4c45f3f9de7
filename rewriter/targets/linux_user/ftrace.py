"""Ftrace sites of a user ELF: function entries the compiler left as the arch's
ftrace nop (arch.FTRACE_NOP, as long as its jump: x86-64's 5-byte nop)
and recorded in a table, which a probe takes as KPROBE_FLAG_FTRACE does in a
kernel (the jump replaces the nop; the function's own code is not touched).

Two tables record them, both arrays of 8-byte addresses (in a PIE or a shared
object each entry also has a relative relocation, whose addend is the
value the loader writes):
- __mcount_loc (gcc -pg -mfentry -mrecord-mcount): the address of each
  `call __fentry__`, the ftrace nop with -mnop-mcount;
- __patchable_function_entries (-fpatchable-function-entry=N[,M]): the first of
  N of the smallest nops (arch.NOP1), M of them before the function's symbol (gcc puts them after
  an endbr64, the entry recorded being then the function's start).

A recorded entry is an ftrace site only where the function's entry (after its
landing pad, as arch_adjust_kprobe_addr()) holds one ftrace nop (-mnop-mcount) or
exactly as many of the smallest nops as it has bytes (x86-64: -fpatchable-function-entry=5,
or N,M with N-M = 5).
Everything else stays what it was, ordinary code for the optimizer: a real
`call __fentry__`/`mcount` (plain -pg -mfentry: a user program's profiling
call, relocated into the detour, never skipped), fewer nops (no room
for the jump there alone), more than five (the jump would take only part of
the padding: the nops are then probed as the instructions they are, optimized
or not as the checks say), and any nops before the entry (never executed on a
call through the symbol).

Unlike a kernel, no one patches these sites at run time in a user process, so
the output keeps the tables as they are (the kernel target drops the entries
it took, because ftrace would patch or check them).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...analysis.blacklist import BlacklistEntry

TABLES = ("__mcount_loc", "__patchable_function_entries")
MAX_PADDING = 64          # nops before a function's entry (-fpatchable-function-entry=N,M: M of them)


@dataclass(frozen=True)
class FtraceSite:
    site: int             # the probe address: the function's entry, after any endbr64
    table: str            # the table that records it
    entry: int            # the address of its entry in that table


def table_entries(image, name: str) -> list[tuple[int, int]]:
    """(entry address, recorded value) of every entry of the sections called `name`."""
    raw_entries: dict[int, int] = {}
    for s in image.sections:
        if s.name != name or s.type == 8 or not s.size:     # SHT_NOBITS: nothing recorded
            continue
        raw = image.data[s.offset:s.offset + s.size]
        for i in range(0, len(raw) - 7, 8):
            raw_entries[s.addr + i] = int.from_bytes(raw[i:i + 8], "little")
    if raw_entries and image.is_pic:        # the loader writes the addend of the relocation
        for _, r_offset, addend in image.relative_relocations():
            if r_offset in raw_entries:
                raw_entries[r_offset] = addend
    return sorted((a, v) for a, v in raw_entries.items() if v)


def _function_entry(image, arch, addr: int, nop1: bytes) -> int | None:
    """The probe address of the function entry that `addr` records: a function's
    start (or its landing pad's end), or the start that a run of the smallest nops from
    `addr` reaches (the padding before a symbol); None if neither."""
    f = image.function_at(addr)
    if f is not None and addr in (f.start, arch.optprobe.adjust_kprobe_addr(image, f.start, 0)):
        return arch.optprobe.adjust_kprobe_addr(image, f.start, 0)
    if f is None and image.is_code(addr):
        pad = image.read(addr, MAX_PADDING)
        n = len(nop1)
        for k in range(0, len(pad) - n + 1, n):
            if pad[k:k + n] != nop1:
                break
            g = image.function_at(addr + k + n)
            if g is not None and g.start == addr + k + n:
                return arch.optprobe.adjust_kprobe_addr(image, g.start, 0)
    return None


def is_site(image, arch, addr: int, nop1: bytes) -> bool:
    """One 5-byte nop, or exactly five one-byte nops, at addr, inside its function."""
    f = image.function_at(addr)
    size = len(arch.FTRACE_NOP)
    if f is None or addr + size > f.end:
        return False
    code = image.read(addr, size + len(nop1))
    if code[:size] == arch.FTRACE_NOP:
        return True
    return code[:size] == nop1 * (size // len(nop1)) and code[size:] != nop1


def sites(image, arch) -> dict[int, FtraceSite]:
    """Probe address -> its ftrace site, from both tables."""
    nop1 = arch.NOP1
    if nop1 is None or not arch.FTRACE_NOP:
        return {}
    out: dict[int, FtraceSite] = {}
    for table in TABLES:
        for entry, value in table_entries(image, table):
            site = _function_entry(image, arch, value, nop1)
            if site is not None and site not in out and is_site(image, arch, site, nop1):
                out[site] = FtraceSite(site, table, entry)
    return out


def inside_sites(image, arch, found: dict[int, FtraceSite]) -> list[BlacklistEntry]:
    """The bytes after a site's first (arch_check_ftrace_location()): a probe there
    would sit inside the jump that takes the site."""
    out = []
    for s in found.values():
        f = image.function_at(s.site)
        name = f.name if f.start == s.site else f"{f.name}+{s.site - f.start:#x}"
        out.append(BlacklistEntry(s.site + 1, s.site + len(arch.FTRACE_NOP), name, "inside an ftrace site"))
    return out
