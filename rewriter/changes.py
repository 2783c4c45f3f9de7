"""`kprewrite diff ORIGINAL REWRITTEN`: which bytes a rewrite changed, and why.

Every changed byte of the original's file contents is attributed to what the
rewrite is known to write there: a probe site (the jump or breakpoint patched in, as
text_poke() writes an optimized or a breakpoint kprobe), a return site, a
breakpoint return hook, the ELF header fields a new segment table needs, or a
target's own change (targets/*: diff_expected(), e.g. a shared object's relocated
DT_INIT_ARRAY entry, a kernel's dropped __mcount_loc entries).  The probes come
from the rewritten image's .kprewrite.meta section.  The original's program
headers and sections must still be there, unchanged (PT_PHDR may move); what the
rewrite added is listed.  A change that nothing explains is an error.
"""
from __future__ import annotations

import bisect
import os
import struct
from dataclasses import dataclass, field

from .arch import get_arch
from .errors import KprewriteError
from .elf.image import PT_LOAD, PT_PHDR
from .report import hexaddr, read_metadata

PT_GNU_EH_FRAME = 0x6474E550

DIFF_FORMAT = "kprewrite-diff-1"
BLOCK = 1 << 16
# The ELF header fields a rewrite may change (Elf64_Ehdr offsets).
EHDR_FIELDS = [(24, 8, "e_entry"), (32, 8, "e_phoff"), (40, 8, "e_shoff"),
               (56, 2, "e_phnum"), (60, 2, "e_shnum"), (62, 2, "e_shstrndx")]
PT_NAMES = {0: "NULL", 1: "LOAD", 2: "DYNAMIC", 3: "INTERP", 4: "NOTE", 6: "PHDR", 7: "TLS",
            0x6474E550: "GNU_EH_FRAME", 0x6474E551: "GNU_STACK", 0x6474E552: "GNU_RELRO", 0x6474E553: "GNU_PROPERTY"}


@dataclass
class Expected:
    """A range of the original file the rewrite may change, and why."""
    offset: int
    size: int
    what: str                         # kprobe, kretprobe, return_site, int3_exit, branch, elf_header, program_header,
    #                                   section_names, target, added_section
    detail: str
    address: int | None = None
    probes: list[str] = field(default_factory=list)
    changed: int = 0                  # bytes of it that did change


def _phdrs(data: bytes) -> list[tuple]:
    phoff, phnum = struct.unpack_from("<Q", data, 32)[0], struct.unpack_from("<H", data, 56)[0]
    return [struct.unpack_from("<IIQQQQQQ", data, phoff + i * 56) for i in range(phnum)]


def _shdrs(data: bytes) -> list[tuple]:
    shoff, shnum, shstrndx = struct.unpack_from("<Q", data, 40)[0], *struct.unpack_from("<HH", data, 60)
    if not shoff:
        return []
    raw = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * 64) for i in range(shnum)]
    if shstrndx >= len(raw):
        return []
    stroff = raw[shstrndx][4]
    out = []
    for h in raw:
        end = data.index(b"\0", stroff + h[0])
        out.append((data[stroff + h[0]:end].decode(errors="replace"), *h[1:]))
    return out


def _changed_runs(a: bytes, b: bytes) -> list[tuple[int, int]]:
    """[start, end) file offsets where b differs from a, over a's length."""
    runs = []
    n = len(a)
    for blk in range(0, n, BLOCK):
        x, y = a[blk:blk + BLOCK], b[blk:blk + BLOCK]
        if x == y:
            continue
        i = 0
        while i < len(x):
            if x[i] != y[i]:
                j = i
                while j < len(x) and x[j] != y[j]:
                    j += 1
                if runs and runs[-1][1] == blk + i:
                    runs[-1] = (runs[-1][0], blk + j)
                else:
                    runs.append((blk + i, blk + j))
                i = j
            else:
                i += 1
    return runs


def _vaddr(segments, off: int) -> int | None:
    for s in segments:
        if s.type == PT_LOAD and s.offset <= off < s.offset + s.filesz:
            return s.vaddr + off - s.offset
    return None


def _probe_ranges(orig, meta: dict) -> list[Expected]:
    out: dict[tuple, Expected] = {}

    def add(addr, end, what, detail, name):
        off = orig.offset_of(addr)
        e = out.setdefault((off, end - addr), Expected(off, end - addr, what, detail, addr))
        if name not in e.probes:
            e.probes.append(name)

    riders = []
    arch = get_arch(orig.machine)
    brk = len(arch.breakpoint)      # what a breakpoint writes (x86 int3: 1 byte; AArch64 brk: 4)
    bp = arch.breakpoint_name       # int3, brk
    for p in meta["probes"]:
        a, end = p["region"]
        label = f"{p['symbol']}+{p['offset']:#x}"
        if p.get("jump_at"):        # the ftrace site stays the kernel's; the jump follows it
            a = p["jump_at"]
            how = f"after its ftrace site: jump to detour {p['detour']:#x}"
        elif p.get("ftrace"):
            how = f"ftrace site: jump to detour {p['detour']:#x}"
        elif p.get("int3"):
            how = f"{bp} ({p['int3']})"
            end = a + brk
        else:
            how = f"jump to detour {p['detour']:#x}"
        if p.get("shared_with") is not None:     # its bytes are under its head's jump
            riders.append(p)
        else:
            add(a, end, "kprobe" if p["kind"] == "k" else "kretprobe", f"{label}: {how}", p["name"])
        if p.get("evicted"):        # the short jump's target in an evicted neighbour: both jumps
            ea, eend, edetour = p["evicted"]
            add(ea, eend, "kprobe" if p["kind"] == "k" else "kretprobe",
                f"{label}: evicted neighbour [{ea:#x}, {eend:#x}): jump to its copy at {edetour:#x}, "
                f"jump slot at {p['jump_slot']:#x}: jump to detour {p['detour']:#x}", p["name"])
        elif p.get("jump_slot"):    # the short jump's target in the padding: the jump to the detour
            add(p["jump_slot"], p["jump_slot"] + 5, "kprobe" if p["kind"] == "k" else "kretprobe",
                f"{label}: jump slot in padding: jump to detour {p['detour']:#x}", p["name"])
        for ra, rend, exit_ in p.get("return_sites") or []:
            add(ra, rend, "return_site", f"return hook of {label} (exit at {exit_:#x}): jump to detour", p["name"])
        for x in p.get("int3_exits") or []:
            add(x, x + brk, "int3_exit", f"return hook of {label} (exit at {x:#x}): {bp}", p["name"])
    for p in riders:
        for e in out.values():
            if e.address == p["shared_with"] and e.what in ("kprobe", "kretprobe") and p["name"] not in e.probes:
                e.probes.append(p["name"])
    # Direct branches to a region's start that enter its detour themselves (their rel32).
    heads = {}
    for e in out.values():
        if e.what in ("kprobe", "kretprobe", "return_site") and e.address is not None:
            heads.setdefault(e.address, e.probes)
    for src, size, target in meta.get("branches") or []:
        for name in heads.get(target) or ["?"]:
            add(src, src + size, "branch", f"direct branch to {target:#x}: enters its detour", name)
    return list(out.values())


def diff(original: str, rewritten: str, system_map: str | None = None) -> dict:
    """The attribution of every change `rewritten` makes to `original` (the
    document `diff --format json` prints); its `unattributed` list is empty when
    every change is explained."""
    from . import targets
    orig = targets.load(original)
    if orig.container is not None:      # the image is re-laid inside its container when written
        raise KprewriteError(f"{original}: diff compares ELF files; {orig.target.DIFF_REFUSAL}")
    target = orig.target
    target.load_symbols(orig, system_map)
    meta = read_metadata(rewritten)
    new = targets.load(rewritten)
    a, b = orig.data, new.data
    if len(b) < len(a):
        raise KprewriteError(f"{rewritten}: shorter than {original}: not a rewrite of it")
    problems: list[dict] = []

    # Program headers: every original one kept as it was (PT_PHDR may move); the rest are added.
    old_ph, new_ph = _phdrs(a), _phdrs(b)
    moved, grown, remaining = [], [], list(new_ph)
    phdr_entries = []                  # (index, how) of original program headers rewritten in place
    for i, ph in enumerate(old_ph):
        # A PT_LOAD grown over the padding after it (a kernel's data in its rodata/data gap):
        # the same segment but for filesz and memsz.
        bigger = next((q for q in remaining if q[0] == PT_LOAD and q[:5] == ph[:5] and q[7] == ph[7]
                       and q[5] >= ph[5] and q[6] >= ph[6]), None) if ph[0] == PT_LOAD else None
        if ph in remaining:
            remaining.remove(ph)
        elif ph[0] == PT_PHDR and any(q[0] == PT_PHDR for q in remaining):
            q = next(q for q in remaining if q[0] == PT_PHDR)
            remaining.remove(q)
            moved.append({"segment": "PHDR", "from": hexaddr(ph[3]), "to": hexaddr(q[3])})
        elif ph[0] == PT_GNU_EH_FRAME and any(q[0] == PT_GNU_EH_FRAME for q in remaining):
            # A user ELF's unwind table, rewritten to cover the new code too (targets/linux_user/unwind.py).
            q = next(q for q in remaining if q[0] == PT_GNU_EH_FRAME)
            remaining.remove(q)
            moved.append({"segment": "GNU_EH_FRAME", "from": hexaddr(ph[3]), "to": hexaddr(q[3])})
        elif bigger is not None:
            remaining.remove(bigger)
            grown.append({"segment": "LOAD", "address": hexaddr(ph[3]), "filesz": [ph[5], bigger[5]],
                          "memsz": [ph[6], bigger[6]]})
            phdr_entries.append((i, f"LOAD at {ph[3]:#x} grown from {ph[5]:#x} to {bigger[5]:#x} bytes "
                                    f"over the padding after it"))
        else:
            problems.append({"what": "segment", "detail": f"{PT_NAMES.get(ph[0], hex(ph[0]))} segment at {ph[3]:#x} "
                             "of the original is missing or changed"})
    added_segments = [{"type": PT_NAMES.get(q[0], hex(q[0])), "flags": "".join(c if q[1] & m else "-" for c, m in (("R", 4), ("W", 2), ("X", 1))),
                       "offset": hexaddr(q[2]), "address": hexaddr(q[3]), "filesz": q[5], "memsz": q[6]} for q in remaining]

    # Sections: every original one kept (the name table may be rewritten); the rest are added.
    old_sh, new_sh = _shdrs(a), _shdrs(b)
    shstrndx = struct.unpack_from("<H", a, 62)[0]
    for i, sh in enumerate(old_sh):
        q = new_sh[i] if i < len(new_sh) else None
        same = q is not None and (q == sh or (i == shstrndx and q[0] == sh[0]))
        if not same:
            problems.append({"what": "section", "detail": f"section [{i}] {sh[0]} of the original is missing or changed"})
    added_sections = [{"name": q[0], "address": hexaddr(q[3]) if q[3] else None, "offset": hexaddr(q[4]), "size": q[5]}
                      for q in new_sh[len(old_sh):]]

    # What may change in the original's bytes, and why.
    expected = _probe_ranges(orig, meta)
    for off, size, name in EHDR_FIELDS:
        old, now = int.from_bytes(a[off:off + size], "little"), int.from_bytes(b[off:off + size], "little")
        expected.append(Expected(off, size, "elf_header", f"{name}: {old:#x} -> {now:#x}"))
    e_phoff = struct.unpack_from("<Q", a, 32)[0]
    for i, how in phdr_entries:
        if struct.unpack_from("<Q", b, 32)[0] == e_phoff:     # the table rewritten where it was
            expected.append(Expected(e_phoff + i * 56, 56, "program_header", how))
    if old_sh and shstrndx < len(old_sh):
        sh = old_sh[shstrndx]
        expected.append(Expected(struct.unpack_from("<Q", a, 40)[0] + shstrndx * 64, 64, "section_names",
                                 f"{sh[0]} header: the section name table, moved to hold the new names"))
    for off, size, detail in target.diff_expected(orig, meta):
        expected.append(Expected(off, size, "target", detail, _vaddr(orig.segments, off)))
    for q in new_sh[len(old_sh):]:
        if q[1] != 8 and q[4] < len(a) and q[5]:      # an added section inside the original's bytes (a kernel's gap)
            overlaps = [sh[0] for sh in old_sh if sh[1] not in (0, 8) and sh[4] < q[4] + q[5] and q[4] < sh[4] + sh[5]]
            if overlaps:
                problems.append({"what": "section", "detail": f"added section {q[0]} overlaps {', '.join(overlaps)}"})
            else:
                expected.append(Expected(q[4], min(q[5], len(a) - q[4]), "added_section",
                                         f"{q[0]}: new code or data in a gap of the original", q[3] or None))

    # Attribute each changed byte.
    expected.sort(key=lambda e: (e.offset, -e.size))
    starts = [e.offset for e in expected]
    unattributed = []
    for lo, hi in _changed_runs(a, b):
        pos = lo
        while pos < hi:
            i = bisect.bisect_right(starts, pos) - 1
            hit = None
            for j in range(max(0, i - 8), min(len(expected), i + 2)):   # ranges rarely overlap
                e = expected[j]
                if e.offset <= pos < e.offset + e.size:
                    hit = e
                    break
            if hit is not None:
                end = min(hi, hit.offset + hit.size)
                hit.changed += end - pos
                pos = end
                continue
            nxt = bisect.bisect_right(starts, pos)
            end = min(hi, starts[nxt]) if nxt < len(starts) else hi
            va = _vaddr(orig.segments, pos)
            unattributed.append({"offset": hexaddr(pos), "address": hexaddr(va), "size": end - pos,
                                 "symbol": _where(orig, va)})
            pos = end
    changes = [{"what": e.what, "offset": hexaddr(e.offset), "address": hexaddr(e.address), "size": e.size,
                "changed": e.changed, "probes": e.probes, "detail": e.detail}
               for e in expected if e.changed]
    return {"format": DIFF_FORMAT, "original": os.path.basename(original), "rewritten": rewritten,
            "changes": changes, "moved": moved, "grown": grown, "added_segments": added_segments, "added_sections": added_sections,
            "unattributed": unattributed, "problems": problems}


def _where(image, va: int | None) -> str | None:
    if va is None:
        return None
    f = image.function_at(va)
    return None if f is None else f"{f.name}+{va - f.start:#x}"


def diff_lines(doc: dict) -> list[str]:
    """The text form: one line per explained change, added segment and section."""
    out = []
    for c in doc["changes"]:
        where = c["address"] or f"file {c['offset']}"
        probes = f"  [{', '.join(c['probes'])}]" if c["probes"] else ""
        out.append(f"changed  {where}  {c['changed']:>5} bytes  {c['what']}  {c['detail']}{probes}")
    for m in doc["moved"]:
        out.append(f"moved    {m['segment']}  {m['from']} -> {m['to']}")
    for g in doc["grown"]:
        out.append(f"grown    {g['segment']}  {g['address']}  filesz {g['filesz'][0]:#x} -> {g['filesz'][1]:#x}"
                   f"  memsz {g['memsz'][0]:#x} -> {g['memsz'][1]:#x}")
    for s in doc["added_segments"]:
        out.append(f"added    segment {s['type']} {s['flags']}  {s['address']}  filesz {s['filesz']:#x}  memsz {s['memsz']:#x}")
    for s in doc["added_sections"]:
        out.append(f"added    section {s['name']}  {s['address'] or '-'}  size {s['size']:#x}")
    return out


def diff_errors(doc: dict, rewritten: str) -> list[str]:
    """One line per change nothing explains."""
    out = [f"{rewritten}: {p['detail']}" for p in doc["problems"]]
    for u in doc["unattributed"]:
        where = f"{u['address']}" + (f" ({u['symbol']})" if u["symbol"] else "") if u["address"] else "outside any segment"
        out.append(f"{rewritten}: {u['size']} changed bytes at file offset {u['offset']}, {where}, "
                   "not attributed to any probe site or known rewrite")
    return out
