"""x86-64: decode, optimizer checks and emission (the arch/x86/kernel/kprobes/ of kprewrite).
The package is the arch.base.Arch of x86-64."""
import dataclasses

from ..base import DcrInsn, FtraceSiteInsn, Refusal, ThreadKey  # noqa: F401
from . import emit, handler_abi, jumptable, kprobe_xol, optprobe, retprobe, toolchain, unwind  # noqa: F401
from . import fetchregs as fetch_regs  # noqa: F401
from .decode import decode_function  # noqa: F401
from .sigcalls import signal_syscalls  # noqa: F401

name = "x86_64"
e_machine = 62                  # EM_X86_64
r_relative = 8                  # R_X86_64_RELATIVE
r_got_slot = (6, 7)             # R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT
r_irelative = 37                # R_X86_64_IRELATIVE
breakpoint = b"\xcc"            # int3
breakpoint_name = "int3"        # what diff calls it
JUMP_SIZE = 5                   # jmp rel32: what an optimized probe writes
JUMP_REACH = 1 << 31            # rel32: +-2 GiB
NOP1 = b"\x90"                  # what -fpatchable-function-entry pads with
# The x86-64 psABI's thread control block starts with a pointer to itself
# (%fs:0): a word that is the running thread's, whatever the libc.
USER_THREAD_KEY = ThreadKey("thread", 0)
_DIRECT = ("call rel", "jmp rel", "jcc rel")


def is_branch(insn) -> bool:
    """A branch: a detour's copy of it goes elsewhere, so no post_handler can follow it."""
    return insn.info.emulate in ("jmp rel", "jcc rel", "call rel", "jmp mem", "jmp reg", "call mem", "call reg")


def direct_branch_target(insn) -> int | None:
    """Where a call, jmp or jcc rel goes (None: not one)."""
    return insn.info.rel_target if insn.info.emulate in _DIRECT else None


def with_branch_target(insn, target: int):
    """insn, a direct branch, naming `target` instead: emit.relocate() then
    encodes the copy's displacement to it."""
    return DcrInsn(insn.addr, insn.code, dataclasses.replace(insn.info, rel_target=target))


FTRACE_NOP = b"\x0f\x1f\x44\x00\x00"     # the 5-byte nop an ftrace site holds when not tracing


def ftrace_site_insn(addr: int):
    """The DCR of a probe on an ftrace site (KPROBE_FLAG_FTRACE): the site as the
    nop it is when not traced, whatever the file holds (call __fentry__)."""
    from .insn import classify
    return FtraceSiteInsn(addr, FTRACE_NOP, classify(FTRACE_NOP, addr))
