"""A kernel module (.ko) seen as arm64's module loader lays it out (the view itself is
../relocatable.py's): the module area, the kernel symbols' stand-ins (brk) and the
relocations apply_relocate_add() applies (arch/arm64/kernel/module.c: reloc_data(),
reloc_insn_imm(), reloc_insn_adrp()), at the view's addresses."""
from __future__ import annotations

import struct
import sys

from ..relocatable import (RELA, SHN_LORESERVE, SHT_RELA, THIS_MODULE, ModuleObject,  # noqa: F401
                           read_sections, relas, symbols)
from .. import relocatable as _generic

# MODULES_VADDR on arm64 with 48-bit virtual addresses (6.1: the 128 MiB below the kernel's
# image, KIMAGE_VADDR = 0xffff800008000000).
MODULE_BASE = 0xFFFF800000000000
# The kernel symbols' stand-ins just below the module (within a branch's reach both ways), not
# above it where the kernel is: what lies past the view's last segment is where the planner
# reaches new code from (arch/aarch64/reach.py), and a module's new code is its own section,
# which the loader lays out beside its text (a B beyond reach goes through a module PLT entry).
KERNEL_STAND_IN = 0xFFFF7FFFFF000000
STAND_IN_FILL = struct.pack("<I", 0xD4200000)     # brk #0

# The relocation types (ELF for the Arm 64-bit Architecture) Debian's modules carry.
R_AARCH64_NONE = 0
R_AARCH64_ABS64, R_AARCH64_ABS32, R_AARCH64_PREL64, R_AARCH64_PREL32 = 257, 258, 260, 261
R_AARCH64_LD_PREL_LO19, R_AARCH64_ADR_PREL_LO21 = 273, 274
R_AARCH64_ADR_PREL_PG_HI21, R_AARCH64_ADR_PREL_PG_HI21_NC, R_AARCH64_ADD_ABS_LO12_NC = 275, 276, 277
R_AARCH64_TSTBR14, R_AARCH64_CONDBR19, R_AARCH64_JUMP26, R_AARCH64_CALL26 = 279, 280, 282, 283
# The LDST*_ABS_LO12_NC: the low 12 bits scaled by the access size.
LDST_SHIFT = {278: 0, 284: 1, 285: 2, 286: 3, 299: 4}
NAMES = {0: "R_AARCH64_NONE", 257: "R_AARCH64_ABS64", 258: "R_AARCH64_ABS32", 260: "R_AARCH64_PREL64",
         261: "R_AARCH64_PREL32", 273: "R_AARCH64_LD_PREL_LO19", 274: "R_AARCH64_ADR_PREL_LO21",
         275: "R_AARCH64_ADR_PREL_PG_HI21", 276: "R_AARCH64_ADR_PREL_PG_HI21_NC",
         277: "R_AARCH64_ADD_ABS_LO12_NC", 278: "R_AARCH64_LDST8_ABS_LO12_NC", 279: "R_AARCH64_TSTBR14",
         280: "R_AARCH64_CONDBR19", 282: "R_AARCH64_JUMP26", 283: "R_AARCH64_CALL26",
         284: "R_AARCH64_LDST16_ABS_LO12_NC", 285: "R_AARCH64_LDST32_ABS_LO12_NC",
         286: "R_AARCH64_LDST64_ABS_LO12_NC", 299: "R_AARCH64_LDST128_ABS_LO12_NC"}


def field_size(typ: int) -> int:
    return 8 if typ in (R_AARCH64_ABS64, R_AARCH64_PREL64) else 4


def _imm(out: bytearray, at: int, lsb: int, bits: int, value: int) -> None:
    w = struct.unpack_from("<I", out, at)[0]
    mask = ((1 << bits) - 1) << lsb
    struct.pack_into("<I", out, at, (w & ~mask) | ((value << lsb) & mask))


def apply(out: bytearray, at: int, typ: int, v: int, p: int) -> None:
    """One relocation (S + A = v, at place p) into out at `at`, as apply_relocate_add() does."""
    m64 = (1 << 64) - 1
    if typ == R_AARCH64_ABS64:
        struct.pack_into("<Q", out, at, v & m64)
    elif typ == R_AARCH64_ABS32:
        struct.pack_into("<I", out, at, v & 0xFFFFFFFF)
    elif typ == R_AARCH64_PREL64:
        struct.pack_into("<Q", out, at, (v - p) & m64)
    elif typ == R_AARCH64_PREL32:
        struct.pack_into("<I", out, at, (v - p) & 0xFFFFFFFF)
    elif typ in (R_AARCH64_JUMP26, R_AARCH64_CALL26):
        _imm(out, at, 0, 26, (v - p) >> 2)
    elif typ == R_AARCH64_CONDBR19 or typ == R_AARCH64_LD_PREL_LO19:
        _imm(out, at, 5, 19, (v - p) >> 2)
    elif typ == R_AARCH64_TSTBR14:
        _imm(out, at, 5, 14, (v - p) >> 2)
    elif typ in (R_AARCH64_ADR_PREL_PG_HI21, R_AARCH64_ADR_PREL_PG_HI21_NC, R_AARCH64_ADR_PREL_LO21):
        d = (v - p) if typ == R_AARCH64_ADR_PREL_LO21 else ((v & ~0xFFF) - (p & ~0xFFF)) >> 12
        _imm(out, at, 29, 2, d & 3)
        _imm(out, at, 5, 19, d >> 2)
    elif typ == R_AARCH64_ADD_ABS_LO12_NC:
        _imm(out, at, 10, 12, v & 0xFFF)
    elif typ in LDST_SHIFT:
        _imm(out, at, 10, 12, (v & 0xFFF) >> LDST_SHIFT[typ])


def view(data: bytes, path: str):
    """(the ET_EXEC view's bytes, the ModuleObject) of an arm64 module (../relocatable.py)."""
    return _generic.view(data, path, sys.modules[__name__])
