"""x86-64: decode, optimizer checks and emission (the arch/x86/kernel/kprobes/ of kprewrite).
The package is the arch.base.Arch of x86-64."""
from ..base import Refusal  # noqa: F401
from . import emit, handler_abi, kprobe_xol, optprobe, retprobe  # noqa: F401
from .decode import decode_function  # noqa: F401

name = "x86_64"
runtime_arch_dir = "arch/x86_64"
e_machine = 62                  # EM_X86_64
r_relative = 8                  # R_X86_64_RELATIVE
r_got_slot = (6, 7)             # R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT
breakpoint = b"\xcc"            # int3
JUMP_SIZE = 5                   # jmp rel32: what an optimized probe writes


def is_branch(insn) -> bool:
    """A relative branch: a detour's copy of it goes elsewhere, so no post_handler can follow it."""
    return insn.info.emulate in ("jmp rel", "jcc rel", "call rel")
