"""A kernel module (.ko) seen as x86-64's module loader lays it out (the view itself is
../relocatable.py's): the module area, the kernel symbols' stand-ins (int3s) and the
relocations apply_relocate_add() applies (arch/x86/kernel/module.c)."""
from __future__ import annotations

import struct
import sys

from ..relocatable import (RELA, SHN_LORESERVE, SHT_RELA, SHT_NOBITS, SHT_SYMTAB, STAND_IN_SECTION,  # noqa: F401
                           THIS_MODULE, ModuleObject, read_sections, relas, symbols)
from .. import relocatable as _generic

MODULE_BASE = 0xFFFFFFFFC0000000      # MODULES_VADDR on x86-64 (no KASLR)
# Where the view puts the kernel's symbols a module refers to (undefined in the .ko):
# one stand-in address each, in the kernel text's range, so a call or a jump to one
# (a tail call, `jmp __x86_return_thunk`) leaves the function as it does once loaded.
KERNEL_STAND_IN = 0xFFFFFFFF81000000
STAND_IN_FILL = b"\xcc"               # int3

# x86-64 relocation types the module loader applies (arch/x86/kernel/module.c)
R_X86_64_64, R_X86_64_PC32, R_X86_64_32, R_X86_64_32S, R_X86_64_PLT32, R_X86_64_PC64 = 1, 2, 10, 11, 4, 24


def field_size(typ: int) -> int:
    return 8 if typ in (R_X86_64_64, R_X86_64_PC64) else 4


def apply(out: bytearray, at: int, typ: int, v: int, p: int) -> None:
    """One relocation (S + A = v, at place p) into out at `at`, as apply_relocate_add() does."""
    if typ == R_X86_64_64:
        struct.pack_into("<Q", out, at, v & (1 << 64) - 1)
    elif typ in (R_X86_64_PC32, R_X86_64_PLT32):
        struct.pack_into("<i", out, at, v - p)
    elif typ == R_X86_64_32S:
        struct.pack_into("<i", out, at, v - (1 << 64) if v >= 1 << 63 else v)
    elif typ == R_X86_64_32:
        struct.pack_into("<I", out, at, v & 0xFFFFFFFF)
    elif typ == R_X86_64_PC64:
        struct.pack_into("<q", out, at, v - p)


def view(data: bytes, path: str):
    """(the ET_EXEC view's bytes, the ModuleObject) of an x86-64 module (../relocatable.py)."""
    return _generic.view(data, path, sys.modules[__name__])
