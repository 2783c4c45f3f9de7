"""AArch64's facts for the tests."""
import capstone

TRIPLE = "aarch64-linux-gnu"                         # cross gcc, binutils and sysroot (/usr/TRIPLE)
CAPSTONE = (capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)
# The first arguments' registers in the kernel's pt_regs names (kprobe_events fetch args).
ARG_REGS = ["%x0", "%x1", "%x2", "%x3"]
RETADDR = "%x30"                                     # a function entry's return address: the link register
CF_PROTECTION = "-mbranch-protection=standard"       # gcc's landing-pad flag (BTI, PAC)
# struct pt_regs' members (the handler API's ptrace.h): the return value, the first arguments.
PT_RETVAL, PT_ARGS = "regs[0]", ["regs[0]", "regs[1]", "regs[2]", "regs[3]"]
BREAKPOINT = "brk"                                   # the breakpoint instruction, as `kprewrite diff` names it
E_MACHINE = 183                                      # ELF e_machine (EM_AARCH64)
LARGE_PIC = False                                    # gcc builds -mcmodel=large with -fPIC/-fPIE
NO_FDE = {"call_weak_fn"}                            # the C runtime's functions that have no FDE (crti.o's)
UC_PC = "uc_mcontext.pc"                             # a signal handler's ucontext_t: the interrupted pc
ILLEGAL_INSN = ("udf #0", 4)                         # an instruction that raises SIGILL, and its size
DETOUR_CFI = False                                   # the rewrite's new code has unwind tables (tests/test_unwind.py)
# tests/test_ehframe.py's C++ builds whose FDE pointer encoding gcc picks otherwise than x86-64's
FDE_ENCODING = {"nopie-udata4": 0x1B, "nopie-large-absptr": 0x1C}
