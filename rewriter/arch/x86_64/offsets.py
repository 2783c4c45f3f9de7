"""The layouts the emitted code reads directly: struct kprobe, kretprobe,
kretprobe_instance, kp_thread, kp_kret_thread and pt_regs, and the runtime's
constants beside them, from its C headers (runtime/kp_asm_offsets.c and
runtime/arch/x86_64/kp_asm_offsets.c, compiled by link.asm_offsets(): the
kernel's asm-offsets).  Read at first use, not at import: importing the back end
compiles nothing.  `offsets.KPROBE_SIZE`, `offsets.PT_REGS`... (emit.py's names)."""
from __future__ import annotations

import functools

# struct pt_regs (arch/x86/include/asm/ptrace.h): the general registers, in save order.
PT_REG_NAMES = ("r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8",
                "rax", "rcx", "rdx", "rsi", "rdi")
# x86 register numbers (ModRM, REX): rax..r15.
REG_NUMBERS = ("rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi",
               "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15")


@functools.cache
def values() -> dict:
    """NAME -> value of every DEFINE of the kp_asm_offsets.c files, and the derived tables."""
    from ... import link
    v = dict(link.asm_offsets(__package__.rpartition(".")[2]))
    # struct pt_regs byte offset of each general register (rbp: PT_BP, r8: PT_R8).
    v["PT_REGS"] = {reg: v["PT_" + (reg if reg[1].isdigit() else reg[1:]).upper()] for reg in PT_REG_NAMES}
    # struct pt_regs word index of each x86 register number.
    v["PT_REGS_INDEX"] = [v["PT_SP"] // 8 if r == "rsp" else v["PT_REGS"][r] // 8 for r in REG_NUMBERS]
    return v


def __getattr__(name: str):
    # Only a DEFINE's name (upper case) compiles: not what the import machinery asks (__path__).
    if not name.isupper() or name not in values():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = values()[name]
    globals()[name] = value         # read once
    return value
