"""DWARF EH pointer encodings and LEB128, as libgcc's read_encoded_value_with_base
reads them (see the package's docstring for the rules)."""
from __future__ import annotations

import struct

from ..view import ElfView

# --- constants ---------------------------------------------------------------
DW_EH_PE_omit = 0xFF
DW_EH_PE_indirect = 0x80
DW_EH_PE_pcrel = 0x10
DW_EH_PE_textrel = 0x20
DW_EH_PE_datarel = 0x30
DW_EH_PE_funcrel = 0x40
DW_EH_PE_aligned = 0x50
PCREL_SDATA4 = 0x1B           # what gcc/clang emit for FDE and LSDA pointers

DT_PLTGOT = 3

MASK64 = (1 << 64) - 1

_U8 = struct.Struct("<B").unpack_from
_U16 = struct.Struct("<H").unpack_from
_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from
_S16 = struct.Struct("<h").unpack_from
_S32 = struct.Struct("<i").unpack_from
_S64 = struct.Struct("<q").unpack_from
_S32_U32 = struct.Struct("<iI").unpack_from

# fixed-size formats: low nibble -> (unpack, size)
_FIXED = {
    0x00: (_U64, 8), 0x02: (_U16, 2), 0x03: (_U32, 4), 0x04: (_U64, 8),
    0x0A: (_S16, 2), 0x0B: (_S32, 4), 0x0C: (_S64, 8),
}


class _Malformed(Exception):
    """Internal: carries a reason up to the place that knows the address."""


# --- LEB128 and encoded pointers --------------------------------------------
def _uleb(d, p: int) -> tuple[int, int]:
    b = d[p]
    if b < 0x80:
        return b, p + 1
    r = b & 0x7F
    s = 7
    while True:
        p += 1
        b = d[p]
        r |= (b & 0x7F) << s
        if b < 0x80:
            return r, p + 1
        s += 7
        if s > 70:
            raise _Malformed("over-long LEB128")


def _sleb(d, p: int) -> tuple[int, int]:
    r = s = 0
    while True:
        b = d[p]
        p += 1
        r |= (b & 0x7F) << s
        s += 7
        if b < 0x80:
            if b & 0x40:
                r -= 1 << s
            return r, p
        if s > 70:
            raise _Malformed("over-long LEB128")


def _raw(d, p: int, fmt: int) -> tuple[int, int]:
    """Read the value of pointer format `fmt` (low nibble) at d[p]."""
    f = _FIXED.get(fmt)
    if f is not None:
        unpack, n = f
        return unpack(d, p)[0], p + n
    if fmt == 0x01:
        return _uleb(d, p)
    if fmt == 0x09:
        return _sleb(d, p)
    raise _Malformed(f"unknown pointer format {fmt:#x}")


class _Bases:
    """Bases of the relative pointer applications."""
    __slots__ = ("text", "data", "func")

    def __init__(self, text: int = 0, data: int = 0, func: int = 0):
        self.text, self.data, self.func = text, data, func

    @classmethod
    def of(cls, elf: ElfView) -> "_Bases":
        """textrel: the start of .text; datarel: the GOT (DT_PLTGOT, else .got.plt or .got)."""
        text = elf.section(".text")
        got = next((val for tag, val in elf.dynamic() if tag == DT_PLTGOT), 0)
        if not got:
            for name in (".got.plt", ".got"):
                s = elf.section(name)
                if s is not None:
                    got = s.addr
                    break
        return cls(text=text.addr if text is not None else 0, data=got)


def _ptr(d, p: int, enc: int, va_of_p: int, bases: _Bases) -> tuple[int, int]:
    """Decode a DW_EH_PE-encoded pointer at d[p] (va_of_p is its address).

    Returns (value, offset after the field).  The indirect bit is left to the
    caller (value is the address of the pointer then)."""
    app = enc & 0x70
    if app == DW_EH_PE_aligned:
        pad = (-va_of_p) & 7
        p += pad
        va_of_p += pad
        v, p2 = _U64(d, p)[0], p + 8
    else:
        v, p2 = _raw(d, p, enc & 0x0F)
    if v == 0:
        return 0, p2
    if app == DW_EH_PE_pcrel:
        v += va_of_p
    elif app == DW_EH_PE_datarel:
        v += bases.data
    elif app == DW_EH_PE_funcrel:
        v += bases.func
    elif app == DW_EH_PE_textrel:
        v += bases.text
    elif app not in (0x00, DW_EH_PE_aligned):
        raise _Malformed(f"unknown pointer application {app:#x}")
    return v & MASK64, p2
