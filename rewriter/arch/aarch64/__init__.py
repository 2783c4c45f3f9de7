"""AArch64: decode, probe checks and emission (the arch/arm64/kernel/probes/ of
kprewrite).  The package is the arch.base.Arch of AArch64."""
from ..base import DcrInsn, FtraceSiteInsn, Refusal, ThreadKey  # noqa: F401
from . import emit, handler_abi, kprobe_xol, optprobe, retprobe, toolchain  # noqa: F401
from . import fetchregs as fetch_regs  # noqa: F401
from . import insn as _insn
from .decode import decode_function  # noqa: F401

name = "aarch64"
e_machine = 183                 # EM_AARCH64
r_relative = 1027               # R_AARCH64_RELATIVE
r_got_slot = (1025, 1026)       # R_AARCH64_GLOB_DAT, R_AARCH64_JUMP_SLOT
r_irelative = 1032              # R_AARCH64_IRELATIVE
breakpoint = kprobe_xol.BRK          # brk #0x004 (KPROBES_BRK_IMM)
breakpoint_name = "brk"         # what diff calls it
JUMP_SIZE = 4                   # B imm26: what an optimized probe writes
JUMP_REACH = 1 << 27            # +-128 MiB
FAR_FALLBACK = True             # a site out of reach is a brk (reach.py), not a stop
NOP1 = _insn.NOP.to_bytes(4, "little")     # what -fpatchable-function-entry pads with
FTRACE_NOP = NOP1               # an ftrace site is one nop, as long as the B that takes it
# The thread pointer (TPIDR_EL0) is the running thread's own: the key is the
# pointer itself (runtime/arch/aarch64/linux_user), not a word it points at.
USER_THREAD_KEY = ThreadKey("thread", 0)
jumptable = None                # br's targets are not read yet: a function with one is not optimized around it


def is_branch(insn) -> bool:
    """A branch: a detour's copy of it goes elsewhere, so no post_handler can follow it."""
    return insn.info.kind in _insn.BRANCHES


def signal_syscalls(image, analysis) -> list:
    """The system calls setting a signal mask or action (x86-64: sigcalls.py): not
    looked for yet (`svc #0` with the number in x8); a blocked SIGTRAP still kills a
    program at its next breakpoint probe (docs/int3.md)."""
    return []


def direct_branch_target(insn) -> int | None:
    """Where a b, bl, b.cond, cbz or tbz goes (None: not one)."""
    return insn.info.target if insn.info.kind in _insn.DIRECT else None


def with_branch_target(insn, target: int):
    """insn, a direct branch, naming `target` instead (emit.relocate() encodes it)."""
    return emit.with_target(insn, target)


def ftrace_site_insn(addr: int):
    """The DCR of a probe on an ftrace site: the nop it holds when not traced."""
    return FtraceSiteInsn(addr, FTRACE_NOP, _insn.classify(FTRACE_NOP, addr))
