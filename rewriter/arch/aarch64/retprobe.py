"""Return sites of a function and their return hooks (AArch64).

As on x86-64 (x86_64/retprobe.py; the walk is planner/exits.py's, for
both), every exit of a probed function is hooked
instead of swapping the return address: each `ret` (after `autiasp`, so x30
already holds the authenticated return address) and each tail-call `b` to
another function's start.  x30 is never replaced at entry; only a tail call to
a function whose returns are not hooked swaps it for the trampoline (the
kernel's way, for that path only: kp_kretprobe_tail_swap()), and a function
whose exits cannot all be named (a conditional branch or a `br` leaving it)
falls back to the trampoline.

An exit is one instruction, as long as the `B` that takes it: the return
region is the exit alone.  Its detour calls the runtime's hook
(kretprobe_entry.S: pt_regs as after the ret, pc the return address in x30, sp
unchanged), then runs the exit itself (a `ret`, or the relocated `b`)."""
from __future__ import annotations

import struct

from ..base import COND, RET, TAIL, DcrInsn, Exit, Refusal
from . import emit as em
from . import encode as E
from . import insn as I
from . import reach
from ... import safety

# DWARF register 31 is sp: where a call (bl/blr) lands the CFA is sp itself, the
# return address in x30, nothing pushed yet.
_DWARF_SP = 31

# What kret_entry_body's form writes besides the entry_handler's own (it saves everything).
KRET_ENTRY_USES: tuple[str, ...] = ()


def entry_frame_refusal(image, addr: int) -> Refusal | None:
    """As on x86-64 (x86_64/retprobe.py), beyond the kernel: is `addr` a place a
    call lands?  There the FDE's rule is CFA = sp + 0 (bl pushes nothing).  A
    block with an FDE of its own that starts mid-frame (a stripped cold part) has
    no return address in x30 of its own.  Where no FDE covers addr (or the rule
    is an expression) nothing is known and nothing is refused."""
    rule = image.cfa.at(addr)
    if rule is None or rule == (_DWARF_SP, 0) or not safety.enabled("entry_frame"):
        return None
    reg, off = rule
    where = f"{'sp' if reg == _DWARF_SP else f'x{reg}'}{off:+d}"
    return Refusal("entry_frame", addr, f"the CFA at {addr:#x} is {where} (its FDE), not sp+0: entered "
                                        "mid-frame (as a cold part of a larger function is), x30 is not its return address")


def trampoline_refusal(image, analysis, func, parts, exits) -> Refusal | None:
    """Where the return-address trampoline would be wrong for `func` (x86_64/
    retprobe.py reads the CFA rules for it).  Not analysed here yet: None, the
    trampoline, as AArch64 kretprobes took it before the check existed."""
    return None


# --- the generic exit walk's questions (planner/exits.py) ---------------------------------

JUMP_WORD = "branch"


def exits_refusal(image, func) -> Refusal | None:
    """A function out of a `B`'s reach of the new code (reach.py): no exit can branch
    to a hook; the trampoline, as x30 brings the return, not a `B`."""
    return reach.refusal(image, func.start, "a B to a return hook")


def unknown_exits(image, analysis, part) -> Refusal | None:
    """A `br` (jump tables are not read on AArch64: arch.jumptable is None): the exits are unknown."""
    d = analysis.decoded(part)
    if d.indirect_jump is None:
        return None
    return Refusal("indirect_jump", d.indirect_jump, f"{part.name} has an indirect branch (br): its exits are unknown")


def exit_insn(image, analysis, part, addr: int) -> DcrInsn:
    code = bytes(image.read(addr, 4))
    return DcrInsn(addr, code, I.classify(code, addr))


def exit_kind(insn: DcrInsn):
    """`ret` (through x30; another register is refused with `ret_register`): a return;
    `b`: a tail call's branch; `b.cond`, `cbz`/`cbnz`, `tbz`/`tbnz`: conditional."""
    info = insn.info
    if info.kind == I.RET:
        if info.rt != 30:
            return Refusal("ret_register", insn.addr, f"ret through x{info.rt}, not x30")
        return RET, None
    if info.target is None:
        return None
    return (TAIL if info.kind == I.B else COND), info.target


def mid_frame_part(image, func) -> bool:
    """Not followed on AArch64: a `B` to a stripped cold part's start is taken as a
    tail call (its x30 swap catches the part's `ret`); a `B` into its middle is `jump_out`."""
    return False


def exit_region(image, analysis, part, exit: Exit, busy) -> tuple[list[DcrInsn], int] | Refusal:
    """The exit alone (a B is as long): (its instruction, region end)."""
    end = exit.addr + 4
    if busy(exit.addr, end):
        return Refusal("probe_in_region", exit.addr, f"another probe overlaps the return region [{exit.addr:#x}, {end:#x})")
    return [exit.insn], end


def hook_then_exit(exit: DcrInsn, hook, at: int) -> bytes:
    """The return hook (the runtime's, through the same stub as an optprobe's:
    x16 and x30 kept on the stack), then the exit itself.  hook = (hook entry,
    unused jmp form), or a function (exit, at) -> code (full_ret_hook)."""
    if callable(hook):
        return hook(exit, at)
    out = em.probe_stub(0, hook[0], at)
    return out + em.relocate(exit, at + len(out))


def ret_detour(dcr: list[DcrInsn], hook, at: int) -> bytes:
    """Detour of a return site: the DCR up to the exit (nothing here), the hook, the exit."""
    out = bytearray()
    for insn in dcr[:-1]:
        out += em.relocate(insn, at + len(out))
    out += hook_then_exit(dcr[-1], hook, at + len(out))
    return bytes(out)


def hook_copy(hooks):
    """How a kprobe's detour copies an exit of a return-probed function (a kprobe
    on a ret): the exit calls its return hook first."""
    def copy(insn, pos):
        if insn.addr in hooks:
            return hook_then_exit(insn, hooks[insn.addr], pos)
        return em.relocate(insn, pos)
    return copy


def kret_entry_body(*, rp: int, tramp: int, entry_handler: int | None, enter_c: int,
                    aligned: bool, inline: bool = True, regs: bool = False) -> bytes:
    """Not inlined on aarch64 yet: the trampoline's address, which tells the entry
    detour where the runtime's generic kretprobe entry dispatch is (emit._kret_entry())."""
    return struct.pack("<Q", tramp)


def clean_ret_hook(exit: DcrInsn, at: int, *, fast: int, table: int, key, rp: int,
                   handler: int | None, return_c: int, full_hook, aligned: bool, handler_clobbers) -> bytes:
    """Not inlined on aarch64 yet: the shared hook with pt_regs."""
    return hook_then_exit(exit, full_hook, at)


def full_ret_hook(exit: DcrInsn, at: int, *, fast: int, table: int, key, rp: int,
                  handler: int | None, return_c: int, aligned: bool) -> bytes:
    """pt_regs as after the ret, kp_kretprobe_return(regs) in line, then the exit."""
    out = em.regs_call(at, return_c, None, None, pc_is_lr=True)
    return out + em.relocate(exit, at + len(out))
