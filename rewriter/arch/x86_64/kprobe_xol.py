"""INT3 fallback probes for x86-64: arch/x86/kernel/kprobes/core.c's
arch_prepare_kprobe(), done at rewrite time.

A breakpoint probe puts 0xcc on the first byte of the probed instruction.  The
runtime's SIGTRAP handler runs the pre_handlers, then the instruction runs "out
of line", in the kernel's order of preference:

* emulate -- prepare_emulation(): call/jmp/jcc rel, loop/jcxz, ret, call/jmp
  through a register are done by the trap handler from a small per-site
  descriptor (kind, target, condition, size); no slot;
* boost -- can_boost(): the copied instruction (RIP-relative operand fixed, as
  __copy_instruction()) followed by a jmp back, so a hit costs one trap.  Where
  the site has a post_handler, the same post stub as a detour's sits between
  the copy and the jmp back (the kernel does not boost then; we can, for free);
* single-step -- the rest: the copy, run with the trap flag set; the SIGTRAP
  after it runs the post_handlers and resumes at the next instruction
  (resume_singlestep()).  A jmp back follows the copy as a safety net.  Where
  the target says so (Rules.singlestep_breakpoint: a kernel), an int3 follows the
  copy instead of TF, as the kernel's own kprobes do since 5.14 (the #DB path
  is not ours to hook); the trap at it is found by the copy's end address.

Every slot lives in the output's own code segment (the kernel's XOL area /
insn_slot, but allocated at rewrite time).
"""
from __future__ import annotations

from dataclasses import dataclass

import capstone

from . import emit as em
from . import insn as x86insn
from ..base import BOOST, EMULATE, SINGLESTEP, DcrInsn, XolSlot
from . import cs, offsets

MODE_CODE = {EMULATE: 1, BOOST: 2, SINGLESTEP: 3}

# Emulated kinds (numbers shared with runtime/arch/x86_64/kp_int3.c).
K_JMP, K_CALL, K_JCC, K_LOOP, K_JCXZ, K_RET, K_JMP_REG, K_CALL_REG, K_XBEGIN = 1, 2, 3, 4, 5, 6, 7, 8, 9
K_JMP_MEM, K_CALL_MEM = 10, 11
NO_REG = 0xFF
_KIND = {"jmp rel": K_JMP, "call rel": K_CALL, "jcc rel": K_JCC, "loop": K_LOOP, "jcxz": K_JCXZ,
         "ret": K_RET, "ret imm": K_RET, "jmp reg": K_JMP_REG, "call reg": K_CALL_REG}

# struct pt_regs word index of each x86 register number (rax..r15), from the C
# header: offsets.PT_REGS_INDEX, read at first use.
_REG_NUMBER = {n: i for i, n in enumerate(["rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi",
                                           "r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15"])}
_csd = cs.DETAIL


@dataclass
class Xol:
    """How one breakpoint site runs its probed instruction (plan data: where its slot
    goes is the layout's XolSlot, from place_slot())."""
    mode: str
    insn: DcrInsn
    kind: int = 0          # emulate: K_*
    target: int = 0        # emulate: branch target (link-time)
    cc: int = 0            # emulate: jcc condition / loop variant (0 loopne, 1 loope, 2 loop)
    reg: int = 0           # emulate: pt_regs word index for call/jmp through a register
    imm: int = 0           # emulate: ret imm16
    addr32: int = 0        # emulate: loop/jcxz with an address-size prefix use ecx
    index: int = NO_REG    # emulate, through memory: index register (pt_regs word index)
    scale: int = 0         # emulate, through memory: index scale
    rip: int = 0           # emulate, through memory: target holds the absolute (link-time) address
    ss_breakpoint: bool = False  # single-step: an int3 after the copy rather than TF

    @property
    def next_ip(self) -> int:
        return self.insn.addr + len(self.insn.code)


def _prefix_end(code: bytes) -> tuple[int, int]:
    """(index of the opcode byte, REX byte or 0)."""
    i, rex = 0, 0
    while i < len(code):
        b = code[i]
        if b in x86insn.LEGACY_PREFIXES:
            rex = 0
        elif 0x40 <= b <= 0x4F:
            rex = b
        else:
            break
        i += 1
    return i, rex


def _memory_indirect(insn: DcrInsn) -> Xol | None:
    """call/jmp *mem (ff /2, ff /4): the kernel refuses them ("TODO: support memory
    addressing"); we emulate the ones with a plain 64-bit address: load the
    target from base + index * scale + disp (or RIP-relative), no fs/gs."""
    info = insn.info
    if info.probe_refused not in ("indirect call through memory", "indirect jmp through memory"):
        return None
    try:
        ci = next(_csd.disasm(insn.code, insn.addr, 1))
    except StopIteration:
        return None
    if len(ci.operands) != 1 or ci.operands[0].type != capstone.x86.X86_OP_MEM or ci.operands[0].size != 8:
        return None
    m = ci.operands[0].mem
    if m.segment and _csd.reg_name(m.segment) in ("fs", "gs"):
        return None
    kind = K_CALL_MEM if info.probe_refused.startswith("indirect call") else K_JMP_MEM
    x = Xol(EMULATE, insn, kind=kind, reg=NO_REG)
    base = _csd.reg_name(m.base) if m.base else None
    if base == "rip":
        x.rip, x.target = 1, (insn.addr + len(insn.code) + m.disp) & ((1 << 64) - 1)
        return x
    for name in (base, _csd.reg_name(m.index) if m.index else None):
        if name is not None and name not in _REG_NUMBER:
            return None         # 32-bit address registers: refused, as the kernel
    x.target = m.disp & ((1 << 64) - 1)
    if base is not None:
        x.reg = offsets.PT_REGS_INDEX[_REG_NUMBER[base]]
    if m.index:
        x.index, x.scale = offsets.PT_REGS_INDEX[_REG_NUMBER[_csd.reg_name(m.index)]], m.scale
    return x


def emulates_refused(image, addr: int) -> bool:
    """Whether we emulate an instruction the kernel's can_probe() refuses."""
    try:
        code = image.read(addr, 16)
        info = x86insn.classify(code, addr)
    except ValueError:
        return False
    return _memory_indirect(DcrInsn(addr, bytes(code[:info.length]), info)) is not None


def prepare(image, addr: int, ss_breakpoint: bool = False, boost: bool = True) -> Xol:
    """arch_prepare_kprobe() for one address (can_probe() has already passed);
    ss_breakpoint: a single-stepped copy ends with an int3 rather than running with TF;
    boost False: a boostable instruction single-stepped too (setup_singlestep() boosts
    no kprobe with a post_handler)."""
    code = image.read(addr, 16)
    info = x86insn.classify(code, addr)
    insn = DcrInsn(addr, bytes(code[:info.length]), info)
    x = _memory_indirect(insn)
    if x is not None:
        return x
    i, rex = _prefix_end(insn.code)
    prefixes = insn.code[:i]
    kind = _KIND.get(info.emulate or "")
    if kind is not None:
        x = Xol(EMULATE, insn, kind=kind, target=info.rel_target or 0)
        op = insn.code[i]
        if kind == K_JCC:
            x.cc = (insn.code[i + 1] if op == 0x0F else op) & 0x0F
        elif kind in (K_LOOP, K_JCXZ):
            x.cc = op - 0xE0
            x.addr32 = int(0x67 in prefixes)
        elif kind == K_RET and op == 0xC2:
            x.imm = int.from_bytes(insn.code[i + 1:i + 3], "little")
        elif kind in (K_JMP_REG, K_CALL_REG):
            rm = (insn.code[i + 1] & 7) | (8 if rex & 1 else 0)
            x.reg = offsets.PT_REGS_INDEX[rm]
        return x
    if info.opcode_map == 1 and insn.code[i] == 0xC7 and info.rel_target is not None:
        # xbegin: its abort target is relative, and the trap flag would abort
        # the transaction anyway.  Emulated as an immediate abort (EAX = 0, go
        # to the fallback path), which the architecture allows at any time.
        return Xol(EMULATE, insn, kind=K_XBEGIN, target=info.rel_target)
    if boost and (info.boostable or (info.opcode_map == 2 and info.opcode == 0x05)):
        # syscall is boosted in user space: with the trap flag set the kernel
        # returns through iret and the single-step trap comes one instruction
        # late (after the jmp back).  The kernel never probes a syscall insn.
        return Xol(BOOST, insn)
    return Xol(SINGLESTEP, insn, ss_breakpoint=ss_breakpoint)


def slot_code(x: Xol, site_index: int, with_post: bool, at: int, post_entry: int, desc: int = 0) -> bytes:
    """The slot of a boosted or single-stepped site at `at`: the copy, for a boosted
    one with a post_handler the probe stub, and the jmp back (an int3-ended single-step
    one's then carries desc, its descriptor's index).  Same size whatever post_entry is."""
    out = bytearray(em.relocate(x.insn, at))
    if x.mode == SINGLESTEP and x.ss_breakpoint:
        out += b"\xcc"
    if x.mode != SINGLESTEP and with_post:
        out += em.probe_stub(site_index, post_entry, at + len(out))
    pos = at + len(out)
    out += b"\xe9" + em._s32(x.next_ip - (pos + 5), "jmp back from the out-of-line slot")
    if x.mode == SINGLESTEP and x.ss_breakpoint:
        # Data, never run (the jmp is before it): the descriptor's index, so the trap at
        # the int3 finds its site without a search (kp_int3.c, kp_int3_ss_end()).
        out += desc.to_bytes(4, "little")
    return bytes(out)


def place_slot(x: Xol, site_index: int, with_post: bool, at: int, desc: int = 0) -> XolSlot:
    """The slot laid out at `at` (the insn slot's address, as get_insn_slot() gives
    it): its size, where the jmp back is, where a single-stepped copy ends."""
    copy = len(em.relocate(x.insn, at))
    size = len(slot_code(x, site_index, with_post, at, at + 0x1000000, desc))
    post = at + size - 5 - (SS_INDEX_SIZE if x.mode == SINGLESTEP and x.ss_breakpoint else 0)
    return XolSlot(at, size, post, at + copy if x.mode == SINGLESTEP else 0, desc)


SS_INDEX_SIZE = 4   # the descriptor index after an int3-ended slot's jmp back
NO_SLOT = XolSlot(0, 0, 0)      # an emulated site's: the trap handler does its work


# The descriptor table (emit/breakpoints.py) asks these.
TABLE_INCLUDES: tuple[str, ...] = ()
EMPTY_DESCRIPTOR = None         # no site: an empty table
SS_BREAKPOINT_SPAN = True             # single-stepped copies may end with an int3 (kp_breakpoint_ss_first/last)


def descriptor(s, x: Xol, slot: XolSlot) -> str:
    """Site s's row of kp_breakpoints[] (struct kp_breakpoint_site, runtime/arch/x86_64/kp_arch.h)."""
    return (f"  {{ {s.addr:#x}UL, {slot.addr:#x}UL, {slot.ss_end:#x}UL, {x.target:#x}UL, {s.index}, "
            f"{MODE_CODE[x.mode]}, {x.kind}, {x.cc}, {len(x.insn.code)}, {x.imm}, {x.reg}, {x.addr32}, "
            f"{x.index}, {x.scale}, {x.rip}, {s.kret_hook}, {int(s.with_post)}, "
            f"{int(x.mode != EMULATE and not s.kret_hook)} }},")
