"""Return sites of a function and their jump-optimized return hooks (x86-64).

The kernel catches a return by swapping the return address for a trampoline
(arch/x86/kernel/rethook.c).  A static rewriter sees every exit of the
function instead: each `ret`, and each tail-call `jmp` to another function
(the generic walk, planner/exits.py, asks this module what an exit is).
Each exit gets a return hook placed like an optimized probe: a 5-byte jmp at
the start of a region that ends with the exit (the DCR), to a detour that runs
the relocated DCR up to the exit, calls the hook, then executes the exit
itself.  A region may start at an earlier instruction boundary (`pop %rbx;
pop %rbp; ret`), and may run on into the alignment padding after the
function's end (nops or int3 that nothing executes).  The region's checks are
can_optimize()'s: every instruction relocatable (a relative jump re-encoded), no
jump target inside but at its start, inside the function (or its padding).
Where no region fits, trampoline_refusal() says whether the kernel's
return-address trampoline is safe for the function instead.
"""
from __future__ import annotations

import bisect

import capstone
import capstone.x86_const

from . import cs
from . import insn as x86insn
from . import emit as em
from .emit import _link, _s32, relocate
from ..base import COND, RET, TAIL, DcrInsn, Exit, Refusal, unwinds_exceptions
from .optprobe import JMP32_INSN_SIZE
from .common import DWARF_RBP, DWARF_RSP, dead_padding, mid_frame, relocatable
from ... import safety


class _Insns:
    """A function's instructions, as Analysis decoded them once (boundaries and
    exit candidates), classified on demand (only exits and the few instructions
    a return region takes)."""

    def __init__(self, image, analysis, func):
        d = analysis.decoded(func)
        self.code = image.read(func.start, func.end - func.start)
        self.start = func.start
        self.addrs = [func.start + b for b in d.boundaries]
        self.ends = self.addrs[1:] + [func.start + (d.undecodable - func.start if d.undecodable else len(self.code))]
        self.exits = d.exits
        self._cls: dict[int, DcrInsn] = {}

    def at(self, k: int) -> DcrInsn:
        got = self._cls.get(k)
        if got is None:
            a = self.addrs[k]
            off = a - self.start
            info = x86insn.classify(self.code[off:off + 16], a)
            got = self._cls[k] = DcrInsn(a, bytes(self.code[off:off + info.length]), info)
        return got


def _insns(image, analysis, func) -> _Insns:
    return analysis.memo("retprobe.insns", func.start, lambda: _Insns(image, analysis, func))


_X86_RBP, _X86_RSP = capstone.x86_const.X86_REG_RBP, capstone.x86_const.X86_REG_RSP
_DWARF_NAMES = {6: "%rbp", 7: "%rsp"}


def entry_frame_refusal(image, addr: int) -> Refusal | None:
    """Beyond the kernel, which cannot tell: is `addr` a place a call lands,
    the return address on top of the stack?  The FDE's rule there must be
    CFA = %rsp + 8 with the return address at CFA - 8.  A block of a larger
    function that has an FDE of its own (GCC's hot/cold splitting, stripped
    of its `.cold` name) starts mid-frame: its CFA is %rsp + 8 + the parent's
    frame, and a return-address swap at its "entry" would overwrite a word of
    the parent's frame.  Where no FDE covers addr (or the rule is an
    expression) nothing is known and nothing is refused."""
    mid = mid_frame(image, addr)
    if mid is None or not safety.enabled("entry_frame"):
        return None
    (reg, off), ra = mid
    where = f"{_DWARF_NAMES.get(reg, f'r{reg}')}{off:+d}"
    ra_at = f", the return address at CFA{ra:+d}" if ra is not None else ""
    return Refusal("entry_frame", addr, f"the CFA at {addr:#x} is {where}{ra_at} (its FDE), not %rsp+8 with "
                                        "the return address at CFA-8: entered mid-frame (as a cold part of a "
                                        "larger function is), it has no return address on top of the stack")


# --- the generic exit walk's questions (planner/exits.py) ---------------------------------

JUMP_WORD = "jump"


def exits_refusal(image, func) -> Refusal | None:
    """Every exit can take a jump to its hook: the new code is in a jmp rel32's reach of the image."""
    return None


def unknown_exits(image, analysis, part) -> Refusal | None:
    """An indirect jump of `part` whose targets are not all read (jumptable.py): its exits are unknown."""
    ij = analysis.unbounded_indirect_jump(part)
    if ij is None:
        return None
    return Refusal("indirect_jump", ij[0], f"{part.name} has an indirect jump: its exits are unknown ({ij[1]})")


def exit_insn(image, analysis, part, addr: int) -> DcrInsn:
    insns = _insns(image, analysis, part)
    return insns.at(bisect.bisect_left(insns.addrs, addr))


def exit_kind(insn: DcrInsn):
    """`ret` (`ret imm`): a return; `jmp rel`: a tail call's jump; `jcc`, `loop`, `jcxz`: conditional."""
    em = insn.info.emulate
    if em in ("ret", "ret imm"):
        return RET, None
    if em == "jmp rel":
        return TAIL, insn.info.rel_target
    if em in ("jcc rel", "loop", "jcxz"):
        return COND, insn.info.rel_target
    return None


def mid_frame_part(image, func) -> bool:
    """A block with an FDE of its own that starts mid-frame: a stripped `.cold` part."""
    return entry_frame_refusal(image, func.start) is not None


def exit_region(image, analysis, part, exit: Exit, busy, landed=None) -> tuple[list[DcrInsn], int] | Refusal:
    """The smallest region ending with `exit` that can take a 5-byte jump:
    (its instructions, region end).  `busy(lo, hi)` says whether another probe's
    region overlaps [lo, hi).  landed(addr): the jumps landing at addr will not
    land there (planner/returns.py hooks each as an exit of its own, or the
    detour runs it), so the region may hold addr."""
    allin = _insns(image, analysis, part)
    k = bisect.bisect_left(allin.addrs, exit.addr)
    end_insn = exit.addr + len(exit.insn.code)
    last = Refusal("ret_region", exit.addr, "no region of 5 bytes ending with this exit")
    dcr: list[DcrInsn] = [exit.insn]
    # After a jcc (a branch exit's) the code runs on: no padding to borrow.
    pad = exit.insn.info.emulate != "jcc rel"
    while True:
        b = dcr[0].addr
        need = JMP32_INSN_SIZE - (end_insn - b)
        if need <= 0 or pad and dead_padding(image, analysis, part, end_insn, need):
            end = max(end_insn, b + JMP32_INSN_SIZE)
            if busy(b, end):
                last = Refusal("probe_in_region", b, f"another probe overlaps the return region [{b:#x}, {end:#x})")
            else:
                return dcr, end
        if need <= 0:
            return last
        # Grow backwards by one instruction, if the one we add can be relocated
        # and the current start is not a jump target.
        hits = analysis.targets_in(b, b + 1)
        if hits and safety.enabled("return_regions") and not (landed is not None and landed(b)):
            return Refusal("jump_into_region", b, f"{hits[0][1]} lands at {b:#x}, inside the return region")
        k -= 1
        if k < 0 or allin.ends[k] != b:
            return Refusal("func_size", exit.addr, f"fewer than 5 bytes from the start of {part.name} to this exit")
        prev = allin.at(k)
        if prev.info.probe_refused:
            return Refusal("can_probe", prev.addr, f"{prev.info.probe_refused} before the exit")
        if prev.info.emulate in _REENCODED:
            pass                # re-encoded as rel32 in the detour (emit.relocate()), as in a DCR
        elif prev.info.emulate is not None or not prev.info.boostable:
            # Beyond can_boost(), as a DCR is (common.relocatable()): an SSE move
            # of the return value (`movsd C(%rip),%xmm0; ret`), a push m64...
            why = prev.info.emulate or (relocatable(prev.code, prev.addr, prev.info)
                                        and prev.info.boost_reason)
            if why:
                return Refusal("can_boost", prev.addr, f"instruction before the exit cannot be relocated ({why})")
        dcr.insert(0, prev)


# Relative jumps before an exit: copied to the detour re-encoded (their targets lie
# outside the region: a target inside it was refused as a jump into the region).
_REENCODED = ("jcc rel", "jmp rel")


def trampoline_refusal(image, analysis, func, parts, exits) -> Refusal | None:
    """Where the return-address trampoline (the kernel's rethook) would be wrong
    for `func`, though cheaper than breakpoint return hooks: the function reads
    or takes the address of its own return-address slot (the FDE's CFA rule at
    each instruction says where the slot is; with no rule, nothing is proven),
    or it calls out and the image unwinds exceptions (an exception through its
    frame would meet the trampoline, which has no FDE).  None: safe."""
    if not safety.enabled("trampoline_unsafe"):
        return None
    calls = None
    for part in parts:
        insns = _insns(image, analysis, part)
        for k, a in enumerate(insns.addrs):
            rule = image.cfa.at(a)
            if rule is None or rule[0] not in (DWARF_RSP, DWARF_RBP):
                return Refusal("trampoline_unsafe", a, f"no CFA rule at {a:#x} says where the return address "
                                                       "is, so whether the function reads it is unknown")
            off = a - insns.start
            ci = next(cs.DETAIL.disasm(insns.code[off:off + 16], a, 1), None)
            if ci is None:
                return Refusal("trampoline_unsafe", a, f"{a:#x} cannot be decoded")
            base = _X86_RSP if rule[0] == DWARF_RSP else _X86_RBP
            for op in ci.operands:
                if op.type == capstone.x86_const.X86_OP_MEM and op.mem.base == base \
                        and op.mem.index == 0 and op.mem.disp == rule[1] - 8:
                    return Refusal("trampoline_unsafe", a, f"{ci.mnemonic} {ci.op_str} at {a:#x} addresses the "
                                                           "return-address slot: it would see the trampoline")
            if calls is None and capstone.CS_GRP_CALL in ci.groups:
                calls = a
    out = calls if calls is not None else next((e.addr for e in exits if e.kind != RET), None)
    if out is not None:
        why = unwinds_exceptions(image, analysis)
        if why:
            return Refusal("trampoline_unsafe", out, f"{func.name} calls out at {out:#x} and an exception may "
                                                     f"unwind through its frame ({why}): the trampoline has no FDE")
    return None


def hook_call(at: int, hook: int) -> bytes:
    _link(hook, at + 1)
    return b"\xe8" + _s32(hook - (at + 5), "call return hook")


def exit_code(insn: DcrInsn, at: int) -> bytes:
    """The exit itself, in a detour: a ret is copied, a tail jmp re-encoded."""
    return relocate(insn, at)


PLAIN_RETS = (b"\xc3", b"\xf3\xc3", b"\xf2\xc3")


def hook_then_exit(exit: DcrInsn, hook, at: int) -> bytes:
    """`call hook` then the exit; for a plain ret, `jmp` to the hook's variant
    that returns to the caller itself.  hook = (call target, jmp target or
    None), or a function (exit, at) -> code that inlines the hook and the exit
    (clean_ret_hook)."""
    if callable(hook):
        return hook(exit, at)
    call_hook, jmp_hook = hook
    if jmp_hook is not None and exit.code in PLAIN_RETS:
        _link(jmp_hook, at + 1)
        return b"\xe9" + _s32(jmp_hook - (at + 5), "jmp return hook")
    return hook_call(at, call_hook) + exit_code(exit, at + 5)


_PLT = (".plt", ".plt.sec", ".plt.got")


def plt_slot(image, analysis, target: int) -> int | None:
    """The GOT slot a PLT stub at `target` jumps through (`[endbr64;] [bnd] jmp
    *slot(%rip)`), or None when target is no PLT stub."""
    sec = image.section_containing(target)
    if sec is None or sec.name not in _PLT:
        return None
    for ci in cs.DETAIL.disasm(image.read(target, 16), target, 2):
        if ci.mnemonic.endswith("jmp"):
            op = ci.operands[0] if ci.operands else None
            if op is not None and op.type == capstone.x86_const.X86_OP_MEM and op.mem.base == _X86_RIP \
                    and op.mem.index == 0 and op.size == 8:
                return ci.address + ci.size + op.mem.disp
            return None
        if ci.mnemonic != "endbr64":
            return None
    return None


_X86_RIP = capstone.x86_const.X86_REG_RIP


def pointer_tail_hook(exit: DcrInsn, at: int, hook: int, slot: int | None = None) -> bytes:
    """A tail call through a pointer (`jmp *m64`, `jmp *%reg`), or to a PLT stub
    whose GOT slot is `slot`: push its target, call the hook
    (kp_kretprobe_tail_pointer_entry: pending or swapped by the target), drop
    the target, then the jmp itself."""
    out = _push_target(exit, at, slot)
    out += hook_call(at + len(out), hook)
    out += em._asm_pi("lea rsp, [rsp + 8]")
    return out + exit_code(exit, at + len(out))


def _push_target(exit: DcrInsn, at: int, slot: int | None) -> bytes:
    """push the target of a tail call through a pointer: the same operand (ff /4 ->
    ff /6, read before the push moves %rsp), or the PLT stub's GOT slot."""
    if slot is not None:
        return b"\xff\x35" + em._s32(slot - (at + 6), "push GOT slot")
    code = bytearray(exit.code)
    i = 0
    while code[i] != 0xFF:          # legacy prefixes and REX come first
        i += 1
    assert (code[i + 1] >> 3) & 7 == 4, f"not a jmp through a pointer at {exit.addr:#x}"
    code[i + 1] ^= 0x04 << 3 ^ 0x06 << 3
    code = bytes(b for b in code[:i] if b not in (0xF2, 0xF3)) + bytes(code[i:])     # no bnd on a push
    push = DcrInsn(exit.addr, code, exit.info)
    return em._rip_moved(push, at) if exit.info.rip_relative else push.code


TAIL_FRAME = 56     # rax rcx rdx rsi rdi r8 (0..40), flags 48


def inline_tail_hook(exit: DcrInsn, at: int, *, fast: int, table: int, key, c_hook: int, pointer: bool,
                     slot: int | None, hooked: int, bits: int, mul: int) -> bytes:
    """kp_kretprobe_tail_pending() inlined before a tail jmp (rsp at the slot S):
    find the thread, mark the instances recorded at S pending, and set the
    thread's tail_slot.  pointer: a tail call through a pointer (or a PLT
    stub's GOT slot), pending only when its target is in kp_kret_hooked[]
    (the link-time address: the target less the image's bias, which a
    RIP-relative lea of link address 0 gives).  Anything else (a frame left
    behind to reclaim, a thread seen for the first time, a target not hooked:
    the swap) restores everything and calls the shared hook c_hook
    (kp_kretprobe_tail_pending_entry, kp_kretprobe_tail_pointer_entry)."""
    c = em._Code(at)
    P = 0
    if pointer:
        c.out += _push_target(exit, c.pc, slot)
        P = 8
    F = TAIL_FRAME
    c.a(f"lea rsp, [rsp - {F}]")
    c.a("mov qword ptr [rsp], rax; seto al; lahf; mov word ptr [rsp + 48], ax; mov qword ptr [rsp + 8], rcx; "
        "mov qword ptr [rsp + 16], rdx; mov qword ptr [rsp + 24], rsi; mov qword ptr [rsp + 32], rdi; "
        "mov qword ptr [rsp + 40], r8")
    slow = em.find_thread(c, fast, table, key)
    done = []
    if pointer:
        c.a(f"mov rax, qword ptr [rsp + {F}]")
        c.rip("lea rcx, [rip + {d}]", 0)                              # the image's bias
        c.a("sub rax, rcx")
        slow.append(c.jcc(em.JE))
        c.a(f"movabs rcx, {mul:#x}; imul rcx, rax; shr rcx, {64 - bits}")
        c.rip("lea rsi, [rip + {d}]", hooked)
        probe = c.pc
        c.a("mov r8, qword ptr [rsi + rcx*8]; cmp r8, rax")
        found = c.jcc(em.JE)
        c.a("test r8, r8")
        slow.append(c.jcc(em.JE))                                     # not hooked: the swap
        c.a(f"inc ecx; and ecx, {(1 << bits) - 1:#x}")
        c.jmp_abs(probe, "jmp next probe")
        c.fix([found], c.pc)
    c.a(f"mov rdi, qword ptr [rdx + {em.THREAD_KRET}]; test rdi, rdi")
    done.append(c.jcc(em.JE))
    c.a(f"mov eax, dword ptr [rdi + {em.KRET_DEPTH}]; test eax, eax")
    done.append(c.jcc(em.JE))
    c.a(f"lea rsi, [rsp + {F + P}]; mov rcx, qword ptr [rdi + rax*8 + {em.KRET_STACK - 8}]; "
        f"cmp qword ptr [rcx + {em.RI_FP}], rsi")
    none_at_s = c.jcc(em.JA)
    slow.append(c.jcc(em.JB))                                         # a frame left behind: reclaim
    mark = c.pc
    c.a(f"or dword ptr [rcx + {em.RI_FLAGS}], {em.RI_PENDING}; dec eax")
    last = c.jcc(em.JE)
    c.a(f"mov rcx, qword ptr [rdi + rax*8 + {em.KRET_STACK - 8}]; cmp qword ptr [rcx + {em.RI_FP}], rsi")
    c.fix([c.jcc(em.JE)], mark)
    c.fix([none_at_s, last], c.pc)
    c.a(f"mov qword ptr [rdi + {em.KRET_TAIL_SLOT}], rsi")

    def restore():
        c.a("movzx eax, word ptr [rsp + 48]; add al, 0x7f; sahf; mov rcx, qword ptr [rsp + 8]; "
            "mov rdx, qword ptr [rsp + 16]; mov rsi, qword ptr [rsp + 24]; mov rdi, qword ptr [rsp + 32]; "
            "mov r8, qword ptr [rsp + 40]; mov rax, qword ptr [rsp]")
        c.a(f"lea rsp, [rsp + {F}]")
    c.fix(done, c.pc)
    restore()
    if pointer:
        c.a("lea rsp, [rsp + 8]")
    c.out += exit_code(exit, c.pc)
    c.fix(slow, c.pc)
    restore()
    c.out += hook_call(c.pc, c_hook)
    if pointer:
        c.a("lea rsp, [rsp + 8]")
    c.out += exit_code(exit, c.pc)
    return bytes(c.out)


def ret_detour(dcr: list[DcrInsn], hook: tuple[int, int | None], at: int) -> bytes:
    """Detour of a return site: the DCR up to the exit, the hook, the exit."""
    return _run_then_exit(dcr, hook, at)


def _run_then_exit(insns: list[DcrInsn], hook, at: int) -> bytes:
    """insns up to the exit (the last), copied, then the hook and the exit.  A
    relative jump among them to a later one of them (a `jne` to the `ret` of
    the same region, whose other jumps are exits of their own: planner/returns.py)
    goes to that one's copy: rel32, so each copy's place is known beforehand."""
    where, pos = {}, at
    if any(i.info.emulate in _REENCODED and insns[0].addr < i.info.rel_target <= insns[-1].addr for i in insns):
        for insn in insns:
            where[insn.addr] = pos
            if insn is not insns[-1]:
                pos += len(relocate(insn, pos))
    out = bytearray()
    for insn in insns[:-1]:
        t = insn.info.rel_target if insn.info.emulate in _REENCODED else None
        if t is not None and t in where and t > insn.addr:
            out += _branch_to(insn, at + len(out), where[t])
        else:
            out += relocate(insn, at + len(out))
    out += hook_then_exit(insns[-1], hook, at + len(out))
    return bytes(out)


def _branch_to(insn: DcrInsn, at: int, to: int, invert: bool = False) -> bytes:
    """A relative jmp or jcc (the condition inverted: invert) at `at` to `to`, rel32."""
    if insn.info.emulate == "jmp rel":
        return b"\xe9" + _s32(to - (at + 5), "jmp")
    op = insn.code[0] if insn.code[0] != 0x0F else insn.code[1]
    return bytes([0x0F, 0x80 | (op & 0x0F) ^ invert]) + _s32(to - (at + 6), "jcc")


def branch_exit(insn: DcrInsn) -> bool:
    """A jump that may stand for the exit it lands on: `jmp rel` or `jcc rel`
    (a plain opcode, no prefix: its condition is inverted in the detour)."""
    if insn.info.emulate == "jmp rel":
        return insn.code[0] in (0xEB, 0xE9)
    return insn.info.emulate == "jcc rel" and (0x70 <= insn.code[0] <= 0x7F or insn.code[0] == 0x0F)


def branch_ret_detour(dcr: list[DcrInsn], block: list[DcrInsn], hook, at: int, branch: int) -> bytes:
    """Detour of a branch exit: the DCR up to the jump (its last), then, for a
    jcc, the inverted jcc back to the instruction after it; then the block the
    jump lands on (a `ret`, or the instructions up to it: `xor %eax,%eax;
    ret`), the hook and the exit, as the exit's own detour runs them.  A region
    that starts at the jump (`branch`, the DCR's first) runs the rest of its
    copy after the inverted jcc, then jumps back to the region's end."""
    if dcr[-1].addr != branch:
        out = bytearray(hook_copy({branch: hook}, {branch: block})(dcr[0], at))
        for insn in dcr[1:]:
            out += relocate(insn, at + len(out))
        end = dcr[-1].addr + len(dcr[-1].code)
        return bytes(out + b"\xe9" + _s32(end - (at + len(out) + 5), "jmp back"))
    out = bytearray()
    for insn in dcr[:-1]:
        out += relocate(insn, at + len(out))
    j = dcr[-1]
    if j.info.emulate == "jcc rel":
        out += _branch_to(j, at + len(out), j.addr + len(j.code), invert=True)
    out += _run_then_exit(block, hook, at + len(out))
    return bytes(out)


def hook_copy(hooks: dict[int, tuple[int, int | None]], blocks: dict | None = None):
    """How a detour copies its DCR when the DCR holds exits of a return-probed
    function (a short function: the entry's region reaches its ret): each exit
    in the copy calls its return hook first.  hooks: exit address -> hook.
    blocks: branch exits among them (planner/returns.py's _branch_exits()) ->
    what each jump lands on: the jump's copy runs that block, the hook and the
    exit (a jcc inverted, over them, to the next instruction's copy)."""
    blocks = blocks or {}

    def copy(insn, pos):
        if insn.addr in blocks:
            if insn.info.emulate == "jmp rel":
                return _run_then_exit(blocks[insn.addr], hooks[insn.addr], pos)
            body = _run_then_exit(blocks[insn.addr], hooks[insn.addr], pos + 6)
            return _branch_to(insn, pos, pos + 6 + len(body), invert=True) + body
        if insn.addr in hooks:
            return hook_then_exit(insn, hooks[insn.addr], pos)
        return relocate(insn, pos)
    return copy


# -- Per-site kretprobe templates -------------------------------------------------
#
# The kretprobe's halves with the common case inlined, as emit.clean_detour()
# inlines a kprobe's dispatch: the kernel's pre_handler_kretprobe() and
# __kretprobe_trampoline_handler() for one kretprobe whose handlers never read
# regs, calling those handlers directly.  Anything uncommon (a frame left
# behind to reclaim, the instance at the hint taken, a swapped slot, another
# kretprobe's instance at the slot, a thread seen for the first time) goes to
# the C code of runtime/kp_kretprobe.c, which handles every case.

# What kret_entry_body's clean form writes besides the entry_handler's own.
KRET_ENTRY_USES = ("rax", "rcx", "rdx", "rsi", "rdi", "r8")


def kret_entry_body(*, rp: int, tramp: int, entry_handler: int | None, enter_c: int, aligned: bool,
                    inline: bool = True, regs: bool = False):
    """The handler part of an entry template for a site whose one probe is
    rp->kp (pre_handler_kretprobe() inlined): claim the instance at the
    pool's hint (lock cmpxchg), record the slot and the return address, push
    it on the thread's instance stack, run the entry_handler (a non-zero
    return drops the instance).  On entry rdx holds the thread block, marked
    active.  Anything uncommon calls enter_c(p, S, t, regs)
    (kp_kretprobe_enter).  inline=False: only that call (a kretprobe whose
    returns use the trampoline).
    regs=False: emit.clean_detour()'s body (frame at rsp, the thread block at
    [rsp + 80]; uses rax rcx rdx rsi rdi r8 and what the entry_handler
    clobbers; the entry_handler never reads regs).  regs=True:
    emit.full_detour()'s (struct pt_regs at rbx, which may differ from rsp by
    the realignment; the thread block after it; every register is saved; the
    body leaves eax = 0, pre_handler_kretprobe()'s return)."""
    F = em.FULL_FRAME if regs else em.CLEAN_FRAME
    base = "rbx" if regs else "rsp"
    T = f"[rbx + {em.PT_SIZE}]" if regs else "[rsp + 80]"

    def body(c, slow_saves=(), slot=None):
        to_c, end = [], []
        c.a(f"lea rsi, [{base} + {F:#x}]")                            # S: the return-address slot
        if not inline:
            to_c.append(c.jcc(-1))
        c.a(f"mov rdi, qword ptr [rdx + {em.THREAD_KRET}]; test rdi, rdi")
        to_c.append(c.jcc(em.JE))                                     # the thread's first kretprobe hit
        c.a(f"mov eax, dword ptr [rdi + {em.KRET_DEPTH}]; test eax, eax")
        empty = c.jcc(em.JE)
        c.a(f"mov rcx, qword ptr [rdi + rax*8 + {em.KRET_STACK - 8}]; cmp qword ptr [rcx + {em.RI_FP}], rsi")
        above = c.jcc(em.JA)
        to_c.append(c.jcc(em.JNE))                                    # a frame left behind: reclaim
        # At S itself: a tail-calling caller's instance, chained by its pending tail
        # call (kp_ri_chained()), stays; anything else is C's to reclaim.
        c.a(f"test byte ptr [rcx + {em.RI_FLAGS}], {em.RI_PENDING}")
        to_c.append(c.jcc(em.JE))
        c.a(f"cmp qword ptr [rdi + {em.KRET_TAIL_SLOT}], rsi")
        to_c.append(c.jcc(em.JNE))
        c.a(f"cmp dword ptr [rdi + {em.KRET_NORPHANS}], 0")
        to_c.append(c.jcc(em.JNE))
        c.fix([empty, above], c.pc)
        c.rip("lea r8, [rip + {d}]", tramp)
        c.a("cmp qword ptr [rsi], r8")
        to_c.append(c.jcc(em.JE))                                     # a tail call swapped the slot
        c.rip("mov ecx, dword ptr [rip + {d}]", rp + em.RP_HINT)
        c.rip("cmp ecx, dword ptr [rip + {d}]", rp + em.RP_MAXACTIVE)
        to_c.append(c.jcc(em.JAE))                                    # no pool
        c.rip("imul ecx, dword ptr [rip + {d}]", rp + em.RP_STRIDE)
        c.rip("add rcx, qword ptr [rip + {d}]", rp + em.RP_POOL)      # the instance at the hint
        c.a(f"xor eax, eax; mov r8d, 1; lock cmpxchg dword ptr [rcx + {em.RI_STATE}], r8d")
        to_c.append(c.jcc(em.JNE))                                    # taken: C scans the pool
        c.rip("mov eax, dword ptr [rip + {d}]", rp + em.RP_HINT)
        c.a("inc eax; xor r8d, r8d")
        c.rip("cmp eax, dword ptr [rip + {d}]", rp + em.RP_MAXACTIVE)
        c.a("cmovae eax, r8d")
        c.rip("mov dword ptr [rip + {d}], eax", rp + em.RP_HINT)
        c.rip("lea r8, [rip + {d}]", rp)
        c.a(f"mov qword ptr [rcx + {em.RI_RP}], r8; mov r8, qword ptr [rsi]; "
            f"mov qword ptr [rcx + {em.RI_RET_ADDR}], r8; mov qword ptr [rcx + {em.RI_FP}], rsi; "
            f"mov dword ptr [rcx + {em.RI_FLAGS}], 0; mov qword ptr [rdi + {em.KRET_TAIL_SLOT}], 0; "
            f"mov eax, dword ptr [rdi + {em.KRET_DEPTH}]; mov qword ptr [rdi + rax*8 + {em.KRET_STACK}], rcx; "
            f"inc eax; mov dword ptr [rdi + {em.KRET_DEPTH}], eax")
        if entry_handler is not None:
            c.a("mov rdi, rcx; mov rsi, rbx" if regs else "mov rdi, rcx; xor esi, esi")
            c.call_aligned(entry_handler, aligned)
            c.a("test eax, eax")
            end.append(c.jcc(em.JE))
            # Non-zero: no return handler for this call (nested probes missed, so ours is on top).
            c.a(f"mov rdx, qword ptr {T}; mov rdi, qword ptr [rdx + {em.THREAD_KRET}]; "
                f"mov eax, dword ptr [rdi + {em.KRET_DEPTH}]; dec eax; mov dword ptr [rdi + {em.KRET_DEPTH}], eax; "
                f"mov rcx, qword ptr [rdi + rax*8 + {em.KRET_STACK}]; mov dword ptr [rcx + {em.RI_STATE}], 0")
        end.append(c.jcc(-1))
        c.fix(to_c, c.pc)                                             # kp_kretprobe_enter(p, S, t, regs)
        for reg in slow_saves:
            c.a(f"mov qword ptr [rsp + {slot[reg]}], {reg}")
        c.rip("lea rdi, [rip + {d}]", rp)
        c.a("mov rcx, rbx" if regs else "xor ecx, ecx")
        c.call_aligned(enter_c, aligned)
        for reg in slow_saves:
            c.a(f"mov {reg}, qword ptr [rsp + {slot[reg]}]")
        c.fix(end, c.pc)
        if regs:
            c.a("xor eax, eax")
        else:
            c.a(f"mov rdx, qword ptr {T}; mov dword ptr [rdx + {em.THREAD_ACTIVE}], 0")
    return body


# The return hooks free a tail-calling caller's instance without handler inline
# (emission passes kp_kretprobes and kp_kret_handlers).
FREES_CALLERS_INLINE = True
CLEAN_ENTRY_IN_USER = True             # kp_kretprobe_clean_entry (optprobe_entry.S)


def _ret_fast_path(c, F: int, *, fast: int, table: int, key, rp: int, handler: int | None, aligned: bool,
                   ri_slot: int, t_slot: int, regs_arg: str, kretprobes: int,
                   handlers: int) -> tuple[list[int], list[int]]:
    """The inlined part of a return hook (kp_kretprobe_return() for the common
    case), S at [rsp + F]: armed, the thread's block found, no handler running,
    the top instance recorded at S, not fired by the trampoline, this
    kretprobe's; pop it, run the handler (regs_arg sets its regs argument),
    free it; then the instances of tail-calling callers at S whose kretprobe has
    no handler (kp_kret_handlers[], by position in kretprobes[]): popped and
    freed.  Returns (jumps to the slow path, jumps to the restore)."""
    slow = em.find_thread(c, fast, table, key)
    c.a(f"cmp dword ptr [rdx + {em.THREAD_ACTIVE}], 0")
    restore = [c.jcc(em.JNE)]                                       # in a handler: nothing fires
    c.a(f"mov rdi, qword ptr [rdx + {em.THREAD_KRET}]; test rdi, rdi")
    restore.append(c.jcc(em.JE))
    c.a(f"mov eax, dword ptr [rdi + {em.KRET_DEPTH}]; test eax, eax")
    restore.append(c.jcc(em.JE))
    c.a(f"lea rsi, [rsp + {F}]; mov rcx, qword ptr [rdi + rax*8 + {em.KRET_STACK - 8}]; "
        f"cmp qword ptr [rcx + {em.RI_FP}], rsi")
    slow.append(c.jcc(em.JNE))                                      # frames to reclaim, or none of S
    c.a(f"test byte ptr [rcx + {em.RI_FLAGS}], {em.RI_TRAMP}")
    slow.append(c.jcc(em.JNE))
    c.rip("lea r8, [rip + {d}]", rp)
    c.a(f"cmp qword ptr [rcx + {em.RI_RP}], r8")
    slow.append(c.jcc(em.JNE))                                      # a tail-calling caller's instance
    c.a(f"dec eax; mov dword ptr [rdi + {em.KRET_DEPTH}], eax")
    if handler is not None:
        c.a(f"mov dword ptr [rdx + {em.THREAD_ACTIVE}], 1; mov qword ptr [rsp + {ri_slot}], rcx; "
            f"mov qword ptr [rsp + {t_slot}], rdx; mov rdi, rcx; {regs_arg}")
        c.call_aligned(handler, aligned)
        c.a(f"mov rdx, qword ptr [rsp + {t_slot}]; mov dword ptr [rdx + {em.THREAD_ACTIVE}], 0; "
            f"mov rcx, qword ptr [rsp + {ri_slot}]")
    c.a(f"mov dword ptr [rcx + {em.RI_STATE}], 0")                  # kp_ri_free()
    # A tail-calling caller's instance at the same slot fires too: inline when its
    # kretprobe has no handler, else C does that.
    c.a(f"mov rdi, qword ptr [rdx + {em.THREAD_KRET}]")
    caller = c.pc
    c.a(f"mov eax, dword ptr [rdi + {em.KRET_DEPTH}]; test eax, eax")
    restore.append(c.jcc(em.JE))
    c.a(f"lea rsi, [rsp + {F}]; mov rcx, qword ptr [rdi + rax*8 + {em.KRET_STACK - 8}]; "
        f"cmp qword ptr [rcx + {em.RI_FP}], rsi")
    restore.append(c.jcc(em.JNE))
    shift = (em.KRETPROBE_SIZE // em.KRET_HANDLER_REC_SIZE).bit_length() - 1
    if em.KRETPROBE_SIZE != em.KRET_HANDLER_REC_SIZE << shift:
        slow.append(c.jcc(-1))
        return slow, restore
    c.a(f"test byte ptr [rcx + {em.RI_FLAGS}], {em.RI_TRAMP}")
    restore.append(c.jcc(em.JNE))                                   # the trampoline fires it
    c.a(f"mov r8, qword ptr [rcx + {em.RI_RP}]")
    c.rip("lea rsi, [rip + {d}]", kretprobes)
    c.a(f"sub r8, rsi; shr r8, {shift}")
    c.rip("lea rsi, [rip + {d}]", handlers)
    c.a("cmp qword ptr [rsi + r8], 0")
    slow.append(c.jcc(em.JNE))                                      # a handler: C runs it
    c.a(f"dec eax; mov dword ptr [rdi + {em.KRET_DEPTH}], eax; mov dword ptr [rcx + {em.RI_STATE}], 0")
    c.jmp_abs(caller, "jmp next instance")
    return slow, restore


RET_FRAME = 104     # rax rcx rdx rsi rdi r8-r11 (0..64), flags 72, the instance 80, the thread 88


def clean_ret_hook(exit: DcrInsn, at: int, *, fast: int, table: int, key, rp: int, handler: int | None,
                   return_c: int, full_hook: tuple[int, int | None], aligned: bool,
                   handler_clobbers: set[str] | None, kretprobes: int = 0, handlers: int = 0) -> bytes:
    """A return hook inlined before a `ret` (rsp at the return-address slot S)
    of a function with one kretprobe whose handler never reads regs: find the
    thread, pop the instance recorded at S, run the handler, free the
    instance, then the ret.  Call-clobbered registers (those the fast path
    and the handler write; the rest before calling C) and the arithmetic
    flags are kept, as kretprobe_entry.S explains.  Anything else goes to
    kp_kretprobe_return_clean(S), which may hand over to the full hook."""
    fast_saves, slow_saves, slot = em.scratch_plan({"rax", "rcx", "rdx", "rsi", "rdi", "r8"}, handler_clobbers)
    F = RET_FRAME
    c = em._Code(at)
    c.a(f"lea rsp, [rsp - {F}]")
    c.a("mov qword ptr [rsp], rax; seto al; lahf; mov word ptr [rsp + 72], ax")
    for reg in fast_saves[1:]:
        c.a(f"mov qword ptr [rsp + {slot[reg]}], {reg}")
    slow, restore = _ret_fast_path(c, F, fast=fast, table=table, key=key, rp=rp, handler=handler, aligned=aligned,
                                   ri_slot=80, t_slot=88, regs_arg="xor esi, esi", kretprobes=kretprobes,
                                   handlers=handlers)

    def restore_all(saves):
        c.a("movzx eax, word ptr [rsp + 72]; add al, 0x7f; sahf")
        for reg in saves:
            c.a(f"mov {reg}, qword ptr [rsp + {slot[reg]}]")
        c.a(f"lea rsp, [rsp + {F}]")

    restore_pc = c.pc
    c.fix(restore, restore_pc)
    restore_all(fast_saves)
    c.out += exit_code(exit, c.pc)
    c.fix(slow, c.pc)
    for reg in slow_saves:
        c.a(f"mov qword ptr [rsp + {slot[reg]}], {reg}")
    c.a(f"lea rdi, [rsp + {F}]")
    c.call_aligned(return_c, aligned)
    for reg in slow_saves:
        c.a(f"mov {reg}, qword ptr [rsp + {slot[reg]}]")
    c.a("test eax, eax")
    c.fix([c.jcc(em.JE)], restore_pc)
    restore_all(list(slot))                                      # all of them
    c.out += hook_then_exit(exit, full_hook, c.pc)
    return bytes(c.out)


def full_ret_hook(exit: DcrInsn, at: int, *, fast: int, table: int, key, rp: int, handler: int | None,
                  return_c: int, aligned: bool, kretprobes: int = 0, handlers: int = 0) -> bytes:
    """The same for a kretprobe whose handler may read regs: struct pt_regs is
    built inline as the kernel's trampoline reports it (ip the return address,
    sp the stack pointer after the ret), the handler is called directly, and
    every register is restored from pt_regs (a handler may change regs->ax).
    Anything uncommon calls kp_kretprobe_return(regs)."""
    F = em.PT_SIZE + 16                   # pt_regs, the instance, the thread block
    RI, T = em.PT_SIZE, em.PT_SIZE + 8
    c = em._Code(at)
    c.a(f"lea rsp, [rsp - {F}]")
    em.save_pt_regs(c)
    c.a(f"mov rax, qword ptr [rsp + {F}]; mov qword ptr [rsp + {em.PT_IP}], rax; "
        f"lea rax, [rsp + {F + 8}]; mov qword ptr [rsp + {em.PT_SP}], rax")
    slow, restore = _ret_fast_path(c, F, fast=fast, table=table, key=key, rp=rp, handler=handler, aligned=aligned,
                                   ri_slot=RI, t_slot=T,
                                   # ip: the instance's return address (the slot may hold the
                                   # trampoline: a tail call through a pointer swapped it)
                                   regs_arg=f"mov rax, qword ptr [rcx + {em.RI_RET_ADDR}]; "
                                            f"mov qword ptr [rsp + {em.PT_IP}], rax; mov rsi, rsp",
                                   kretprobes=kretprobes, handlers=handlers)
    restore_pc = c.pc
    c.fix(restore, restore_pc)
    em.restore_pt_regs(c)
    c.a(f"lea rsp, [rsp + {F}]")
    c.out += exit_code(exit, c.pc)
    c.fix(slow, c.pc)
    c.a("mov rdi, rsp")
    c.call_aligned(return_c, aligned)
    c.jmp_abs(restore_pc, "jmp restore")
    return bytes(c.out)
