"""FETCHARGS on x86-64: the register names of struct pt_regs (regs_query_register_offset()),
their offsets (from the runtime's C header, via asm-offsets), $stackN's bound and the
default fetch type (BITS_PER_LONG)."""
from . import offsets

PT_REGS = ["r15", "r14", "r13", "r12", "bp", "bx", "r11", "r10", "r9", "r8", "ax", "cx", "dx",
           "si", "di", "orig_ax", "ip", "cs", "flags", "sp", "ss"]


def __getattr__(name: str):
    """REG_OFFSET (register name -> byte offset in struct pt_regs), at first use."""
    if name == "REG_OFFSET":
        globals()[name] = value = {n: getattr(offsets, "PT_" + n.upper()) for n in PT_REGS}
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
REGS_HINT = "x86-64 names: ax bx cx dx si di bp sp r8-r15 ip flags cs ss orig_ax"
PARAM_MAX_STACK = 16384 // 8       # THREAD_SIZE / sizeof(long)
DEFAULT_TYPE = "x64"               # BITS_PER_LONG
# DWARF register numbers (the psABI's) -> these names, for probes by variable name (perfprobe)
DWARF_REGS = {0: "ax", 1: "dx", 2: "cx", 3: "bx", 4: "si", 5: "di", 6: "bp", 7: "sp",
              **{n: f"r{n}" for n in range(8, 16)}}
# DWARF registers fetch args cannot read, named in errors ("'x' is not available ... in %xmm0")
DWARF_REG_NAMES = {**{17 + n: f"xmm{n}" for n in range(16)}, **{33 + n: f"st{n}" for n in range(8)}}
# The first six integer or pointer arguments at a function's entry (the psABI's, and the
# kernel's: regs_get_kernel_argument()), for kernel probes by parameter name (perfprobe/btfprobe.py)
ARG_REGS = ("di", "si", "dx", "cx", "r8", "r9")
