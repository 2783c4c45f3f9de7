"""FETCHARGS on AArch64: the register names of struct pt_regs as the kernel's
arch/arm64/kernel/ptrace.c regoffset_table[] has them (x0..x30, sp, pc, pstate),
their offsets (from the runtime's C header, via asm-offsets), $stackN's bound and
the default fetch type.  $argN is x0..x7 then the stack, $retval x0
(regs_get_kernel_argument(), regs_return_value() in the runtime's ptrace.h)."""
from . import offsets

PT_REGS = [f"x{i}" for i in range(31)] + ["sp", "pc", "pstate"]


def _offset(name: str) -> int:
    if name[0] == "x":
        return offsets.PT_X0 + 8 * int(name[1:])
    return getattr(offsets, "PT_" + name.upper())


def __getattr__(name: str):
    """REG_OFFSET (register name -> byte offset in struct pt_regs), at first use."""
    if name == "REG_OFFSET":
        globals()[name] = value = {n: _offset(n) for n in PT_REGS}
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


REGS_HINT = "arm64 names: x0-x30 sp pc pstate"
PARAM_MAX_STACK = 16384 // 8       # THREAD_SIZE / sizeof(long)
DEFAULT_TYPE = "x64"               # BITS_PER_LONG
# DWARF register numbers (the AArch64 DWARF ABI's: x0-x30 0-30, sp 31) -> these names, for
# probes by variable name (perfprobe)
DWARF_REGS = {**{n: f"x{n}" for n in range(31)}, 31: "sp"}
# DWARF registers fetch args cannot read, named in errors ("'x' is not available ... in %v0")
DWARF_REG_NAMES = {64 + n: f"v{n}" for n in range(32)}
# The first eight integer or pointer arguments at a function's entry (AAPCS64's, and the
# kernel's regs_get_kernel_argument()), for kernel probes by parameter name (perfprobe/btfprobe.py)
ARG_REGS = tuple(f"x{n}" for n in range(8))
