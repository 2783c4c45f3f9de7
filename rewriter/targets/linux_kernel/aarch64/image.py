"""The arm64 kernel's boot image (``arch/arm64/boot/Image``, Debian's ``vmlinuz``): read, and
seen as the ELF vmlinux the kernel target reads.

The Image is the kernel's bytes from ``_text`` on, uncompressed, with a 64-byte header
(``arch/arm64/kernel/head.S``, ``Documentation/arm64/booting.rst``)::

    0x00 code0 (u32; an EFI stub's "MZ")   0x04 code1 (u32)
    0x08 text_offset (u64)                  0x10 image_size (u64, _end - _text)
    0x18 flags (u64: bit 0 big-endian, bits 1-2 page size, bit 3 placement)
    0x20 res2, res3, res4 (u64)             0x38 magic "ARM\\x64" (u32)
    0x3c res5 (u32; the PE header's offset with an EFI stub)

It holds no link address and no symbols.  What gives them:

- the kernel relocates itself (``__relocate_kernel``): its ``R_AARCH64_RELATIVE`` table
  (24-byte ``Elf64_Rela``, ``__rela_start`` .. ``__rela_end``, in the init data) is in the
  Image, and the places it relocates hold zero in the file (the kernel is linked with
  ``--no-apply-dynamic-relocs``); it is found as the longest run of such entries;
- kallsyms (kallsyms.py's search, which needs no address) gives the names with offsets from
  ``kallsyms_relative_base``, itself a relocated place: the table entry that relocates it
  gives its value and, from the place's file offset, the link address of ``_text``;
- ``_stext``, ``_etext``, ``_sinittext`` and ``_einittext`` (text symbols in kallsyms,
  ``CONFIG_KALLSYMS_ALL`` or not) bound the sections made for the view;
- the tables the rules read that are lists of pointers, hence relocated: the ftrace sites
  (``__patchable_function_entries``, ``-fpatchable-function-entry=2``: the first of a
  function's two NOPs) and the NOKPROBE_SYMBOL list (``_kprobe_blacklist``), found among the
  runs of relocated places in the init data (see ``_pointer_tables``), or by their symbols in
  a System.map.

The view (``elf_view()``) is an ELF executable (EM_AARCH64, one PT_LOAD at ``_text``) of the
Image's bytes with the relocations applied as the kernel applies them at its link address,
and sections for the ranges above; nothing of it is written out.
"""
from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass, field

from rewriter.errors import KprewriteError

from .. import kallsyms as _ks

MAGIC = b"ARM\x64"
MAGIC_OFFSET = 0x38
HEADER = struct.Struct("<IIQQQQQQII")
R_AARCH64_RELATIVE = 1027
_RELA_INFO = struct.pack("<Q", R_AARCH64_RELATIVE)
RELA = struct.Struct("<QQq")
# The ftrace site of a function: its two NOPs (-fpatchable-function-entry=2).
FTRACE_SITE = 8
# NOKPROBE_SYMBOL(get_kprobe), in kernel/kprobes.c since 3.16: the blacklist found must list it.
BLACKLIST_ANCHOR = "get_kprobe"
EM_AARCH64 = 183


@dataclass
class ElfVmlinux:
    """An ELF vmlinux (Debian's linux-image-*-dbg) read as the Image it is objcopy'd into
    (arch/arm64/boot/Makefile: `objcopy -O binary`): its PT_LOADs' file bytes at their
    addresses from the first, gaps zero.  The Image's bytes go back to the same places."""
    data: bytes
    loads: list[tuple[int, int, int]]       # (p_offset, p_vaddr, p_filesz) of each PT_LOAD

    def image(self) -> bytes:
        base = min(v for _, v, _ in self.loads)
        out = bytearray(max(v + n for _, v, n in self.loads) - base)
        for off, v, n in self.loads:
            out[v - base:v - base + n] = self.data[off:off + n]
        return bytes(out)

    def write(self, image: bytes, sections=()) -> bytes:
        """The ELF with the (rewritten) Image's bytes in its PT_LOADs, and a section header for
        each of `sections` ((name, address, size): new code between the ELF's sections, which
        `objcopy -O binary` would drop as a gap: the Image made from this ELF must hold it).
        The new headers and names go at the end of the file: a copy of the section header
        table with them appended, and of .shstrtab with their names."""
        base = min(v for _, v, _ in self.loads)
        out = bytearray(self.data)
        for off, v, n in self.loads:
            out[off:off + n] = image[v - base:v - base + n]
        if not sections:
            return bytes(out)
        shoff, = struct.unpack_from("<Q", out, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", out, 0x3A)
        if shentsize != 64 or not 0 < shstrndx < shnum or shoff + 64 * shnum > len(out):
            raise KprewriteError("the ELF vmlinux's section headers are not as kprewrite reads them")
        table = bytearray(out[shoff:shoff + 64 * shnum])
        str_off, str_size = struct.unpack_from("<QQ", table, 64 * shstrndx + 0x18)
        names = bytearray(out[str_off:str_off + str_size])
        for name, addr, size in sections:
            off = next((o + addr - v for o, v, n in self.loads if v <= addr and addr + size <= v + n), None)
            if off is None:
                raise KprewriteError(f"{name} at {addr:#x} is not in a PT_LOAD of the ELF vmlinux")
            # sh_name, SHT_PROGBITS, SHF_ALLOC | SHF_EXECINSTR, addr, offset, size, link, info, align, entsize
            table += struct.pack("<IIQQQQIIQQ", len(names), 1, 6, addr, off, size, 0, 0, 4, 0)
            names += name.encode() + b"\0"
        out += bytes(-len(out) % 8)
        new_str = len(out)
        out += names + bytes(-len(names) % 8)
        struct.pack_into("<QQ", table, 64 * shstrndx + 0x18, new_str, len(names))
        new_shoff = len(out)
        out += table
        struct.pack_into("<Q", out, 0x28, new_shoff)
        struct.pack_into("<H", out, 0x3C, shnum + len(sections))
        return bytes(out)


def elf_vmlinux(data: bytes, path: str) -> ElfVmlinux | None:
    """An arm64 ELF vmlinux's PT_LOADs (an ELF64 little-endian EM_AARCH64 executable linked in
    the upper half whose first loaded byte is an Image header), else None."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    e_type, e_machine = struct.unpack_from("<HH", data, 16)
    if e_machine != EM_AARCH64 or e_type not in (2, 3):
        return None
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    if phentsize != 56 or phoff + phnum * 56 > len(data):
        raise KprewriteError(f"{path}: its program headers ({phnum} at {phoff:#x}) run past the end of the file")
    loads = []
    for i in range(phnum):
        p_type, _flags, off, vaddr, _pa, filesz, _memsz, _align = struct.unpack_from("<IIQQQQQQ", data, phoff + 56 * i)
        if p_type == 1 and filesz:
            if off + filesz > len(data):
                raise KprewriteError(f"{path}: PT_LOAD {i} ({filesz:#x} bytes at {off:#x}) runs past the end of the file")
            loads.append((off, vaddr, filesz))
    if not loads or min(v for _, v, _ in loads) < 1 << 63:
        return None
    e = ElfVmlinux(data, loads)
    base = min(v for _, v, _ in loads)
    first = next(off for off, v, _ in loads if v == base)
    if data[first + MAGIC_OFFSET:first + MAGIC_OFFSET + 4] != MAGIC:
        return None
    if max(v + n for _, v, n in loads) - base > 1 << 31:
        raise KprewriteError(f"{path}: its PT_LOADs span more than 2 GiB: not an arm64 vmlinux kprewrite reads")
    return e


def is_image(data: bytes) -> bool:
    return len(data) >= 64 and data[MAGIC_OFFSET:MAGIC_OFFSET + 4] == MAGIC


@dataclass
class ArmImage:
    """An arm64 Image, read: its header, relocations, symbols and the view's ranges."""
    path: str
    data: bytes
    text_offset: int
    image_size: int
    flags: int
    pe_offset: int
    text: int                               # link address of _text (the Image's first byte)
    relas: list[tuple[int, int]]            # (place, value) of every R_AARCH64_RELATIVE
    rela_span: tuple[int, int]              # file offsets of the table
    kallsyms: _ks.Kallsyms
    syms: dict[str, int]                    # first address of each name
    tables: dict[str, tuple[int, int]] = field(default_factory=dict)   # name -> [start, end) addresses
    btf: tuple[int, int] | None = None      # file offsets of the BTF, if any
    vmlinux: bytes = b""
    elf: "ElfVmlinux | None" = None         # read from an ELF vmlinux (-dbg): written back into it

    @property
    def relocs(self):        # what the x86 container calls its KASLR table (none here: see relas)
        return None

    def describe(self) -> dict:
        return {"format": "arm64 Image", "text": f"{self.text:#x}", "image_size": self.image_size,
                "file_size": len(self.data), "flags": self.flags, "relocations": len(self.relas),
                "symbols": len(self.kallsyms.symbols),
                "tables": {k: f"{a:#x}..{b:#x}" for k, (a, b) in sorted(self.tables.items())}}


def parse(data: bytes, path: str) -> ArmImage:
    if not is_image(data):
        raise KprewriteError(f"{path}: not an arm64 Image (no magic ARM\\x64 at {MAGIC_OFFSET:#x})")
    code0, code1, text_offset, image_size, flags, _r2, _r3, _r4, _magic, pe = HEADER.unpack_from(data, 0)
    if flags & 1:
        raise KprewriteError(f"{path}: a big-endian arm64 Image (flags {flags:#x}); kprewrite reads little-endian kernels")
    if (flags >> 1) & 3 not in (0, 1):
        raise KprewriteError(f"{path}: an arm64 Image built for {(16, 64)[((flags >> 1) & 3) - 2]} KiB pages "
                             f"(flags {flags:#x}); kprewrite knows 4 KiB-page kernels")
    if image_size < len(data) or image_size > 1 << 31:
        raise KprewriteError(f"{path}: arm64 Image header gives image_size {image_size:#x} for a file of "
                             f"{len(data):#x} bytes")
    lo, hi = _rela_table(data, path)
    try:
        tok = _ks._find_tokens(data, 0, len(data))
        nm = _ks._find_names(data, tok[2], 0, tok[0]) if tok else None
    except _ks._Budget as e:
        raise KprewriteError(f"{path}: no kallsyms tables found: {e}; give its symbols with --system-map")
    if nm is None:
        raise KprewriteError(f"{path}: no kallsyms tables found (a kernel without CONFIG_KALLSYMS?); "
                             f"give its symbols with --system-map")
    x = nm[0]
    base_slot = x - 8                       # kallsyms_relative_base, before kallsyms_num_syms
    raw = [RELA.unpack_from(data, o) for o in range(lo, hi, 24)]
    # The entry relocating the slot: its place is _text + the slot's offset (_text is 64 KiB
    # aligned, in the kernel half) and every place of the table lies in the image.
    pmin, pmax = min(r[0] for r in raw), max(r[0] for r in raw)
    found = set()
    for place, _info, value in raw:
        cand = place - base_slot
        value &= (1 << 64) - 1
        if cand & 0xFFFF == 0 and cand >= 1 << 63 and cand <= pmin and pmax < cand + image_size \
                and cand <= value < cand + len(data) and value & 0xFFF == 0:
            found.add(cand)
    text = found.pop() if len(found) == 1 else None
    if text is None:
        raise KprewriteError(f"{path}: no relocation of kallsyms_relative_base (file offset {base_slot:#x}): "
                             "the Image's link address is unknown")
    relas = []
    for place, _info, value in raw:
        value &= (1 << 64) - 1
        if not text <= place < text + image_size - 7 or place & 7:
            raise KprewriteError(f"{path}: relocation at file offset {lo:#x}+ places {place:#x} outside the image")
        relas.append((place, value))
    buf = bytearray(data)
    for place, value in relas:
        off = place - text
        if off + 8 <= len(buf):
            struct.pack_into("<Q", buf, off, value)
    tok_at, index_at, tokens = tok
    count, names, entries = nm[1], nm[2], nm[3]
    relbase = struct.unpack_from("<Q", buf, base_slot)[0]
    o = base_slot - _ks._align(4 * count, 8)
    offsets = struct.unpack_from(f"<{count}i", buf, o)
    addrs, percpu = _ks._decode_offsets(offsets, relbase)
    syms = []
    for (pos, n), addr in zip(entries, addrs):
        full = b"".join(tokens[c] for c in data[pos:pos + n])
        syms.append(_ks.KSym(addr, chr(full[0]), full[1:].decode("latin-1")))
    ks = _ks.Kallsyms(syms, _ks.KallsymsTables(
        layout="offsets-first (<= 6.3), relocated base", num_syms=text + x, names=text + names,
        markers=text + nm[4], marker_size=nm[5], token_table=text + tok_at, token_index=text + index_at,
        offsets=text + o, relative_base=relbase, addresses=None, absolute_percpu=percpu))
    first: dict[str, int] = {}
    for s in syms:
        first.setdefault(s.name, s.addr)
    for need in ("_stext", "_etext", "_sinittext", "_einittext"):
        if need not in first:
            raise KprewriteError(f"{path}: kallsyms has no {need}: not a layout kprewrite knows")
    img = ArmImage(path, data, text_offset, image_size, flags, pe, text, relas, (lo, hi), ks, first)
    img.tables = _pointer_tables(img)
    img.btf = _btf(data, first["_etext"] - text, first["_sinittext"] - text)
    img.vmlinux = elf_view(img, bytes(buf))
    return img


BTF_HEADER = struct.Struct("<HBBIIIII")         # magic 0xeb9f, version 1, flags, hdr_len, type_off/len, str_off/len


def _btf(data: bytes, lo: int, hi: int) -> tuple[int, int] | None:
    """File offsets [start, end) of the kernel's BTF (CONFIG_DEBUG_INFO_BTF: __start_BTF, in
    the rodata), found by its header: the first in [lo, hi) whose sizes fit."""
    pos = data.find(b"\x9f\xeb\x01\x00\x18\x00\x00\x00", lo, hi)
    while pos >= 0:
        _m, _v, _f, hdr, toff, tlen, soff, slen = BTF_HEADER.unpack_from(data, pos)
        end = pos + hdr + max(toff + tlen, soff + slen)
        if toff == 0 and soff == tlen and end <= hi and data[pos + hdr + soff] == 0:
            return pos, end
        pos = data.find(b"\x9f\xeb\x01\x00\x18\x00\x00\x00", pos + 1, hi)
    return None


def _rela_table(data: bytes, path: str) -> tuple[int, int]:
    """File offsets [lo, hi) of the longest run of R_AARCH64_RELATIVE entries."""
    best = (0, 0)
    pos = data.find(_RELA_INFO)
    while pos >= 0:
        if pos % 8 == 0 and pos >= 8:
            start = pos - 8
            end = start
            while end + 24 <= len(data) and data[end + 8:end + 16] == _RELA_INFO:
                end += 24
            if end - start > best[1] - best[0]:
                best = (start, end)
            pos = data.find(_RELA_INFO, max(end, pos + 8))
        else:
            pos = data.find(_RELA_INFO, pos + 1)
    if best[1] - best[0] < 24 * 64:
        raise KprewriteError(f"{path}: arm64 Image without its R_AARCH64_RELATIVE table (CONFIG_RELOCATABLE off?); "
                             "kprewrite reads relocatable kernels")
    return best


def _pointer_tables(img: ArmImage) -> dict[str, tuple[int, int]]:
    """[start, end) of ``__patchable_function_entries`` (the ftrace sites) and
    ``_kprobe_blacklist``, found among the runs of relocated 8-byte places between
    ``_einittext`` and the relocation table (the init data, where INIT_DATA puts them):

    - the ftrace sites: the longest run whose every value is a function of the text
      (each function's first NOP, in link order, init functions included);
    - the blacklist: the tail of the run holding a place whose value is ``get_kprobe``
      (NOKPROBE_SYMBOL) after the last value beyond the relocation table (the ftrace events
      and syscall metadata before it point into .data); checked to hold that anchor."""
    s = img.syms
    lo, hi = s["_einittext"], img.text + img.rela_span[0]
    data_from = img.text + img.rela_span[1]
    values = {p: v for p, v in img.relas if lo <= p < hi}
    places = sorted(values)
    text_lo, text_hi = s["_stext"], s["_etext"]
    init_lo, init_hi = s["_sinittext"], s["_einittext"]
    starts = {k.addr for k in img.kallsyms.symbols if k.type in _ks.TEXT_TYPES}

    def is_text(v):
        return text_lo <= v < text_hi or init_lo <= v < init_hi

    runs = []
    i = 0
    while i < len(places):
        j = i
        while j + 1 < len(places) and places[j + 1] == places[j] + 8:
            j += 1
        runs.append(places[i:j + 1])
        i = j + 1
    out = {}
    ftrace = [r for r in runs if len(r) >= 64 and all(is_text(values[p]) for p in r)]
    if ftrace:
        r = max(ftrace, key=len)
        if sum(values[p] in starts for p in r) * 10 >= len(r) * 9:
            out["__patchable_function_entries"] = (r[0], r[-1] + 8)
    anchor = img.syms.get(BLACKLIST_ANCHOR)
    if anchor is not None:
        for r in runs:
            if "__patchable_function_entries" in out and r[0] == out["__patchable_function_entries"][0]:
                continue
            if not any(values[p] == anchor for p in r):
                continue
            k = max((n for n, p in enumerate(r) if values[p] >= data_from), default=-1)
            tail = r[k + 1:]
            if any(values[p] == anchor for p in tail):
                out["_kprobe_blacklist"] = (tail[0], tail[-1] + 8)
                break
    return out


# --- the ELF view ----------------------------------------------------------------------------------

SHF_WRITE, SHF_ALLOC, SHF_EXECINSTR = 1, 2, 4
SHT_PROGBITS, SHT_NOBITS, SHT_STRTAB = 1, 8, 3


def _sections(img: ArmImage) -> list[tuple[str, int, int, int, int]]:
    """(name, sh_type, flags, start, end) by address, none overlapping."""
    s, t = img.syms, img.text
    file_end = t + len(img.data)
    fixed = [(".head.text", SHT_PROGBITS, SHF_ALLOC, t, s["_stext"]),
             (".text", SHT_PROGBITS, SHF_ALLOC | SHF_EXECINSTR, s["_stext"], s["_etext"])]
    if img.btf is not None:                 # .BTF inside the rodata, for the handlers' kernel types
        a, b = t + img.btf[0], t + img.btf[1]
        fixed += [(".rodata", SHT_PROGBITS, SHF_ALLOC, s["_etext"], a), (".BTF", SHT_PROGBITS, SHF_ALLOC, a, b),
                  (".rodata.1", SHT_PROGBITS, SHF_ALLOC, b, s["_sinittext"])]
    else:
        fixed.append((".rodata", SHT_PROGBITS, SHF_ALLOC, s["_etext"], s["_sinittext"]))
    fixed.append((".init.text", SHT_PROGBITS, SHF_ALLOC | SHF_EXECINSTR, s["_sinittext"], s["_einittext"]))
    tables = sorted((a, b, n) for n, (a, b) in img.tables.items())
    tables.append((t + img.rela_span[0], t + img.rela_span[1], ".rela.dyn"))
    cur = s["_einittext"]
    for a, b, n in sorted(tables):
        if a > cur:
            fixed.append((".init.data", SHT_PROGBITS, SHF_ALLOC | SHF_WRITE, cur, a))
        fixed.append((n, SHT_PROGBITS, SHF_ALLOC | SHF_WRITE, a, b))
        cur = b
    if cur < file_end:
        fixed.append((".data", SHT_PROGBITS, SHF_ALLOC | SHF_WRITE, cur, file_end))
    if t + img.image_size > file_end:
        fixed.append((".bss", SHT_NOBITS, SHF_ALLOC | SHF_WRITE, file_end, t + img.image_size))
    return [x for x in fixed if x[4] > x[3]]


def elf_view(img: ArmImage, body: bytes) -> bytes:
    """An ELF64 executable of the Image's bytes (body: relocations applied) loaded at _text."""
    secs = _sections(img)
    data_off = 0x10000                       # the body's file offset: _text's page offset 0
    names = bytearray(b"\0")
    name_at = []
    for n, *_ in secs + [(".shstrtab",)]:
        name_at.append(len(names))
        names += n.encode() + b"\0"
    strtab_off = data_off + len(body)
    shoff = (strtab_off + len(names) + 7) & ~7
    shnum = len(secs) + 2
    ehdr = struct.pack("<16sHHIQQQIHHHHHH", b"\x7fELF\x02\x01\x01" + b"\0" * 9, 2, EM_AARCH64, 1,
                       img.syms["_stext"], 64, shoff, 0, 64, 56, 1, 64, shnum, shnum - 1)
    phdr = struct.pack("<IIQQQQQQ", 1, 7, data_off, img.text, img.text, len(body), img.image_size, 0x10000)
    out = bytearray(ehdr + phdr)
    out += b"\0" * (data_off - len(out))
    out += body
    out += names
    out += b"\0" * (shoff - len(out))
    out += b"\0" * 64
    for (n, typ, flags, a, b), nat in zip(secs, name_at):
        off = data_off + (a - img.text) if typ != SHT_NOBITS else data_off + len(body)
        out += struct.pack("<IIQQQQIIQQ", nat, typ, flags, a, off, b - a, 0, 0, 8 if typ != SHT_NOBITS else 1, 0)
    out += struct.pack("<IIQQQQIIQQ", name_at[-1], SHT_STRTAB, 0, 0, strtab_off, len(names), 0, 0, 1, 0)
    return bytes(out)


def place_of(img: ArmImage, addr: int) -> int:
    """The Image file offset of a link address in its loaded bytes."""
    off = addr - img.text
    if not 0 <= off < len(img.data):
        raise KprewriteError(f"{img.path}: address {addr:#x} is not in the Image's bytes")
    return off


def relocated_places(img: ArmImage) -> list[int]:
    return sorted(p for p, _ in img.relas)


def in_relocated(img: ArmImage, lo: int, hi: int) -> bool:
    places = getattr(img, "_places", None)
    if places is None:
        places = img._places = relocated_places(img)
    i = bisect.bisect_left(places, lo - 7)
    return i < len(places) and places[i] < hi
