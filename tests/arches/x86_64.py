"""x86-64's facts for the tests."""
import capstone

TRIPLE = "x86_64-linux-gnu"                          # cross gcc, binutils and sysroot (/usr/TRIPLE)
CAPSTONE = (capstone.CS_ARCH_X86, capstone.CS_MODE_64)
# The first arguments' registers in the kernel's pt_regs names (kprobe_events fetch args).
ARG_REGS = ["%di", "%si", "%dx", "%cx"]
RETADDR = "$stack0"                                  # a function entry's return address
CF_PROTECTION = "-fcf-protection"                    # gcc's landing-pad flag (ENDBR64)
# struct pt_regs' members (the handler API's ptrace.h): the return value, the first arguments.
PT_RETVAL, PT_ARGS = "ax", ["di", "si", "dx", "cx"]
BREAKPOINT = "int3"                                  # the breakpoint instruction, as `kprewrite diff` names it
E_MACHINE = 62                                       # ELF e_machine (EM_X86_64)
LARGE_PIC = True                                     # gcc builds -mcmodel=large with -fPIC/-fPIE
NO_FDE = set()                                       # the C runtime's functions that have no FDE
UC_PC = "uc_mcontext.gregs[REG_RIP]"                 # a signal handler's ucontext_t: the interrupted pc
ILLEGAL_INSN = ("ud2", 2)                            # an instruction that raises SIGILL, and its size
DETOUR_CFI = True                                    # the rewrite's new code has unwind tables (tests/test_unwind.py)
# tests/test_ehframe.py's C++ builds whose FDE pointer encoding gcc picks otherwise than x86-64's
FDE_ENCODING = {}
