"""Return sites of a function and their return hooks (AArch64).

As on x86-64 (x86_64/retprobe.py; the walk is planner/exits.py's, for
both), every exit of a probed function is hooked
instead of swapping the return address: each `ret` (after `autiasp`, so x30
already holds the authenticated return address) and each tail-call `b` to
another function's start.  x30 is never replaced at entry; only a tail call to
a function whose returns are not hooked swaps it for the trampoline (the
kernel's way, for that path only: kp_kretprobe_tail_swap()), and a function
whose exits cannot all be named (a conditional branch or a `br` leaving it)
falls back to the trampoline.  An exit no `B` can hook (out of reach of the new
code) takes the trampoline where trampoline_refusal() finds it safe, else a brk
return hook.  A stripped cold part is followed by its FDE (mid_frame_part()).

An exit is one instruction, as long as the `B` that takes it: the return
region is the exit alone.  Its detour calls the runtime's hook
(kretprobe_entry.S: pt_regs as after the ret, pc the return address in x30, sp
unchanged), then runs the exit itself (a `ret`, or the relocated `b`).  A `ret`
of a function with one kretprobe has the hook's common case inlined instead
(clean_ret_hook(), full_ret_hook()), as has its entry (emit.kret_entry_detour())."""
from __future__ import annotations

import dataclasses

import capstone
import capstone.arm64_const

from ..base import COND, RET, TAIL, DcrInsn, Exit, Refusal, unwinds_exceptions
from . import emit as em
from . import insn as I
from . import encode as E
from . import reach
from ... import safety

# DWARF register 31 is sp: where a call (bl/blr) lands the CFA is sp itself, the
# return address in x30, nothing pushed yet.
_DWARF_SP = 31
_DWARF_FP = 29

# What kret_entry_body's form writes besides the entry_handler's own: none to name
# (emit.kret_entry_detour() saves what it writes itself).
KRET_ENTRY_USES: tuple[str, ...] = ()
FREES_CALLERS_INLINE = False           # kretprobes, handlers: not read (x86-64's inline free)
CLEAN_ENTRY_IN_USER = False            # no kp_kretprobe_clean_entry in its user runtime


def _mid_frame(image, addr: int) -> str | None:
    """None if a call may land at `addr` as far as the unwind information says (no
    FDE covers it, or its rule is CFA = sp + 0 with x30 not saved), else what its
    rules say instead: a block of a larger function with an FDE of its own (GCC's
    hot/cold splitting, stripped of its `.cold` name) starts mid-frame, its CIE's
    initial instructions and FDE giving the parent's frame (CFA sp + N, x30 saved
    at CFA - M)."""
    rule = image.cfa.at(addr)
    if rule is None:
        return None
    ra = image.cfa.return_address(addr)
    if rule == (_DWARF_SP, 0) and ra is None:
        return None
    reg, off = rule
    where = f"the CFA at {addr:#x} is {'sp' if reg == _DWARF_SP else f'x{reg}'}{off:+d}"
    return where + (f", x30 saved at CFA{ra:+d}" if ra is not None else "")


def entry_frame_refusal(image, addr: int) -> Refusal | None:
    """As on x86-64 (x86_64/retprobe.py), beyond the kernel: is `addr` a place a
    call lands?  There the FDE's rule is CFA = sp + 0 (bl pushes nothing), x30
    not saved.  A block with an FDE of its own that starts mid-frame (a stripped
    cold part) has no return address in x30 of its own.  Where no FDE covers addr
    (or the rule is an expression) nothing is known and nothing is refused."""
    mid = _mid_frame(image, addr)
    if mid is None or not safety.enabled("entry_frame"):
        return None
    return Refusal("entry_frame", addr, f"{mid} (its FDE), not sp+0 with x30 unsaved: entered mid-frame "
                                        "(as a cold part of a larger function is), x30 is not its return address")


# Symbols of an image that unwinds exceptions through its frames (as x86_64/retprobe.py's).
_cs = capstone.Cs(capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)
_cs.detail = True
_A = capstone.arm64_const
_SIZE = {"x": 8, "w": 4, "q": 16, "d": 8, "s": 4, "h": 2, "b": 1}


def _reg_size(ci, reg: int) -> int:
    name = ci.reg_name(reg)
    return 8 if name in ("fp", "lr", "sp", "xzr") else _SIZE.get(name[0], 8)


def _fp_delta(image, parts) -> int | None:
    """CFA - x29 once the function has set its frame record's pointer (`mov x29, sp`,
    `add x29, sp, #k`; a cold part runs with its parent's), or None."""
    for part in parts:
        code = bytes(image.read(part.start, part.end - part.start))
        for a, _, m, o in _cs.disasm_lite(code, part.start):
            if m in ("mov", "add") and o.replace(" ", "").startswith("x29,sp"):
                rule = image.cfa.at(a)
                if rule is None or rule[0] != _DWARF_SP:
                    return None
                k = int(o.split("#")[1], 0) if "#" in o else 0
                return rule[1] - k
    return None


def trampoline_refusal(image, analysis, func, parts, exits) -> Refusal | None:
    """Where the return-address trampoline (the kernel's rethook, x30 swapped at
    entry) would be wrong for `func`, though cheaper than breakpoint return
    hooks, in arm64's terms: the function reads x30 while it may hold the
    return address (until a bl/blr, again after a load into x30: GCC's
    __builtin_return_address(0) in a leaf), other than to save it, or
    addresses the slot x30 is saved to (the FDE's rules at each instruction say
    where: CFA = sp or x29 + N, x30 at CFA - M) other than to save or reload x30
    there; with no rule, nothing is proven.  Or it calls out and the image
    unwinds exceptions (the unwinder would meet the trampoline, which has no
    FDE).  None: safe."""
    if not safety.enabled("trampoline_unsafe"):
        return None
    fp = _fp_delta(image, parts)
    calls = None
    for part in parts:
        code = bytes(image.read(part.start, part.end - part.start))
        end = part.start
        # Whether x30 may hold the return address here (linear order: a bl/blr
        # replaces it, a load into x30, the epilogue's reload, brings it back).
        live = True
        for ci in _cs.disasm(code, part.start):
            end = ci.address + 4
            a = ci.address
            rule = image.cfa.at(a)
            if rule is None or rule[0] not in (_DWARF_SP, _DWARF_FP):
                return Refusal("trampoline_unsafe", a, f"no CFA rule at {a:#x} says where x30 is saved, so "
                                                       "whether the function reads it is unknown")
            m = ci.mnemonic
            what = f"{m} {ci.op_str}".strip()
            reads, writes = ci.regs_access()
            ra = image.cfa.return_address(a)
            store = m.startswith("st") and _A.ARM64_REG_X30 in reads
            slots = {}
            if ra is not None:
                # The slot, from each base register the function may address it by.
                if rule[0] == _DWARF_SP:
                    slots[_A.ARM64_REG_SP] = rule[1] + ra
                    if fp is not None:
                        slots[_A.ARM64_REG_X29] = fp + ra
                else:
                    slots[_A.ARM64_REG_X29] = rule[1] + ra
            ops = list(ci.operands)
            regs = [op.reg for op in ops if op.type == _A.ARM64_OP_REG]
            saved_at_slot = False
            for op in ops:
                if op.type == _A.ARM64_OP_MEM and op.mem.base in slots and op.mem.index == 0:
                    slot, lo = slots[op.mem.base], op.mem.disp
                    for r in regs or [0]:
                        n = _reg_size(ci, r) if r else 8
                        if lo < slot + 8 and slot < lo + n:
                            if not (r == _A.ARM64_REG_X30 and lo == slot):
                                return Refusal("trampoline_unsafe", a, f"{what} at {a:#x} addresses x30's slot: "
                                                                       "it would see the trampoline")
                            saved_at_slot = True
                        lo += n
            if m in ("add", "sub") and len(ops) == 3 and ops[1].type == _A.ARM64_OP_REG \
                    and ops[1].reg in slots and ops[2].type == _A.ARM64_OP_IMM \
                    and (ops[2].imm if m == "add" else -ops[2].imm) == slots[ops[1].reg]:
                return Refusal("trampoline_unsafe", a, f"{what} at {a:#x} takes the address of x30's slot: "
                                                       "it would see the trampoline")
            if live and _A.ARM64_REG_X30 in reads and not m.startswith(("ret", "pac", "aut", "xpac", "hint")):
                # Only the save may read it: a store to the slot, or one after which
                # the rules say x30 is saved (the prologue's, before its CFI row).
                save = store and (saved_at_slot or ra is None and image.cfa.return_address(a + 4) is not None)
                if not save:
                    return Refusal("trampoline_unsafe", a, f"{what} at {a:#x} reads x30 while it holds the "
                                                           "return address: it would see the trampoline")
            if m in ("bl", "blr") or ci.group(capstone.CS_GRP_CALL):
                calls = a if calls is None else calls
                live = False
            elif _A.ARM64_REG_X30 in writes and not m.startswith(("pac", "aut", "xpac", "hint")):
                live = m.startswith("ld")
        if end < part.start + len(code) // 4 * 4:
            return Refusal("trampoline_unsafe", end, f"{end:#x} cannot be decoded")
    out = calls if calls is not None else next((e.addr for e in exits if e.kind != RET), None)
    if out is not None:
        why = unwinds_exceptions(image, analysis)
        if why:
            return Refusal("trampoline_unsafe", out, f"{func.name} calls out at {out:#x} and an exception may "
                                                     f"unwind through its frame ({why}): the trampoline has no FDE")
    return None


# --- the generic exit walk's questions (planner/exits.py) ---------------------------------

JUMP_WORD = "branch"


def exits_refusal(image, func) -> Refusal | None:
    """Every exit is named, even out of a `B`'s reach of the new code: there
    exit_region() refuses it (jump_reach), and the function takes the trampoline
    where trampoline_refusal() allows, else a brk return hook at each exit."""
    return None


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
    """A block with an FDE of its own that starts mid-frame (CFA not sp + 0, or x30
    saved, by its CIE's and FDE's rules): a stripped `.cold` part, followed as one
    (its `ret` after reloading x30 is an exit of the function)."""
    return _mid_frame(image, func.start) is not None


def exit_region(image, analysis, part, exit: Exit, busy, landed=None) -> tuple[list[DcrInsn], int] | Refusal:
    """The exit alone (a B is as long): (its instruction, region end); refused out of
    a B's reach of the new code (reach.py).  landed: unused (no branch exits here: a
    region of one instruction holds no other jump's target)."""
    far = reach.refusal(image, exit.addr, "a B to a return hook")
    if far is not None:
        return far
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


def hook_copy(hooks, blocks=None):
    """How a kprobe's detour copies an exit of a return-probed function (a kprobe
    on a ret): the exit calls its return hook first.  blocks: unused (no branch exits)."""
    def copy(insn, pos):
        if insn.addr in hooks:
            return hook_then_exit(insn, hooks[insn.addr], pos)
        return em.relocate(insn, pos)
    return copy


@dataclasses.dataclass(frozen=True)
class KretEntry:
    """A kretprobe entry's body for emit.clean_detour() and full_detour(): inline
    (its group's returns hooked in place): emit.kret_entry_detour(), or full_detour()
    with pt_regs; else the runtime's dispatch after the trampoline."""
    rp: int
    tramp: int
    entry_handler: int | None
    inline: bool
    enter_c: int


def kret_entry_body(*, rp: int, tramp: int, entry_handler: int | None, enter_c: int,
                    aligned: bool, inline: bool = True, regs: bool = False) -> KretEntry:
    """pre_handler_kretprobe() for a site whose one probe is rp->kp, inlined: by
    emit.kret_entry_detour() when the entry_handler never reads regs (clean_detour's
    body; its slow path is the runtime's dispatch), by emit.full_detour() with
    pt_regs when it may (regs; its slow path calls enter_c, kp_kretprobe_enter()).
    A kretprobe whose returns use the trampoline (inline=False) takes the runtime's
    dispatch."""
    return KretEntry(rp, tramp, entry_handler, inline, enter_c)


# A return hook's frame: x0-x18, x30 and NZCV at their slots (scratch order), the
# thread block and the instance.
_RET_SLOTS = tuple(range(19)) + (30, em._NZCV)
_RET_T = 8 * len(_RET_SLOTS)
_RET_FRAME = (_RET_T + 16 + 15) & ~15
_RET_TPL = (0, 1, 2, 3, 4, 30)          # what the inlined fast path writes itself


def _ret_fast_path(c, S: int, *, fast: int, table: int, rp: int, handler: int | None, t_slot: int,
                   regs: bool):
    """The inlined part of a return hook (kp_kretprobe_return() for the common case),
    as x86-64's: armed, the thread's block found, no handler running, the top
    instance recorded at S (sp + S here), not fired by the trampoline, this
    kretprobe's; pop it, run the handler (ri, regs: sp when regs, with pc the
    instance's return address, else 0), free it; another instance at S goes to C.
    Writes x0-x4 and x30 (and what the handler writes); jumps to "slow" or "restore"."""
    em._find_thread(c, fast, table, "slow")
    c += E.ldr_w(30, 2, em.THREAD_ACTIVE)
    c.cbnz("restore", 30, 0)                                    # in a handler: nothing fires
    c += E.ldr_x(1, 2, em.THREAD_KRET)
    c.cbz("restore", 1)
    c += E.ldr_w(3, 1, em.KRET_DEPTH)
    c.cbz("restore", 3, 0)
    c += E.add_lsl(4, 1, 3, 3) + E.ldr_x(4, 4, em.KRET_STACK - 8)
    c += E.ldr_x(30, 4, em.RI_FP) + E.add_imm(0, 31, S) + E.eor_reg(30, 30, 0)
    c.cbnz("slow", 30)                                          # frames to reclaim, or none of S
    tramp_bit = em.RI_TRAMP.bit_length() - 1
    assert em.RI_TRAMP == 1 << tramp_bit and tramp_bit < 8
    c += E.ldrb(30, 4, em.RI_FLAGS)
    c.tbz("slow", 30, tramp_bit, 1)                             # the trampoline fires it
    c += E.ldr_x(30, 4, em.RI_RP)
    c.addr(0, rp)
    c += E.eor_reg(30, 30, 0)
    c.cbnz("slow", 30)                                          # a tail-calling caller's instance
    c += E.sub_imm_w(3, 3, 1) + E.str_w(3, 1, em.KRET_DEPTH)
    if handler is not None:
        c += E.movz_w(30, 1) + E.str_w(30, 2, em.THREAD_ACTIVE) + E.stp(2, 4, 31, t_slot) + E.mov_reg(0, 4)
        if regs:
            # pc: the instance's return address (x30 may hold the trampoline: a tail
            # call through a pointer swapped it), as the kernel's trampoline reports it.
            c += E.ldr_x(1, 4, em.RI_RET_ADDR) + E.str_x(1, 31, em.PT_PC) + E.add_imm(1, 31, 0)
        else:
            c += E.movz(1, 0)
        c.call(handler)
        c += E.ldp(2, 4, 31, t_slot) + E.str_w(31, 2, em.THREAD_ACTIVE)
    c += E.add_imm(4, 4, em.RI_STATE) + E.stlr_w(31, 4)        # kp_ri_free()
    # A tail-calling caller's instance at the same slot fires too: C does that.
    c += E.ldr_x(1, 2, em.THREAD_KRET) + E.ldr_w(3, 1, em.KRET_DEPTH)
    c.cbz("restore", 3, 0)
    c += E.add_lsl(4, 1, 3, 3) + E.ldr_x(4, 4, em.KRET_STACK - 8) + E.ldr_x(4, 4, em.RI_FP)
    c += E.add_imm(0, 31, S) + E.eor_reg(4, 4, 0)
    c.cbz("slow", 4)


def clean_ret_hook(exit: DcrInsn, at: int, *, fast: int, table: int, key, rp: int,
                   handler: int | None, return_c: int, full_hook, aligned: bool, handler_clobbers,
                   kretprobes: int = 0, handlers: int = 0) -> bytes:
    """A return hook inlined before a `ret` (sp is S, as after it) of a function with
    one kretprobe whose handler never reads regs (x86-64's clean_ret_hook): find the
    thread, pop the instance recorded at S, run the handler, free the instance, then
    the ret.  Only x0-x4, x30 and what the handler writes are saved on that path
    (handler_clobbers, None: all of x0-x18, x30 and NZCV); nothing in it writes NZCV.
    Anything else saves the rest and calls kp_kretprobe_return_clean(S); when that
    returns 1 (an instance whose handler reads regs: a tail-calling caller's)
    everything comes back and the shared hook with pt_regs runs (full_hook), then
    the exit."""
    clob = set() if handler is None else handler_clobbers
    fast_saves = [r for r in _RET_SLOTS if clob is None or r in _RET_TPL
                  or (f"x{r}" if r != em._NZCV else "nzcv") in clob]
    slow_saves = [r for r in _RET_SLOTS if r not in fast_saves]
    slot = {r: 8 * i for i, r in enumerate(_RET_SLOTS)}

    def save(rs, load):
        """str (ldr with load) of rs; NZCV through x30, which is saved first and loaded last."""
        out = em._save_pairs([r for r in rs if r != em._NZCV], slot, load)
        if em._NZCV in rs:
            flags = E.ldr_x(30, 31, slot[em._NZCV]) + E.msr_nzcv(30) if load else \
                E.mrs_nzcv(30) + E.str_x(30, 31, slot[em._NZCV])
            out = flags + out if load else out + flags
        return out

    c = em._Asm(at)
    c += E.stp_pre(0, 1, 31, -_RET_FRAME) + save(fast_saves[2:], False)
    _ret_fast_path(c, _RET_FRAME, fast=fast, table=table, rp=rp, handler=handler, t_slot=_RET_T, regs=False)
    c.label("restore")
    c += save(fast_saves[2:], True) + E.ldp_post(0, 1, 31, _RET_FRAME)
    c += em.relocate(exit, c.pc)
    c.label("slow")
    c += save(slow_saves, False) + E.add_imm(0, 31, _RET_FRAME)
    c.call(return_c)                                            # kp_kretprobe_return_clean(S)
    c += save(slow_saves, True)
    c.cbz("restore", 0, 0)
    c += save(_RET_SLOTS[2:], True) + E.ldp_post(0, 1, 31, _RET_FRAME)      # all of them
    c += hook_then_exit(exit, full_hook, c.pc)
    return c.done()


def full_ret_hook(exit: DcrInsn, at: int, *, fast: int, table: int, key, rp: int,
                  handler: int | None, return_c: int, aligned: bool, kretprobes: int = 0,
                  handlers: int = 0) -> bytes:
    """The same for a kretprobe whose handler may read regs: struct pt_regs built in
    line as the kernel's trampoline reports it (pc the return address, sp as after
    the ret), the handler called directly, every register and NZCV restored from
    pt_regs (a handler may change regs->regs[0]).  Anything uncommon calls
    kp_kretprobe_return(regs)."""
    F = em._frame() + 16                       # pt_regs, the thread block, the instance
    c = em._Asm(at)
    em._save_pt_regs(c, F, None)
    _ret_fast_path(c, F, fast=fast, table=table, rp=rp, handler=handler, t_slot=em._frame(), regs=True)
    c.label("restore")
    em._restore_pt_regs(c, F)
    c += em.relocate(exit, c.pc)
    c.label("slow")
    c += E.add_imm(0, 31, 0)
    c.call(return_c)                                            # kp_kretprobe_return(regs)
    c.b("restore")
    return c.done()
