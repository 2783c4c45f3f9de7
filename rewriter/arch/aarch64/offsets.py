"""The layouts the emitted AArch64 code reads directly: struct pt_regs (regs[31],
sp, pc, pstate) and the core's structures, from the runtime's C headers
(runtime/kp_asm_offsets.c and runtime/arch/aarch64/kp_asm_offsets.c, compiled
by link.asm_offsets(): the kernel's asm-offsets).  Read at first use."""
from __future__ import annotations

import functools


@functools.cache
def values() -> dict:
    """NAME -> value of every DEFINE of the kp_asm_offsets.c files."""
    from ... import link
    return dict(link.asm_offsets(__package__.rpartition(".")[2]))


def __getattr__(name: str):
    if not name.isupper() or name not in values():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = values()[name]
    globals()[name] = value
    return value
