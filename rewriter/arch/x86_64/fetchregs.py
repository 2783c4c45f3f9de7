"""FETCHARGS on x86-64: the register names of struct pt_regs (regs_query_register_offset()),
their offsets (from the runtime's C header, via asm-offsets), $stackN's bound and the
default fetch type (BITS_PER_LONG)."""
from ... import link

PT_REGS = ["r15", "r14", "r13", "r12", "bp", "bx", "r11", "r10", "r9", "r8", "ax", "cx", "dx",
           "si", "di", "orig_ax", "ip", "cs", "flags", "sp", "ss"]
REG_OFFSET = {name: link.asm_offsets()["PT_" + name.upper()] for name in PT_REGS}
REGS_HINT = "x86-64 names: ax bx cx dx si di bp sp r8-r15 ip flags cs ss orig_ax"
PARAM_MAX_STACK = 16384 // 8       # THREAD_SIZE / sizeof(long)
DEFAULT_TYPE = "x64"               # BITS_PER_LONG
