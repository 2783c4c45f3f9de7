"""Code emission for AArch64: detour buffers, the `B` at the probe, start-up stubs.

A detour is reached by one 4-byte `B` (+-128 MiB; writer.py places the new
segment within the reach) and returns with a direct `B`, so BTI never checks
either.  PC-relative displaced instructions are relocated as Frida's
gumarm64relocator.c does (adr/adrp -> adrp [+ add] of the same address, literal
loads -> the address, then a load through it, conditional branches -> the
inverted condition over a `B`, bl -> x30 set to the original return address,
then `B`); every PC-relative instruction is encoded by encode.py and checked
by decoding it."""
from __future__ import annotations

import dataclasses

from ..base import DcrInsn
from . import bti
from . import encode as E
from . import insn as I
from . import offsets as O
from ... import safety


# Its references to runtime symbols are not logged (Emit.relink): emission builds
# each detour again with the linked runtime's addresses.
relink = None


class EmitError(Exception):
    pass


def _e(fn, *args):
    try:
        return fn(*args)
    except E.EncodeError as e:
        raise EmitError(str(e)) from None


MRS_X0_NZCV = 0xD53B4200.to_bytes(4, "little")
MSR_NZCV_X0 = 0xD51B4200.to_bytes(4, "little")
NOP = I.NOP.to_bytes(4, "little")
BTI_C = 0xD503245F.to_bytes(4, "little")
UDF = b"\0\0\0\0"            # what the rest of a region longer than the jump holds: traps loudly


def relocate(insn: DcrInsn, new: int) -> bytes:
    """One DCR instruction copied to `new` (gumarm64relocator.c's forms)."""
    info = insn.info
    k = info.kind
    if k in I.PC_RELATIVE and not safety.enabled("pc_relative"):
        return insn.code             # the test suite's proof that the forms below matter
    nxt = insn.addr + 4
    if k == I.B:
        return _e(E.b, new, info.target)
    if k == I.BL:
        # x30 is the original return address: returns, unwinding and
        # __builtin_return_address() see the program's own code.
        return _e(E.adrp, new, 30, nxt) + E.add_imm(30, 30, nxt & 0xFFF) + _e(E.b, new + 8, info.target)
    if k == I.BCOND:
        if info.cond >= 14:          # al, nv: always
            return _e(E.b, new, info.target)
        return _e(E.b_cond, new, info.cond ^ 1, new + 8) + _e(E.b, new + 4, info.target)
    if k == I.CBZ:
        return _e(E.cbz, new, info.rt, info.sf, info.cond ^ 1, new + 8) + _e(E.b, new + 4, info.target)
    if k == I.TBZ:
        return _e(E.tbz, new, info.rt, info.bit, info.cond ^ 1, new + 8) + _e(E.b, new + 4, info.target)
    if k in (I.ADR, I.ADRP):
        if info.rt == 31:            # the zero register: no effect
            return NOP
        if k == I.ADRP:
            return _e(E.adrp, new, info.rt, info.target)
        return _e(E.adrp, new, info.rt, info.target) + E.add_imm(info.rt, info.rt, info.target & 0xFFF)
    if k in (I.LDR_LIT, I.LDRSW_LIT):
        if info.rt == 31:
            return NOP
        rt = info.rt
        load = E.ldrsw(rt, rt) if k == I.LDRSW_LIT else (E.ldr_x(rt, rt) if info.sf else E.ldr_w(rt, rt))
        return _e(E.adrp, new, rt, info.target) + E.add_imm(rt, rt, info.target & 0xFFF) + load
    return insn.code


def with_target(insn: DcrInsn, target: int) -> DcrInsn:
    return DcrInsn(insn.addr, insn.code, dataclasses.replace(insn.info, target=target))


def _site_imm(site: int) -> bytes:
    """x16 = site (movz + movk: the same size whatever the index)."""
    return E.movz(16, site & 0xFFFF) + E.movk(16, (site >> 16) & 0xFFFF, 16)


def probe_stub(site: int, entry: int, at: int) -> bytes:
    """stp x16, x30, [sp, #-16]!; x16 = SITE; bl entry; ldp x16, x30, [sp], #16.
    The runtime's entry (optprobe_entry.S) finds the probed code's x16 and x30 at
    the top of its frame and writes a handler's changes to them back there."""
    out = E.stp_pre(16, 30, 31, -16) + _site_imm(site)
    out += _e(E.b, at + len(out), entry, True)
    return out + E.ldp_post(16, 30, 31, 16)


def detour(site: int, dcr: list[DcrInsn], with_post: bool, at: int,
           entry: int, post_entry: int, copy=None, back: int | None = None,
           short: bool = False) -> tuple[bytes, int, int]:
    """The detour buffer of one site: the stub into the runtime's entry, the
    copy (after its first instruction the post stub), the `B` back.  Returns
    (code, resume, resume_post).  short (x86-64's kernel stubs): no arm64 target
    asks for it yet (user programs keep the stub as it is)."""
    assert not short, "no short stubs on arm64"
    copy = copy or relocate
    out = bytearray(probe_stub(site, entry, at))
    resume = resume_post = at + len(out)
    for i, insn in enumerate(dcr):
        out += copy(insn, at + len(out))
        if i == 0 and with_post:
            out += probe_stub(site, post_entry, at + len(out))
            resume_post = at + len(out)
    back = back or dcr[-1].addr + len(dcr[-1].code)
    out += _e(E.b, at + len(out), back)
    return bytes(out), resume, resume_post


def _frame() -> int:
    return (O.PT_SIZE + 15) & ~15


def _save_pt_regs(c, F: int, pc: int | None):
    """struct pt_regs at sp, which moves down F (pt_regs first): every register, sp
    as before, pc the given address (None: x30, as after a `ret`), pstate NZCV,
    orig_x0 0, syscallno -1.  Writes x0 x1 (saved first)."""
    c += E.sub_imm(31, 31, F)
    for r in range(0, 30, 2):
        c += E.stp(r, r + 1, 31, O.PT_X0 + 8 * r)
    c += E.str_x(30, 31, O.PT_X0 + 240) + E.add_imm(0, 31, F)
    assert O.PT_PC == O.PT_SP + 8
    if pc is None:
        c += E.stp(0, 30, 31, O.PT_SP)
    else:
        c.addr(1, pc)
        c += E.stp(0, 1, 31, O.PT_SP)
    c += MRS_X0_NZCV + E.str_x(0, 31, O.PT_PSTATE)
    c += E.movn_w(0, 0) + E.stp(31, 0, 31, O.PT_ORIG_X0)      # orig_x0 0, syscallno -1


def _restore_pt_regs(c, F: int):
    """Every register and NZCV back from pt_regs at sp; sp up F."""
    c += E.ldr_x(0, 31, O.PT_PSTATE) + MSR_NZCV_X0
    for r in range(0, 30, 2):
        c += E.ldp(r, r + 1, 31, O.PT_X0 + 8 * r)
    c += E.ldr_x(30, 31, O.PT_X0 + 240) + E.add_imm(31, 31, F)


# A kretprobe entry's body (retprobe.kret_entry_body(): retprobe.KretEntry) names
# the runtime's kretprobe trampoline: the generic dispatch lies at a fixed offset
# after it (kretprobe_entry.S), which runs pre_handler_kretprobe() as any
# pre_handler (hit counted, nmissed, disabled).  Entries not inlined call it, and
# the inlined one's slow path (kret_entry_detour()).
KRET_DISPATCH_OFFSET = 256


def _kret_entry(site: int, body, at: int) -> bytes:
    return probe_stub(site, body.tramp + KRET_DISPATCH_OFFSET, at)


def full_detour(site: int, dcr: list[DcrInsn], at: int, *, fast: int, table: int, key,
                probe: int, probe_index: int, handler: int, callback: int, resume_regs: int,
                aligned: bool, copy=None, body=None, back: int | None = None,
                red_zone: bool = False) -> tuple[bytes, int]:
    """The detour of a site with one probe whose pre_handler may read or write
    pt_regs, as x86-64's full_detour: struct pt_regs saved once, in line (pc the
    probed address, sp at the hit, pstate NZCV), the dispatch of the common case
    inlined (clean_detour's), the pre_handler called with (p, regs).  A handler that
    changed the path (a non-zero return and a new regs->pc), regs->sp or a PSTATE
    bit beyond NZCV resumes through resume_regs (kp_optprobe_resume_regs, pc
    regs->pc or the copied instruction); anything else restores every register and
    NZCV from pt_regs.  The slow path calls callback(site, regs)
    (kp_optimized_callback(), which counts nmissed) on the same pt_regs.  A
    kretprobe's entry (body, retprobe.KretEntry) whose entry_handler may read regs
    runs pre_handler_kretprobe() in place of the pre_handler (_kret_claim()), or,
    not inlined, takes the runtime's dispatch.  red_zone: unused (pt_regs holds x16 and
    x17 whatever they hold).  Returns (code, resume)."""
    if body is not None and not body.inline:
        return _after(_kret_entry(site, body, at), dcr, at, copy, back)
    pt = _frame()
    F = pt + 16                                         # pt_regs, the thread block
    hit = dcr[0].addr
    c = _Asm(at)
    _save_pt_regs(c, F, hit)
    t = _T if body is None else 2       # the kretprobe's helpers take it in x2
    _find_thread(c, fast, table, "slow", t)
    c += E.ldr_w(30, t, O.THREAD_ACTIVE)
    c.cbnz("slow", 30, 0)                                       # reentered: nmissed
    c.addr(0, probe)
    c += E.ldrb(30, 0, O.KPROBE_FLAGS) + E.and_bits(30, 30, 0, 2)
    c.cbnz("restore", 30, 0)                                    # KPROBE_FLAG_GONE|DISABLED: silent
    hits = O.THREAD_HITS + 8 * probe_index
    if hits < 32768:
        c += E.ldr_x(30, t, hits) + E.add_imm(30, 30, 1) + E.str_x(30, t, hits)
    else:
        c += _add_const(1, t, hits) + E.ldr_x(30, 1, 0) + E.add_imm(30, 30, 1) + E.str_x(30, 1, 0)
    c += E.movz_w(30, 1) + E.str_w(30, t, O.THREAD_ACTIVE)
    if body is None:
        c += E.add_imm(1, 31, 0)
        c.call(handler)                                         # pre_handler(p, regs); x19 kept
    else:
        c += E.str_x(2, 31, pt)
        # pre_handler_kretprobe(), as kret_entry_detour's, with regs: the slot is sp at
        # the hit, the return address x30's; anything uncommon calls
        # kp_kretprobe_enter(p, S, t, regs) (enter_c), which returns nothing.
        _kret_claim(c, body, F, O.PT_X30, "enter_c")
        _kret_push(c, F, O.PT_X30)
        if body.entry_handler is not None:
            _kret_entry_handler(c, body, pt, E.add_imm(1, 31, 0))
        c.b("entered")
        c.label("enter_c")
        c += E.add_imm(1, 31, F) + E.add_imm(3, 31, 0)
        c.call(body.enter_c)
        c.label("entered")
        c += E.movz_w(0, 0) + E.ldr_x(2, 31, pt)
    c += E.str_w(31, t, O.THREAD_ACTIVE)
    # What the handler changed: the path, the stack pointer, PSTATE beyond NZCV.
    c.cbz("same_path", 0, 0)
    c += E.ldr_x(0, 31, O.PT_PC)
    c.addr(1, hit)
    c += E.eor_reg(0, 0, 1)
    c.cbnz("leave", 0)
    c.label("same_path")
    c += E.ldr_x(0, 31, O.PT_SP)
    c += E.add_imm(1, 31, F) + E.eor_reg(0, 0, 1)
    c.cbnz("changed", 0)
    c += E.ldr_x(0, 31, O.PT_PSTATE) + E.and_bits(0, 0, 32, 60)   # ~NZCV: at the hit, none set
    c.cbnz("changed", 0)
    c.label("restore")
    _restore_pt_regs(c, F)
    resume = c.pc
    copy = copy or relocate
    for insn in dcr:
        c += copy(insn, c.pc)
    c += _e(E.b, c.pc, back or dcr[-1].addr + len(dcr[-1].code))
    c.label("changed")                                          # go on with the copy, on regs->sp
    c.addr(0, resume)
    c += E.str_x(0, 31, O.PT_PC)
    c.label("leave")
    c += _e(E.b, c.pc, resume_regs)
    c.label("slow")
    c += E.movz(0, site & 0xFFFF) + E.movk(0, (site >> 16) & 0xFFFF, 16) + E.add_imm(1, 31, 0)
    c.call(callback)                                            # kp_optimized_callback(site, regs)
    c.cbnz("leave", 0)
    c.b("restore")
    return c.done(), resume


def _after(head: bytes, dcr, at: int, copy, back) -> tuple[bytes, int]:
    copy = copy or relocate
    out = bytearray(head)
    resume = at + len(out)
    for insn in dcr:
        out += copy(insn, at + len(out))
    out += _e(E.b, at + len(out), back or dcr[-1].addr + len(dcr[-1].code))
    return bytes(out), resume


_SCRATCH = tuple(range(19)) + (30,)     # what a C call clobbers (AAPCS64): x0-x18, x30
_NZCV = 32                              # a clean frame's slot name for the flags
_T = 19                                 # the thread block, callee-saved: kept across the handler
_IP = (16, 17)                          # IP0/IP1: free at a function's entry (optprobe.red_zone_free_at)


def _save_pairs(regs: list[int], slot: dict[int, int], load: bool) -> bytes:
    """str/stp (ldr/ldp with load) of regs at their frame slots, pairs where two are adjacent."""
    out, i = bytearray(), 0
    while i < len(regs):
        r = regs[i]
        if i + 1 < len(regs) and slot[regs[i + 1]] == slot[r] + 8 and slot[r] % 8 == 0:
            out += (E.ldp if load else E.stp)(r, regs[i + 1], 31, slot[r])
            i += 2
        else:
            out += (E.ldr_x if load else E.str_x)(r, 31, slot[r])
            i += 1
    return bytes(out)


class _Near:
    """Runtime data reached PC-relative, one instruction each, `adr` (an address) or
    `ldr` literal (a word), where every item of a group lies within +-1 MiB of it (the
    runtime's data follow the detours); else a B to a far stub after the detour's code
    (adrp and add or load for each item, B back past the group).  The stub's words are
    kept in either case, so that a detour is as long wherever its data lie (layout.py
    lays it out with placeholder addresses, emission builds it again with the linked
    ones)."""

    def __init__(self):
        self.far, self.kept = [], 0

    @staticmethod
    def _reach(pc: int, target: int, size: int) -> bool:
        return -(1 << 20) <= target - pc < (1 << 20) and target % max(size, 1) == 0

    def get(self, out: bytearray, at: int, items: list[tuple[int, int, int]]):
        """Each (rd, target, size): rd = target (size 0), or the size-byte word at target."""
        self.kept += 2 * len(items) + 1
        pc = at + len(out)
        if all(self._reach(pc + 4 * i, t, size) for i, (_, t, size) in enumerate(items)):
            for rd, target, size in items:
                pc = at + len(out)
                out += E.ldr_lit(pc, rd, target, size) if size else E.adr(pc, rd, target)
        else:
            self.far.append((len(out), items))
            out += UDF * len(items)

    def stubs(self, out: bytearray, at: int):
        """The far stubs of the groups get() made, after the detour's code."""
        start = len(out)
        for pos, items in self.far:
            out[pos:pos + 4] = _e(E.b, at + pos, at + len(out))
            for page in dict.fromkeys(t & ~0xFFF for _, t, _ in items):
                # One adrp a page, into an address's register (which takes its offset
                # last), or into the word's own.
                group = [(rd, t, size) for rd, t, size in items if t & ~0xFFF == page]
                group.sort(key=lambda it: it[2] == 0)          # words first, addresses after
                base = group[-1][0]
                out += _e(E.adrp, at + len(out), base, page)
                for rd, t, size in group:
                    if size == 8:
                        out += E.ldr_x(rd, base, t & 0xFFF)
                    elif size == 4:
                        out += E.ldr_w(rd, base, t & 0xFFF)
                    else:
                        out += E.add_imm(rd, base, t & 0xFFF)
            out += _e(E.b, at + len(out), at + pos + 4 * len(items))
        out += UDF * (self.kept - (len(out) - start) // 4)


def clean_detour(site: int, dcr: list[DcrInsn], at: int, *, fast: int, table: int, key,
                 probe: int, probe_index: int, handler: int | None, callback: int, flags_live: bool,
                 aligned: bool, handler_clobbers: set[str] | None = None, copy=None, body=None,
                 back: int | None = None, regs_fields: frozenset[int] | None = None,
                 red_zone: bool = False) -> tuple[bytes, int]:
    """The detour of a site with one probe whose handler never reads regs: the
    optprobe template with the dispatch of the common case inlined (kp_pre_dispatch()
    for one probe, as x86-64's clean_detour): kprobes armed (kp_fast), the thread's
    block (the thread pointer hashed into kp_thread_table), no handler running on this
    thread, the probe enabled, then the hit counted and the pre_handler called with
    (p, regs) where regs is never read.  Only call-clobbered registers are saved (no
    pt_regs): on the fast path those the template writes (x0, x17, x30 and the thread
    block's register: x16 where the handler leaves it, else x19, callee-saved, so kept
    across the handler's call) and those the handler writes (handler_clobbers, None:
    unknown, so all of x0-x18, x30 and NZCV); on the slow path the rest, before
    kp_optimized_clean_callback(site) (the generic dispatch, which counts nmissed).
    red_zone: a function's entry, where x16 and x17 (IP0/IP1, which any call's veneer
    may write) hold nothing: they are used without being saved.  kp_fast, the table
    and the probe are reached PC-relative, one instruction each, within 1 MiB, else
    through one far stub (_Near).  Reentry and KPROBE_FLAG_GONE|DISABLED are tested in
    one branch to the slow path, whose C dispatch counts the miss or stays silent.  No
    template instruction writes NZCV.  A kretprobe's entry (body) is
    kret_entry_detour()'s, or the runtime's dispatch where not inlined.
    regs_fields: a pre_handler that only loads from regs, at these pt_regs byte offsets
    (handler_abi.regs_loads()): a partial pt_regs at sp, passed in x1, only those fields
    stored; each saved register is saved in its own field (so a field of a register the
    detour saves anyway costs no store); nothing is restored from it but the saves (the
    handler cannot write it).  The callback is then callback(site, regs)
    (kp_optimized_callback), whose return is not read: with regs unchanged it resumes here.
    Returns (code, resume): where the relocated DCR starts."""
    if body is not None:
        if body.inline:
            return kret_entry_detour(site, dcr, at, fast=fast, table=table, probe_index=probe_index, body=body,
                                     handler_clobbers=handler_clobbers, copy=copy, back=back)
        return _after(_kret_entry(site, body, at), dcr, at, copy, back)
    clob = set() if handler is None else handler_clobbers
    t = 16 if clob is not None and "x16" not in clob else _T
    tpl = [0] + ([1] if regs_fields is not None else []) + [t, 17, 30]
    free = set(_IP) if red_zone else set()
    fast_saves = [r for r in _SCRATCH if r not in free and (clob is None or r in tpl or f"x{r}" in clob)]
    if t == _T:
        fast_saves.append(_T)
    if clob is None or "nzcv" in clob:
        fast_saves.append(_NZCV)
    slow_saves = [r for r in list(_SCRATCH) + [_NZCV] if r not in fast_saves and r not in free]
    if regs_fields is not None:
        # pt_regs at sp: each register saved in its own field, the flags in pstate's.
        slot = {r: O.PT_X0 + 8 * r for r in list(_SCRATCH) + [_T]}
        slot[_NZCV] = O.PT_PSTATE
        frame = (O.PT_SIZE + 15) & ~15
        order = [r for r in fast_saves if r != _NZCV]
        order.sort(key=lambda r: slot[r])
    else:
        order = fast_saves + slow_saves
        slot = {r: 8 * i for i, r in enumerate(order)}
        frame = (8 * len(order) + 15) & ~15
        order = [r for r in fast_saves if r != _NZCV]
    fregs = order
    sregs = [r for r in slow_saves if r != _NZCV]
    assert slot[fregs[0]] == 0 and slot[fregs[1]] == 8, "the first two saves open the frame"
    out = bytearray(E.stp_pre(fregs[0], fregs[1], 31, -frame))
    out += _save_pairs(fregs[2:], slot, False)
    if regs_fields is not None:
        out += _partial_pt_regs(at + len(out), regs_fields - {slot[r] for r in fregs}, 0, frame, dcr[0].addr)
    if _NZCV in fast_saves:
        out += E.mrs_nzcv(30) + E.str_x(30, 31, slot[_NZCV])
    to_slow, to_restore = [], []

    def branch(lst, rt, sf, nz):
        lst.append((len(out), rt, sf, nz))
        out.extend(b"\0\0\0\0")

    near = _Near()
    near.get(out, at, [(17, fast, 4), (t, table, 0), (0, probe, 0)])
    branch(to_slow, 17, 0, 0)                                   # cbz w17, slow: disarmed
    # x1, where saved anyway, is the index and the key: w17 then keeps kp_fast (not 0) to mark
    # the thread active with.
    tp, ix = (30, 1) if 1 in fast_saves else (17, 30)
    out += E.mrs_tpidr_el0(tp) + E.ubfx(ix, tp, 12, O.THREAD_TABLE_MASK.bit_length())
    out += E.ldr_x_index(t, t, ix)
    out += E.ldr_x(ix, t, 0) + E.eor_reg(ix, ix, tp)
    branch(to_slow, ix, 1, 1)                                   # a thread seen for the first time
    # Reentered (nmissed) or the probe KPROBE_FLAG_GONE|DISABLED (bits 0-1 of its flags,
    # shifted to 30-31): one branch to the slow path, whose C dispatch tells the two apart.
    fl = 1 if tp == 30 else 17
    out += E.ldr_w(30, t, O.THREAD_ACTIVE) + E.ldrb(fl, 0, O.KPROBE_FLAGS) + E.orr_lsl_w(30, 30, fl, 30)
    branch(to_slow, 30, 0, 1)
    hits = O.THREAD_HITS + 8 * probe_index
    if hits < 32768:
        out += E.ldr_x(30, t, hits) + E.add_imm(30, 30, 1) + E.str_x(30, t, hits)
    else:
        out += _add_const(17, t, hits) + E.ldr_x(30, 17, 0) + E.add_imm(30, 30, 1) + E.str_x(30, 17, 0)
    if handler is not None:
        out += E.str_w(17, t, O.THREAD_ACTIVE) if tp == 30 else E.movz_w(30, 1) + E.str_w(30, t, O.THREAD_ACTIVE)
        if regs_fields is not None:
            out += E.add_imm(1, 31, 0)                              # ... or only the fields stored
        out += _e(E.b, at + len(out), handler, True)                # handler(p, regs never read)
        out += E.str_w(31, t, O.THREAD_ACTIVE)
    restore = len(out)
    if _NZCV in fast_saves:
        out += E.ldr_x(30, 31, slot[_NZCV]) + E.msr_nzcv(30)
    out += _save_pairs(fregs[2:], slot, True) + E.ldp_post(fregs[0], fregs[1], 31, frame)
    resume = at + len(out)
    copy = copy or relocate
    for insn in dcr:
        out += copy(insn, at + len(out))
    out += _e(E.b, at + len(out), back or dcr[-1].addr + len(dcr[-1].code))
    slow = len(out)
    out += _save_pairs(sregs, slot, False)
    if _NZCV in slow_saves:
        out += E.mrs_nzcv(30) + E.str_x(30, 31, slot[_NZCV])
    out += E.movz(0, site & 0xFFFF) + E.movk(0, (site >> 16) & 0xFFFF, 16)
    if regs_fields is not None:
        out += E.add_imm(1, 31, 0)                                  # kp_optimized_callback(site, regs)
    out += _e(E.b, at + len(out), callback, True)               # kp_optimized_clean_callback(site)
    if _NZCV in slow_saves:
        out += E.ldr_x(30, 31, slot[_NZCV]) + E.msr_nzcv(30)
    out += _save_pairs(sregs, slot, True)
    out += _e(E.b, at + len(out), at + restore)
    near.stubs(out, at)
    for lst, target in ((to_slow, slow), (to_restore, restore)):
        for pos, rt, sf, nz in lst:
            out[pos:pos + 4] = _e(E.cbz, at + pos, rt, sf, nz, at + target)
    return bytes(out), resume


def _partial_pt_regs(at: int, fields: frozenset[int], area: int, frame: int, hit: int) -> bytes:
    """The pt_regs fields a pre_handler reads, at sp + area, as _save_pt_regs() stores them:
    each register as at the hit (none written yet), sp the stack pointer at the hit, pc
    the probed address, pstate NZCV, orig_x0 0, syscallno -1.  x30 is the scratch (saved,
    its own field stored first)."""
    out = bytearray()
    for off in sorted(fields):
        if O.PT_X0 <= off < O.PT_X0 + 31 * 8:
            out += E.str_x((off - O.PT_X0) // 8, 31, area + off)
    for off in sorted(fields):
        if off == O.PT_SP:
            out += E.add_imm(30, 31, frame) + E.str_x(30, 31, area + off)
        elif off == O.PT_PC:
            out += _e(E.load_address, at + len(out), 30, hit) + E.str_x(30, 31, area + off)
        elif off == O.PT_PSTATE:
            out += E.mrs_nzcv(30) + E.str_x(30, 31, area + off)
        elif off == O.PT_ORIG_X0:
            out += E.str_x(31, 31, area + off)                      # xzr
        elif off == O.PT_SYSCALLNO:
            out += E.movn_w(30, 0) + E.str_x(30, 31, area + off)      # -1, then 4 bytes 0
        elif not O.PT_X0 <= off < O.PT_X0 + 31 * 8:
            raise EmitError(f"pt_regs field {off} has no value")
    return bytes(out)


def _add_const(rd: int, rn: int, v: int) -> bytes:
    """rd = rn + v (0 <= v < 2**24): one or two adds, as long for any v of the same range."""
    if v >> 24 or v < 0:
        raise EmitError(f"offset {v:#x} too large for a detour's add")
    if v < 4096:
        return E.add_imm(rd, rn, v)
    return E.add_imm_hi(rd, rn, v) + E.add_imm(rd, rd, v & 0xFFF)


def _load_word(at: int, rt: int, target: int, size: int) -> bytes:
    """adrp + ldr of the word at target (size 4 or 8), into rt."""
    lo = target & 0xFFF
    if lo % size:
        raise EmitError(f"{target:#x} is not {size}-byte aligned")
    return _e(E.adrp, at, rt, target) + (E.ldr_x(rt, rt, lo) if size == 8 else E.ldr_w(rt, rt, lo))


class _Asm:
    """Code at `at` with forward branches to named labels, patched by done()."""

    def __init__(self, at: int):
        self.at, self.out, self.labels, self._fix = at, bytearray(), {}, []

    @property
    def pc(self) -> int:
        return self.at + len(self.out)

    def __iadd__(self, code: bytes):
        self.out += code
        return self

    def label(self, name: str):
        self.labels[name] = len(self.out)

    def _later(self, label: str, enc):
        self._fix.append((len(self.out), label, enc))
        self.out += b"\0\0\0\0"

    def cbz(self, label: str, rt: int, sf: int = 1, nonzero: int = 0):
        self._later(label, lambda at, t: E.cbz(at, rt, sf, nonzero, t))

    def cbnz(self, label: str, rt: int, sf: int = 1):
        self.cbz(label, rt, sf, 1)

    def tbz(self, label: str, rt: int, bit: int, nonzero: int = 0):
        self._later(label, lambda at, t: E.tbz(at, rt, bit, nonzero, t))

    def b(self, label: str):
        self._later(label, lambda at, t: E.b(at, t))

    def call(self, fn: int):
        self.out += _e(E.b, self.pc, fn, True)

    def addr(self, rd: int, target: int):
        self.out += _e(E.load_address, self.pc, rd, target)

    def done(self) -> bytes:
        for pos, label, enc in self._fix:
            self.out[pos:pos + 4] = _e(enc, self.at + pos, self.at + self.labels[label])
        return bytes(self.out)


def _find_thread(c: _Asm, fast: int, table: int, slow: str, t: int = 2):
    """kp_current_thread() inlined, as clean_detour's: kprobes armed (kp_fast), the
    thread's block in x<t> (tpidr_el0 hashed into kp_thread_table).  Writes x0 x1 x<t>
    x30; a disarmed or unknown thread goes to `slow`."""
    c += _load_word(c.pc, 0, fast, 4)
    c.cbz(slow, 0, 0)
    c += E.mrs_tpidr_el0(1) + E.ubfx(0, 1, 12, O.THREAD_TABLE_MASK.bit_length())
    c.addr(t, table)
    c += E.ldr_x_index(t, t, 0) + E.ldr_x(30, t, 0) + E.eor_reg(30, 30, 1)
    c.cbnz(slow, 30)


def _kret_claim(c: _Asm, body, S: int, ra: int, fail: str):
    """pre_handler_kretprobe()'s claim, inlined: with rp in x0 and the thread block in
    x2, the thread's instances in x1 and the instance at the pool's hint claimed into
    x4 (ldaxr/stxr), the hint moved on.  S: the slot (sp at the entry) at sp + S; ra:
    where the frame holds x30.  Writes x1 x3 x4 x5 x30; anything uncommon (no
    instances yet, a frame left behind to reclaim, x30 the trampoline, no pool, the
    instance taken) goes to `fail` with nothing claimed."""
    c += E.ldr_x(1, 2, O.THREAD_KRET)
    c.cbz(fail, 1)                                              # the thread's first kretprobe hit
    c += E.ldr_w(3, 1, O.KRET_DEPTH)
    c.cbz("empty", 3, 0)
    c += E.add_lsl(4, 1, 3, 3) + E.ldr_x(4, 4, O.KRET_STACK - 8) + E.ldr_x(4, 4, O.RI_FP)
    c += E.add_imm(30, 31, S) + E.sub_reg(4, 30, 4)
    c.tbz(fail, 4, 63)                                          # top's fp <= S: a frame left behind
    c.label("empty")
    c += E.ldr_x(30, 31, ra)
    c.addr(4, body.tramp)
    c += E.eor_reg(4, 4, 30)
    c.cbz(fail, 4)                                              # a tail call swapped x30
    c += E.ldr_w(3, 0, O.RP_HINT) + E.ldr_w(5, 0, O.RP_MAXACTIVE) + E.sub_reg_w(4, 3, 5)
    c.tbz(fail, 4, 31)                                          # hint >= maxactive: no pool
    c += E.ldr_w(4, 0, O.RP_STRIDE) + E.ldr_x(30, 0, O.RP_POOL) + E.umaddl(4, 3, 4, 30)
    c += E.add_imm(4, 4, O.RI_STATE)                            # &ri->kp_state, ri at the hint
    c += E.add_imm_w(3, 3, 1) + E.sub_reg_w(5, 3, 5)            # the next hint, 0 past the end
    c.cbnz("claim", 5, 0)
    c += E.movz_w(3, 0)
    c.label("claim")
    c += E.ldaxr_w(30, 4)
    c.cbnz(fail, 30, 0)                                         # taken: C scans the pool
    c += E.movz_w(30, 1) + E.stxr_w(5, 30, 4)
    c.cbnz("claim", 5, 0)
    c += E.str_w(3, 0, O.RP_HINT) + E.sub_imm(4, 4, O.RI_STATE)


def _kret_push(c: _Asm, S: int, ra: int):
    """The claimed instance (x4) recorded (rp x0, the return address, the slot S, no
    flags) and pushed on the thread's instances (x1); the tail slot cleared."""
    c += E.str_x(0, 4, O.RI_RP) + E.ldr_x(30, 31, ra) + E.str_x(30, 4, O.RI_RET_ADDR)
    c += E.add_imm(30, 31, S) + E.str_x(30, 4, O.RI_FP) + E.str_w(31, 4, O.RI_FLAGS)
    c += E.str_x(31, 1, O.KRET_TAIL_SLOT) + E.ldr_w(3, 1, O.KRET_DEPTH) + E.add_lsl(5, 1, 3, 3)
    c += E.str_x(4, 5, O.KRET_STACK) + E.add_imm_w(3, 3, 1) + E.str_w(3, 1, O.KRET_DEPTH)


def _kret_entry_handler(c: _Asm, body, block: int, regs_arg: bytes):
    """entry_handler(ri x4, regs) with the thread block saved at sp + block; a non-zero
    return drops the instance (nested probes missed, so ours is on top)."""
    c += E.str_x(2, 31, block) + E.mov_reg(0, 4) + regs_arg
    c.call(body.entry_handler)
    c.cbz("kept", 0, 0)
    c += E.ldr_x(2, 31, block) + E.ldr_x(1, 2, O.THREAD_KRET) + E.ldr_w(3, 1, O.KRET_DEPTH)
    c += E.sub_imm_w(3, 3, 1) + E.str_w(3, 1, O.KRET_DEPTH) + E.add_lsl(5, 1, 3, 3)
    c += E.ldr_x(4, 5, O.KRET_STACK) + E.add_imm(4, 4, O.RI_STATE) + E.stlr_w(31, 4)
    c.label("kept")


_KRET_TPL = (0, 1, 2, 3, 4, 5, 30)      # what kret_entry_detour() writes itself


def kret_entry_detour(site: int, dcr: list[DcrInsn], at: int, *, fast: int, table: int, probe_index: int,
                      body, handler_clobbers: set[str] | None, copy=None,
                      back: int | None = None) -> tuple[bytes, int]:
    """A kretprobe's entry with pre_handler_kretprobe() inlined for the common case,
    as x86-64's (x86_64/retprobe.kret_entry_body): the dispatch (armed, the thread's
    block, no handler running, enabled), then the instance at the pool's hint claimed
    (ldaxr/stxr), the hint moved on, the slot S (sp at the entry) and the return
    address (x30) recorded, the instance pushed on the thread's instance stack, the
    hit counted, the entry_handler called with (ri, regs never read); a non-zero
    return drops the instance.  The thread is marked active from the claim on.
    Only x0-x5, x30 and what the entry_handler writes are saved (handler_clobbers,
    None: all of x0-x18, x30 and NZCV); nothing here writes NZCV.  Anything else
    (disarmed, a thread seen for the first time or without instances yet, a handler
    running, a frame left behind to reclaim, x30 the trampoline, the instance at the
    hint taken or no pool) puts the registers back and takes the runtime's dispatch
    (kp_optimized_callback(), pre_handler_kretprobe() with a whole pt_regs), which
    counts the hit and nmissed.  Returns (code, resume)."""
    clob = set() if body.entry_handler is None else handler_clobbers
    if clob is None:
        saves = list(_SCRATCH) + [_NZCV]
    else:
        saves = [r for r in _SCRATCH if r in _KRET_TPL or f"x{r}" in clob] + ([_NZCV] if "nzcv" in clob else [])
    slot = {r: 8 * i for i, r in enumerate(saves)}
    frame = (8 * len(saves) + 8 + 15) & ~15          # the registers, the thread block
    block = 8 * len(saves)
    regs = [r for r in saves if r != _NZCV]
    rp = body.rp
    c = _Asm(at)
    c += E.stp_pre(0, 1, 31, -frame) + _save_pairs(regs[2:], slot, False)
    if _NZCV in saves:
        c += E.mrs_nzcv(0) + E.str_x(0, 31, slot[_NZCV])
    _find_thread(c, fast, table, "slow")
    c += E.ldr_w(30, 2, O.THREAD_ACTIVE)
    c.cbnz("slow", 30, 0)                                       # a handler running: nmissed
    c.addr(0, rp)                                               # rp, and &rp->kp
    c += E.ldrb(30, 0, O.KPROBE_FLAGS) + E.and_bits(30, 30, 0, 2)
    c.cbnz("restore", 30, 0)                                    # KPROBE_FLAG_GONE|DISABLED: silent
    _kret_claim(c, body, frame, slot[30], "slow")
    c += E.movz_w(30, 1) + E.str_w(30, 2, O.THREAD_ACTIVE)
    hits = O.THREAD_HITS + 8 * probe_index
    if hits < 32768:
        c += E.ldr_x(30, 2, hits) + E.add_imm(30, 30, 1) + E.str_x(30, 2, hits)
    else:
        c += _add_const(3, 2, hits) + E.ldr_x(30, 3, 0) + E.add_imm(30, 30, 1) + E.str_x(30, 3, 0)
    _kret_push(c, frame, slot[30])
    if body.entry_handler is not None:
        _kret_entry_handler(c, body, block, E.movz(1, 0))          # regs never read
        c += E.ldr_x(2, 31, block)
    c += E.str_w(31, 2, O.THREAD_ACTIVE)
    c.label("restore")
    restore = E.ldr_x(0, 31, slot[_NZCV]) + E.msr_nzcv(0) if _NZCV in saves else b""
    restore += _save_pairs(regs[2:], slot, True) + E.ldp_post(0, 1, 31, frame)
    c += restore
    resume = c.pc
    copy = copy or relocate
    for insn in dcr:
        c += copy(insn, c.pc)
    c += _e(E.b, c.pc, back or dcr[-1].addr + len(dcr[-1].code))
    c.label("slow")
    c += restore
    c += _kret_entry(site, body, c.pc)
    c += _e(E.b, c.pc, resume)
    return c.done(), resume


def light_detour(site: int, dcr: list[DcrInsn], at: int, *, fast: int, base: int, key,
                 counter: int, slow_entry: int, flags_live: bool, red_zone: bool, copy=None,
                 back: int | None = None, hits: int | None = None) -> tuple[bytes, int]:
    """The detour of a probe that runs nothing, in an image where no handler can run
    (planner.choose_forms(): Site.light), as x86-64's: the probe's counter in the shard
    the thread pointer's bits 12-15 choose, hits + counter + 4096 * shard (light_counter();
    hits: kp_light_hits itself, reached PC-relative in one instruction within 1 MiB:
    _Near), then kprobes armed (kp_fast, 1 when armed, which is also the increment), then
    the counter incremented.  Two registers a (the counter's address) and v (kp_fast):
    x16 and x17 at a function's entry (red_zone: optprobe.red_zone_free_at()), which hold
    nothing there, else x0 and x1 saved below sp, which moves first (AArch64 has no red
    zone).  Nothing here writes NZCV.

    The increment is the arch's alternative (the kernel's ARM64_HAS_LSE_ATOMICS): as
    written, LDXR/STXR (ARMv8.0, no LSE atomics), `cbnz wv, tail; b slow`, the tail saving
    a third register for STXR's status; where the CPU has LSE atomics (HWCAP_ATOMICS) the
    runtime rewrites these two words at start-up, before kprobes are armed, into
    `cbz wv, slow; stadd xv, [xa]` (runtime/arch/aarch64/linux_user/kp_alternatives.c,
    which reads the registers from these words and the tail's LDXR), at
    light_patch_at(at, red_zone).  The slow path (disarmed) puts the registers back and
    calls the runtime's shared clean entry, which counts in the thread's block.  base
    (kp_light_base) is x86-64's: unused here.
    Returns (code, resume): where the relocated DCR starts."""
    if hits is None:
        raise EmitError("an AArch64 light detour reaches kp_light_hits itself (hits)")
    copy = copy or relocate
    back = back or dcr[-1].addr + len(dcr[-1].code)
    if red_zone:
        a, v, st = 16, 17, 0                     # st: the STXR's status, saved in the tail
        out = bytearray()
        undo = b""
    else:
        a, v, st = 0, 1, 2
        out = bytearray(E.stp_pre(0, 1, 31, -16))
        undo = E.ldp_post(0, 1, 31, 16)
    near = _Near()
    out += E.mrs_tpidr_el0(a) + E.and_bits(a, a, 12, (O.LIGHT_SHARDS - 1).bit_length())
    near.get(out, at, [(v, hits + counter, 0)])
    out += E.add_reg(a, a, v)
    near.get(out, at, [(v, fast, 4)])
    pair = len(out)
    assert at + pair == light_patch_at(at, red_zone)
    out += b"\0" * 8                             # cbnz wv, tail; b slow
    out += undo
    resume = at + len(out)
    for insn in dcr:
        out += copy(insn, at + len(out))
    out += _e(E.b, at + len(out), back)
    tail = len(out)                              # LDXR/STXR, then the copy again: no branch back
    out += E.str_pre(st, 31, -16)
    loop = len(out)
    out += E.ldxr(v, a) + E.add_imm(v, v, 1) + E.stxr(st, v, a)
    out += _e(E.cbz, at + len(out), st, 0, 1, at + loop)
    out += E.ldr_post(st, 31, 16) + undo
    for insn in dcr:
        out += copy(insn, at + len(out))
    out += _e(E.b, at + len(out), back)
    slow = len(out)
    out += undo + probe_stub(site, slow_entry, at + len(out) + len(undo))
    out += _e(E.b, at + len(out), resume)
    out[pair:pair + 8] = _e(E.cbz, at + pair, v, 0, 1, at + tail) + _e(E.b, at + pair + 4, at + slow)
    near.stubs(out, at)
    return bytes(out), resume


def light_alternatives_c(image, detours: list[tuple[int, bool]], A) -> str:
    """The runtime's table of the light detours to rewrite where the CPU has LSE atomics
    (kp_alternatives.c): each one's two words (light_patch_at() of each (detour,
    red_zone)), sorted, as C (A: an address as C); and whether the image's code pages
    are BTI-guarded, so that the pages rewritten stay so."""
    alts = sorted(light_patch_at(at, red_zone) for at, red_zone in detours)
    return (f"const unsigned long kp_light_alt[{len(alts)}] = {{ {', '.join(A(x) for x in alts)} }};\n"
            f"const unsigned int kp_nlight_alt = {len(alts)};\n"
            f"const unsigned int kp_light_alt_bti = {int(bti.guarded(image))};")


def light_patch_at(at: int, red_zone: bool) -> int:
    """Where the light detour at `at` holds the two words the runtime rewrites at
    start-up where the CPU has LSE atomics (light_detour()): after the save (not at a
    function's entry), the shard, the counter's address and kp_fast, 5 words however
    far the data lie (_Near keeps a detour as long)."""
    return at + 20 + (0 if red_zone else 4)


LIGHT_PAGE = 512           # counters per 4 KiB page


def light_counter(slot: int) -> int:
    """Where hit slot `slot`'s counter of shard 0 lies in kp_light_hits[], in
    bytes (the runtime's KP_LIGHT_INDEX: shards interleave page by page, so shard
    s's is 4096 * s further)."""
    return (slot // LIGHT_PAGE * O.LIGHT_SHARDS * LIGHT_PAGE + slot % LIGHT_PAGE) * 8


def evicted_detour(dcr: list[DcrInsn], at: int) -> bytes:
    """An evicted neighbour's detour: never made on aarch64 (every region is one instruction)."""
    return _after(b"", dcr, at, None, None)[0]


def evict_patch(addr: int, region_len: int, detour: int, probe_detour: int) -> bytes:
    raise EmitError("no evicted regions on aarch64")


def jump_patch(addr: int, region_len: int, target: int) -> bytes:
    """The optimized probe itself: B to the detour (the rest of a longer region udf)."""
    return _e(E.b, addr, target) + UDF * ((region_len - 4) // 4)


def short_jump_patch(addr: int, region_len: int, slot: int) -> bytes:
    raise EmitError("no short jumps on aarch64")


def branch_disp(code: bytes) -> int | None:
    """0 for a B or BL (retarget_patch() rewrites the whole word), None otherwise."""
    if len(code) >= 4 and (int.from_bytes(code[:4], "little") & 0x7C000000) == 0x14000000:
        return 0
    return None


def retarget_patch(addr: int, code: bytes, target: int) -> tuple[int, bytes]:
    """The B/BL at addr naming target instead."""
    link = bool(int.from_bytes(code[:4], "little") >> 31)
    return addr, _e(E.b, addr, target, link)


def entry_stub(at: int, start_fn: int, orig_entry: int) -> bytes:
    """New e_entry of an executable: x0 = kp_user_start(sp, x0) (x0: the ELF
    ABI's exit function, passed on), then the program's entry; sp untouched."""
    out = (0xAA0003E1).to_bytes(4, "little") + E.add_imm(0, 31, 0)      # mov x1, x0; mov x0, sp
    out += _e(E.b, at + 8, start_fn, True)
    return out + _far_b(at + 12, orig_entry)


def chain_stub(at: int, fn: int, then: int) -> bytes:
    """An init/fini function for a shared object: fn(argc, argv, envp), then the
    function the slot held before, with the same arguments.  ld.so calls it
    with a `blr`: `bti c` first, its landing pad when the pages are BTI-guarded
    (a hint, a nop elsewhere)."""
    out = BTI_C + E.stp_pre(29, 30, 31, -48) + E.stp(0, 1, 31, 16) + E.stp(2, 3, 31, 32)
    out += _e(E.b, at + len(out), fn, True)
    out += E.ldp(0, 1, 31, 16) + E.ldp(2, 3, 31, 32) + E.ldp_post(29, 30, 31, 48)
    return out + _far_b(at + len(out), then)


def call_stub(at: int, fn: int) -> bytes:
    """A fini function of our own for a shared object that had none: fn(), then ret."""
    out = BTI_C + E.stp_pre(29, 30, 31, -16)
    out += _e(E.b, at + len(out), fn, True)
    return out + E.ldp_post(29, 30, 31, 16) + (0xD65F03C0).to_bytes(4, "little")      # ret


def signal_syscall_stub(at: int, sc, hook: int) -> bytes:
    """Unused: signal_syscalls() finds none on AArch64 yet."""
    raise NotImplementedError("signal system call stubs on AArch64")


def _far_b(at: int, target: int) -> bytes:
    """A tail branch from a start-up stub to the program's code: B when in reach,
    else adrp + add + br x16 (a linker's veneer: x16 is IP0, free between
    calls; a br through x16 lands on `bti c` too, under BTI)."""
    if -(1 << 27) <= target - at < (1 << 27):
        return _e(E.b, at, target)
    return _e(E.adrp, at, 16, target) + E.add_imm(16, 16, target & 0xFFF) + E.br(16)


def __getattr__(name: str):
    """emit.KPROBE_SIZE & co.: offsets.py's, at first use."""
    return getattr(O, name)
