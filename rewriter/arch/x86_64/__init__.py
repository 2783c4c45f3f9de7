"""x86-64: decode, optimizer checks and emission (the arch/x86/kernel/kprobes/ of kprewrite).
The package is the arch.base.Arch of x86-64."""
from ..base import Refusal  # noqa: F401
from . import emit, handler_abi, jumptable, kprobe_xol, optprobe, retprobe  # noqa: F401
from . import fetchregs as fetch_regs  # noqa: F401
from .decode import decode_function  # noqa: F401

name = "x86_64"
e_machine = 62                  # EM_X86_64
r_relative = 8                  # R_X86_64_RELATIVE
r_got_slot = (6, 7)             # R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT
breakpoint = b"\xcc"            # int3
JUMP_SIZE = 5                   # jmp rel32: what an optimized probe writes


def is_branch(insn) -> bool:
    """A branch: a detour's copy of it goes elsewhere, so no post_handler can follow it."""
    return insn.info.emulate in ("jmp rel", "jcc rel", "call rel", "jmp mem", "jmp reg", "call mem", "call reg")


FTRACE_NOP = b"\x0f\x1f\x44\x00\x00"     # the 5-byte nop an ftrace site holds when not tracing


def ftrace_site_insn(addr: int):
    """The DCR of a probe on an ftrace site (KPROBE_FLAG_FTRACE): the site as the
    nop it is when not traced, whatever the file holds (call __fentry__)."""
    from ..base import DcrInsn
    from .insn import classify
    return DcrInsn(addr, FTRACE_NOP, classify(FTRACE_NOP, addr))
