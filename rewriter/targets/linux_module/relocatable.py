"""A kernel module (.ko, ET_REL) seen as the module loader lays it out, whatever the CPU.

A relocatable object has no addresses: every section starts at 0 and every
reference between them is a relocation the module loader applies at insmod
(layout_sections(), then apply_relocate_add()).  The rest of the pipeline reads
images by address, so the module is given one: its SHF_ALLOC sections laid out
one after another from the architecture's module area (its relocatable.py's
MODULE_BASE), each at its own alignment, and the relocations against the module's
own symbols applied as the loader would (its relocatable.py's apply()).
References to the kernel (undefined symbols: calls of kernel functions, the ftrace
and return-thunk symbols) go to a stand-in address per symbol outside the module
(its KERNEL_STAND_IN: 16 bytes of its STAND_IN_FILL each, a FUNC symbol of the view,
in a section added last, STAND_IN_SECTION), so that a tail call leaves the function
for a function's start, as it does once loaded.

view() returns the bytes of an ET_EXEC ELF with that layout: the same sections,
in the same order and at the same indices (so symbol section indices stay
valid), symbol values made addresses, one PT_LOAD over them all.  The
ModuleObject it comes with keeps the original bytes and the address of each
section, which the writer needs to go back from addresses to section offsets.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ...elf.view import ElfView, Section
from ...errors import KprewriteError

STAND_IN_SECTION = ".kprewrite.kernel_symbols"
# Bound on the laid-out size (.bss included; the biggest Debian modules are tens of MiB).
MAX_MODULE = 256 << 20
ET_REL, ET_EXEC = 1, 2
SHT_SYMTAB, SHT_RELA, SHT_NOBITS = 2, 4, 8
SHF_WRITE, SHF_ALLOC, SHF_EXECINSTR = 1, 2, 4
SHN_LORESERVE = 0xFF00
THIS_MODULE = ".gnu.linkonce.this_module"

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_PHDR = struct.Struct("<IIQQQQQQ")
_SYM = struct.Struct("<IBBHQQ")
RELA = struct.Struct("<QQq")     # Elf64_Rela


def relas(data, r):
    """Each Elf64_Rela of the SHT_RELA section r: (its file offset, r_offset, symbol
    index, type, addend), as ELF64_R_SYM/ELF64_R_TYPE split r_info."""
    for j in range(r.size // RELA.size):
        at = r.offset + j * RELA.size
        off, info, addend = RELA.unpack_from(data, at)
        yield at, off, info >> 32, info & 0xFFFFFFFF, addend


@dataclass
class ModuleObject:
    """The container of a module's view: the .ko's own bytes and layout."""
    KERNEL_MODULE = True                   # linux_module.detect()
    data: bytes
    path: str
    sections: list[Section]
    addr: dict[int, int] = field(default_factory=dict)     # section index -> its address in the view
    stand_in: tuple[int, int] = (0, 0)     # [start, end) of the kernel symbols' stand-ins
    symvers: dict | None = None            # the kernel's symbol CRCs (symvers.py), when found
    symvers_path: str | None = None
    relocs: dict | None = None             # the .ko's relocations by section (optprobe.relocations()), once read
    event_layout: tuple | None = None      # kernel_btf.event_layout(), once read

    def section_named(self, name: str) -> Section | None:
        return next((s for s in self.sections if s.name == name), None)

    def place(self, addr: int) -> tuple[Section, int] | None:
        """(section, offset in it) of a view address."""
        for s in self.sections:
            a = self.addr.get(s.index)
            if a is not None and a <= addr < a + max(s.size, 1):
                return s, addr - a
        return None


def read_sections(data: bytes, path: str) -> list[Section]:
    """The module's section headers (index 0 included), read by the ELF view (bounds checked,
    a one-line error naming the file)."""
    return ElfView(data, path).sections


def layout(sections: list[Section], base: int) -> dict[int, int]:
    """Each SHF_ALLOC section's address: one after another from base (the module area), in
    section order, each at its alignment."""
    addr, pos = {}, base
    for s in sections:
        if s.flags & SHF_ALLOC and s.index:
            a = max(s.align, 1)
            pos = (pos + a - 1) // a * a
            addr[s.index] = pos
            pos += s.size
    return addr


def symbols(data: bytes, sections: list[Section]) -> tuple[Section, list[tuple]]:
    symtab = next((s for s in sections if s.type == SHT_SYMTAB), None)
    if symtab is None:
        return None, []
    return symtab, [_SYM.unpack_from(data, symtab.offset + i * _SYM.size) for i in range(symtab.size // _SYM.size)]


def view(data: bytes, path: str, arch) -> tuple[bytes, ModuleObject]:
    """(the ET_EXEC view's bytes, the ModuleObject) of a module's bytes; arch: the
    architecture's relocatable module (MODULE_BASE, KERNEL_STAND_IN, STAND_IN_FILL,
    field_size(), apply())."""
    MODULE_BASE, KERNEL_STAND_IN = arch.MODULE_BASE, arch.KERNEL_STAND_IN
    secs = read_sections(data, path)
    addr = layout(secs, MODULE_BASE)
    mod = ModuleObject(data, path, secs, addr)
    # The file: ELF header, program headers, then the allocated sections at offset
    # (addr - MODULE_BASE + body), then the others, then the section headers.
    alloc = [s for s in secs if s.index in addr]
    nph = 1 if alloc else 0
    body = (_EHDR.size + (nph + 1) * _PHDR.size + 0xFFF) & ~0xFFF
    end = max((addr[s.index] + s.size for s in alloc), default=MODULE_BASE)
    if end - MODULE_BASE > MAX_MODULE:
        raise KprewriteError(f"{path}: the module's sections take {end - MODULE_BASE:#x} bytes laid out "
                             f"(more than {MAX_MODULE >> 20} MiB): not a module the loader would take")
    out = bytearray(body + (end - MODULE_BASE))
    offsets = {}
    for s in alloc:
        off = body + addr[s.index] - MODULE_BASE
        offsets[s.index] = off
        if s.type != SHT_NOBITS:
            out[off:off + s.size] = data[s.offset:s.offset + s.size]
    shstrndx = _EHDR.unpack_from(data, 0)[13]
    sizes = {}
    for s in secs:
        if s.index and s.index not in addr and s.type != SHT_NOBITS:
            while len(out) % max(s.align, 1):
                out.append(0)
            offsets[s.index] = len(out)
            out += data[s.offset:s.offset + s.size]
            if s.index == shstrndx:
                stand_in_name = s.size
                out += STAND_IN_SECTION.encode() + b"\0"
                sizes[s.index] = s.size + len(STAND_IN_SECTION) + 1
    symtab, syms = symbols(data, secs)
    if symtab is None:
        raise KprewriteError(f"{path}: a module without .symtab (stripped) cannot be rewritten")
    # The kernel's symbols, each a 16-byte stand-in function (of the architecture's traps) in a
    # section of their own (index len(secs)) outside the module.
    undefined = [i for i, (name, info, _, shndx, _, _) in enumerate(syms) if i and shndx == 0 and name]
    stand_in_size = 16 * (max(undefined, default=0) + 1)
    mod.stand_in = (KERNEL_STAND_IN, KERNEL_STAND_IN + stand_in_size)
    while len(out) % 16:
        out.append(0)
    stand_in_off = len(out)
    out += arch.STAND_IN_FILL * (stand_in_size // len(arch.STAND_IN_FILL))

    def value(i):
        _, _, _, shndx, v, _ = syms[i]
        if 0 < shndx < SHN_LORESERVE and shndx in addr:
            return addr[shndx] + v
        if shndx == 0 and i:
            return KERNEL_STAND_IN + 16 * i     # the kernel's: somewhere outside the module
        return None

    # Symbol values become addresses.
    so = offsets[symtab.index]
    for i, (name, info, other, shndx, v, size) in enumerate(syms):
        a = value(i)
        if i in undefined:
            _SYM.pack_into(out, so + i * _SYM.size, name, (info & 0xF0) | 2, other, len(secs), a, 16)
        elif a is not None:
            struct.pack_into("<Q", out, so + i * _SYM.size + 8, a)
    # Relocations against the module's own symbols, applied as apply_relocate_add() does.
    for r in secs:
        if r.type != SHT_RELA or r.info not in addr or secs[r.info].type == SHT_NOBITS:
            continue
        base, toff = addr[r.info], offsets[r.info]
        for j, (_, off, sym, typ, addend) in enumerate(relas(data, r)):
            if sym >= len(syms) or off + arch.field_size(typ) > secs[r.info].size:
                raise KprewriteError(f"{path}: relocation {j} of {r.name} is out of range")
            s = value(sym)
            if s is None:
                continue                    # absolute or common symbols: none in modules
            arch.apply(out, toff + off, typ, s + addend, base + off)
    # One PT_LOAD over the whole layout, as the loader's allocation is one mapping
    # (reads near a section's end go on into the next, as in memory).
    if nph:
        _PHDR.pack_into(out, _EHDR.size, 1, 7, body, MODULE_BASE, MODULE_BASE, end - MODULE_BASE,
                        end - MODULE_BASE, 0x1000)
    _PHDR.pack_into(out, _EHDR.size + nph * _PHDR.size, 1, 5, stand_in_off, KERNEL_STAND_IN, KERNEL_STAND_IN,
                    stand_in_size, stand_in_size, 16)
    # Section headers, each at its new offset and address.
    while len(out) % 8:
        out.append(0)
    shoff = len(out)
    for s in secs:
        out += _SHDR.pack(_name_offset(data, s), s.type, s.flags, addr.get(s.index, 0),
                          offsets.get(s.index, 0 if s.type != SHT_NOBITS else body + addr.get(s.index, MODULE_BASE)
                                      - MODULE_BASE),
                          sizes.get(s.index, s.size), s.link, s.info, s.align, s.entsize)
    out += _SHDR.pack(stand_in_name, 1, SHF_ALLOC | SHF_EXECINSTR, KERNEL_STAND_IN, stand_in_off, stand_in_size,
                      0, 0, 16, 0)
    e = list(_EHDR.unpack_from(data, 0))
    e[1], e[4], e[5], e[6], e[9], e[10], e[12] = ET_EXEC, 0, _EHDR.size, shoff, _PHDR.size, nph + 1, len(secs) + 1
    _EHDR.pack_into(out, 0, *e)
    return bytes(out), mod


def _name_offset(data: bytes, s: Section) -> int:
    e = _EHDR.unpack_from(data, 0)
    return struct.unpack_from("<I", data, e[6] + s.index * e[11])[0]
