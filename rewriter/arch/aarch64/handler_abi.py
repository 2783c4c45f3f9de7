"""What linked handler code can touch, read from its machine code (AArch64).

Not yet read as precisely as on x86-64: every handler is taken to read its
`regs` argument and to clobber every call-clobbered register, so each detour
saves a whole struct pt_regs (the kernel's own optprobe does the same).  Vector
use is read: the detours save no FP/SIMD state, so a prebuilt handler object
that touches v0-v31 is refused (C sources are compiled with
-mgeneral-regs-only, as kernel code)."""
from __future__ import annotations

import re

import capstone

_cs = capstone.Cs(capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)
_cs.detail = False
_VECTOR = re.compile(r"\b[vqdsbh]([0-9]|[12][0-9]|3[01])\b")
_VECTOR_MNEMONICS = ("fmov", "fadd", "fsub", "fmul", "fdiv", "fcmp", "scvtf", "ucvtf", "fcvt")

VECTOR_STATE = "FP/SIMD (v0-v31)"


def may_use_regs(code: bytes, start: int, end: int, relocs: dict[int, str] | None = None) -> bool:
    """The function may read its pt_regs argument (x1): always, for now."""
    return True


def regs_loads(code: bytes, start: int, end: int, relocs: dict[int, str] | None = None,
               limit: int | None = None) -> frozenset[int] | None:
    """The pt_regs fields the function loads: unknown (None), as may_use_regs()."""
    return None


def vector_use(code: bytes, start: int) -> int | None:
    """The first instruction naming an FP/SIMD register, or None."""
    for addr, _size, mnem, ops in _cs.disasm_lite(bytes(code), start):
        if mnem.startswith(_VECTOR_MNEMONICS) or _VECTOR.search(ops):
            return addr
    return None


def clobbered_scratch(code: bytes, start: int, relocs: dict[int, str] | None = None) -> set[str] | None:
    """The call-clobbered registers the function writes: unknown (None)."""
    return None
