"""Breakpoint probes for AArch64: arch/arm64/kernel/probes/kprobes.c's
arch_prepare_kprobe(), done at rewrite time.

A breakpoint probe writes `brk #0x004` (KPROBES_BRK_IMM) over the probed
instruction.  The runtime's SIGTRAP handler (runtime/arch/aarch64/kp_brk.c)
runs the pre_handlers, then the instruction, as decode-insn.c sorts it:

* simulate -- simulate-insn.c: b, bl, b.cond, cbz/cbnz, tbz/tbnz, adr, adrp,
  ldr/ldrsw literal, br, blr, ret are done by the trap handler from a small
  per-site descriptor (kind, target, register, condition); no slot;
* single-step -- the rest: the copy in an out-of-line slot followed by
  `brk #0x006` (KPROBES_BRK_SS_IMM); the trap there runs the post_handlers and
  resumes at the next instruction (kprobes_post_process_ss()).

There is no boost (the kernel has none on arm64 either).  The slots live in the
output's own code segment (the kernel's XOL area, allocated at rewrite time).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..base import EMULATE, SINGLESTEP, DcrInsn, XolSlot
from . import encode as E
from . import insn as I

MODE_CODE = {EMULATE: 1, SINGLESTEP: 3}
KPROBES_BRK_IMM, KPROBES_BRK_SS_IMM = 0x004, 0x006
BRK = E.brk(KPROBES_BRK_IMM)
BRK_SS = E.brk(KPROBES_BRK_SS_IMM)

# Simulated kinds (numbers shared with runtime/arch/aarch64/kp_brk.h).
KIND = {I.B: 1, I.BL: 2, I.BCOND: 3, I.CBZ: 4, I.TBZ: 5, I.ADR: 6, I.ADRP: 6, I.LDR_LIT: 7,
        I.LDRSW_LIT: 8, I.BR: 9, I.BLR: 10, I.RET: 11}


@dataclass
class Xol:
    """How one breakpoint site runs its probed instruction (plan data: where its slot
    goes is the layout's XolSlot, from place_slot())."""
    mode: str
    insn: DcrInsn
    kind: int = 0          # simulate: KIND
    target: int = 0        # simulate: the PC-relative address (link-time)
    rt: int = 0            # simulate: the register (destination, tested, or branched through)
    cond: int = 0          # b.cond condition; cbnz/tbnz: 1
    sf: int = 0            # cbz: 64-bit; ldr literal: 8 bytes
    bit: int = 0           # tbz: the tested bit

    @property
    def next_ip(self) -> int:
        return self.insn.addr + 4


def emulates_refused(image, addr: int) -> bool:
    """Whether we simulate an instruction can_probe() refuses: none (the kernel's list)."""
    return False


def prepare(image, addr: int, ss_breakpoint: bool = False, boost: bool = True) -> Xol:
    """arch_prepare_kprobe() for one address (can_probe() has already passed).
    Single-stepped copies always end with a brk (ss_breakpoint is what arm64 does anyway);
    arm64 boosts nothing, so `boost` changes nothing."""
    code = bytes(image.read(addr, 4))
    info = I.classify(code, addr)
    insn = DcrInsn(addr, code, info)
    if info.kind:
        return Xol(EMULATE, insn, kind=KIND[info.kind], target=info.target or 0, rt=info.rt, cond=info.cond,
                   sf=info.sf, bit=info.bit)
    return Xol(SINGLESTEP, insn)


def slot_code(x: Xol, site_index: int, with_post: bool, at: int, post_entry: int, desc: int = 0) -> bytes:
    """The slot of a single-stepped site at `at`: the copy (a non-PC-relative
    instruction runs the same anywhere), then brk #0x006."""
    return x.insn.code + BRK_SS


def place_slot(x: Xol, site_index: int, with_post: bool, at: int, desc: int = 0) -> XolSlot:
    """The slot laid out at `at` (get_insn_slot()): the copy, and the brk #0x006 after it
    (its single-step end)."""
    return XolSlot(at, len(slot_code(x, site_index, with_post, at, 0, desc)), at + 4, at + 4, desc)


NO_SLOT = XolSlot(0, 0, 0)      # a simulated site's: the trap handler does its work


# The descriptor table (emit/breakpoints.py) asks these.
TABLE_INCLUDES = ("#include <kp_brk.h>",)
# No brk site: one descriptor no address matches (kp_nbreakpoints 1), so the SIGTRAP handler is
# still installed for a detour's slow resume (optprobe_entry.S's kp_optprobe_resume_regs traps).
EMPTY_DESCRIPTOR = "  { ~0UL, 0, 0, 0, 0, 0, 0 },"
SS_BREAKPOINT_SPAN = False            # a single-stepped copy ends with brk #0x006, looked up by its end


def descriptor(s, x: Xol, slot: XolSlot) -> str:
    """Site s's row of kp_breakpoints[] (struct kp_breakpoint_site, runtime/arch/aarch64/kp_arch.h)."""
    return (f"  {{ {s.addr:#x}UL, {slot.addr:#x}UL, {slot.ss_end:#x}UL, {x.target:#x}UL, {s.index}, "
            f"{int.from_bytes(x.insn.code, 'little'):#x}, {MODE_CODE[x.mode]}, {x.kind}, {x.cond}, {x.rt}, "
            f"{x.bit}, {x.sf}, {s.kret_hook}, {int(s.with_post)}, {int(x.mode != EMULATE and not s.kret_hook)} }},")
