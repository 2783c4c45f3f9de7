"""The x86-64 jump optimizer's checks: arch/x86/kernel/kprobes/opt.c's
can_optimize() and copy_optimized_instructions(), extended where a static
rewriter can do better (relative branches in the region are re-encoded)."""
from __future__ import annotations

import bisect

import capstone
import capstone.x86_const

from ..base import DcrInsn, Refusal  # noqa: F401  (re-exported: optprobe.Refusal)
from . import insn as x86insn
from . import cs
from .common import dead_padding, mid_frame, relocatable
from ... import safety

_cs = cs.DETAIL

JMP32_INSN_SIZE = 5
JMP8_INSN_SIZE = 2                 # jmp rel8: a short jump to a 5-byte one nearby (short_jump_slot())
SHORT_JUMP_SIZE = JMP8_INSN_SIZE
MAX_OPTIMIZED_LENGTH = 15 + 4      # MAX_INSN_SIZE + DISP32_SIZE, as the kernel
ENDBR64 = b"\xf3\x0f\x1e\xfa"


def adjust_kprobe_addr(image, sym_addr: int, offset: int) -> int:
    """arch_adjust_kprobe_addr(): a probe on a function's entry (offset 0 or 4)
    whose first instruction is endbr64 goes after the ENDBR."""
    if offset in (0, 4) and image.read(sym_addr, 4) == ENDBR64:
        return sym_addr + 4
    return sym_addr + offset


def can_probe_insn(image, addr: int) -> Refusal | None:
    """can_probe()'s per-instruction refusals (int3, ud2, int n, ...)."""
    try:
        info = x86insn.classify(image.read(addr, 16), addr)
    except ValueError:
        return Refusal("decode", addr, "the instruction cannot be decoded")
    if info.probe_refused:
        return Refusal("can_probe", addr, f"{info.probe_refused} cannot be probed")
    return None


_UNCOND = ("ret", "ret imm", "jmp rel", "jmp mem", "jmp reg")


def copy_region(image, func, addr: int, analysis=None, min_end: int | None = None,
                jump_size: int = JMP32_INSN_SIZE) -> list[DcrInsn] | Refusal:
    """The detoured code region (DCR): whole instructions covering the 5-byte jump,
    each one relocatable (copy_optimized_instructions() with can_boost(), plus
    relative jumps and a final call, which we re-encode).  A region may run on
    into the alignment padding after the function (nop, or int3 after an
    unconditional exit) if nothing names those bytes (_borrow_padding()).
    min_end: cover at least [addr, min_end) (a region shared by the probes
    after it, planner.sites.share_regions()); the kernel's MAX_OPTIMIZED_LENGTH,
    the size of its fixed buffer, does not bound such a region.
    jump_size: the bytes the jump takes (JMP8_INSN_SIZE: short_jump_slot())."""
    out: list[DcrInsn] = []
    pos = addr
    end = max(addr + jump_size, min_end or 0)
    # The function's decoding has each instruction's length (Capstone's, as classify()'s).
    bounds = analysis.decoded(func).boundaries if analysis is not None else ()
    while pos < end:
        code = image.read(pos, 16)
        n, i = None, bisect.bisect_left(bounds, pos - func.start)
        if i + 1 < len(bounds) and bounds[i] == pos - func.start:
            n = bounds[i + 1] - bounds[i]
        try:
            info = x86insn.classify(code, pos, n)
        except ValueError:
            return Refusal("decode", pos, "instruction in the region cannot be decoded")
        code = code[:info.length]
        if pos >= func.end and code == b"\xcc" and out and out[-1].info.emulate in _UNCOND:
            out.append(DcrInsn(pos, code, info))      # padding never reached: copied, never run
            pos += info.length
            continue
        if info.probe_refused and info.emulate not in _INDIRECT:
            return Refusal("can_probe", pos, f"{info.probe_refused} in the region")
        if info.emulate in ("jmp rel", "jcc rel", "jmp mem", "jmp reg"):
            pass
        elif info.emulate in ("call rel", "call mem", "call reg"):
            if pos + info.length < end and safety.enabled("call_in_region"):
                return Refusal("call_in_region", pos, "a call inside the region would return into the jump's bytes")
            why = _indirect_call_relocatable(code, pos) if info.emulate != "call rel" else None
            if why:
                return Refusal("can_boost", pos, why)
        elif not info.boostable and safety.enabled("boostable"):
            why = relocatable(code, pos, info)
            if why:
                return Refusal("can_boost", pos, f"instruction is not boostable ({info.boost_reason}) "
                                                 f"nor relocatable ({why})")
        out.append(DcrInsn(pos, code, info))
        pos += info.length
    if pos - addr > MAX_OPTIMIZED_LENGTH and min_end is None:
        return Refusal("region_size", addr, f"region is {pos - addr} bytes, more than {MAX_OPTIMIZED_LENGTH}")
    if pos > func.end and (analysis is None or not _borrow_padding(image, analysis, func, pos)) \
            and safety.enabled("function_bounds"):
        return Refusal("func_size", addr, f"region [{addr:#x}, {pos:#x}) crosses the end of {func.name} at "
                                          f"{func.end:#x}, and the bytes after it are not padding to borrow")
    # An unconditional jump ends the flow; what follows in the DCR is dead in the copy
    # but still protected by the JTPR check.
    return out


# Indirect branches through memory: the kernel cannot emulate them
# (prepare_emulation()'s -EOPNOTSUPP); a detour copies the jmp (its RIP-relative
# operand re-encoded) and emulates the call (emit.relocate()).
_INDIRECT = ("jmp mem", "call mem")

def _indirect_call_relocatable(code: bytes, addr: int) -> str:
    """A final call *%reg / *m64 is emulated in the detour (emit.relocate()):
    the original return address pushed, then the same operand jumped through.
    Its operand is read after the detour has pushed a word, so it must not use
    %rsp."""
    ci = next(_cs.disasm(code, addr, 1), None)
    if ci is None or not ci.operands:
        return "not decoded"
    op = ci.operands[0]
    sp = capstone.x86_const.X86_REG_RSP
    if op.type == capstone.x86_const.X86_OP_REG and op.reg == sp:
        return "call through %rsp"
    if op.type == capstone.x86_const.X86_OP_MEM and sp in (op.mem.base, op.mem.index) and safety.enabled("rsp_relative_call"):
        return "call through an %rsp-relative operand"
    if op.type == capstone.x86_const.X86_OP_MEM and op.mem.segment:
        return "call through a segment-relative operand"
    return ""


def _borrow_padding(image, analysis, func, end: int) -> bool:
    """Beyond the kernel (which keeps a region inside its function): may
    [func.end, end) be part of a region?  Only alignment padding (nop, int3)
    that no symbol, FDE, relocation or jump names, in no other function."""
    return dead_padding(image, analysis, func, func.end, end - func.end)


def can_optimize(image, analysis, func, addr: int, min_end: int | None = None,
                 jump_size: int = JMP32_INSN_SIZE) -> list[DcrInsn] | Refusal:
    """can_optimize() of opt.c: region inside one function, no indirect jump in the
    function, no jump target in the JTPR, every DCR instruction relocatable.
    min_end: the region must cover [addr, min_end) (copy_region()); jump_size:
    the bytes the jump at addr takes (2 for a short jump, short_jump_slot())."""
    if func is None:
        return Refusal("func_size", addr, "no function symbol or FDE covers the address")
    if func.end - addr < jump_size and not _borrow_padding(image, analysis, func, addr + jump_size) \
            and safety.enabled("function_bounds"):
        return Refusal("func_size", addr, f"fewer than 5 bytes from the probe to the end of {func.name} at "
                                          f"{func.end:#x}, and no padding after it to borrow")
    decoded = analysis.decoded(func)
    if decoded.undecodable is not None and safety.enabled("decode"):
        return Refusal("decode", decoded.undecodable, f"{func.name} cannot be decoded from its start")
    ij = analysis.unbounded_indirect_jump(func)
    if decoded.sets_df is not None and safety.enabled("direction_flag"):
        # The detour calls C code, which the ABI lets assume DF = 0, and does
        # not save DF (an int3 probe is safe: the trap entry clears DF and the
        # signal frame restores it).
        return Refusal("direction_flag", decoded.sets_df, f"{func.name} sets the direction flag (std)")
    dcr = copy_region(image, func, addr, analysis, min_end, jump_size)
    if isinstance(dcr, Refusal):
        return dcr
    if ij is not None and safety.enabled("indirect_jump"):
        inside = _unbounded_jump_may_land_inside(image, analysis, func, dcr)
        if inside is not None:
            return Refusal("indirect_jump", ij[0], f"{func.name} has an indirect jump whose targets are not bounded "
                                                  f"({ij[1]}){inside}")
    end = dcr[-1].addr + len(dcr[-1].code)
    hits = analysis.targets_in(addr + 1, end)
    if hits and safety.enabled("jump_into_region"):
        target, why = hits[0]
        src = _source_address(why, target)
        return Refusal("jump_into_region", src, f"{why} lands at {target:#x}, inside the region [{addr:#x}, {end:#x})")
    return dcr


RSP_DWARF = 7


def _unbounded_jump_may_land_inside(image, analysis, func, dcr) -> str | None:
    """Beyond the kernel's insn_is_indirect_jump() refusal, which refuses the whole
    function: an indirect jump whose targets cannot be bounded matters only if it
    could land on an instruction inside the region (dcr[1:]; a one-instruction
    region has none).  It cannot where the CFA rules differ: a jump leaves %rsp as
    it is and the unwind tables give each instruction one CFA rule, so from a jump
    whose CFA is %rsp+a only an instruction whose CFA is %rsp+a is reachable (a
    prologue's pushes: the region's instructions are at %rsp+8, +16, ..., the
    jump tables' dispatch deep in the frame).  None if it cannot land inside, else
    why it may (appended to the refusal)."""
    if len(dcr) == 1:
        return None
    jumps = analysis.unbounded_indirect_jumps(func)
    if not jumps:
        return ""
    inner = [image.cfa.at(i.addr) for i in dcr[1:]]
    for src, _ in jumps:
        at_jump = image.cfa.at(src)
        if at_jump is None or at_jump[0] != RSP_DWARF:
            return f"; no %rsp-based CFA rule at {src:#x} to tell its targets from the region's instructions"
        for i, rule in zip(dcr[1:], inner):
            if rule is None or rule == at_jump or rule[0] != RSP_DWARF:
                return f"; {i.addr:#x} in the region has the jump's CFA rule, so it may be a target"
    return None


_UNCOND_MNEMONICS = ("jmp", "ret", "ud2", "hlt", "notrack jmp", "bnd jmp", "repz ret", "bnd ret")


def short_jump_slot(image, analysis, addr: int, busy) -> int | None:
    """Beyond the kernel, E9Patch's tactic for a probe whose region cannot reach
    5 bytes (a jump target 2-4 bytes on, e.g. glibc's memmove entered by
    mempcpy 3 bytes in): a 2-byte `jmp rel8` at addr to 5 bytes of dead
    padding within reach, which take the `jmp rel32` to the detour.  Dead: the
    padding runs on from an unconditional exit (ret, jmp, ud2, hlt), so nothing
    falls into it, and from there to the slot's end it is nop/int3 bytes that no
    known jump target, symbol or other function names (common.dead_padding()), so
    nothing jumps into it.  busy(lo, hi): another site's bytes overlap [lo, hi).
    The slot's address, or None."""
    import bisect
    lo, hi = addr + JMP8_INSN_SIZE - 128, addr + JMP8_INSN_SIZE + 127    # where the slot may start
    starts = [f.start for f in image.functions]
    i = max(bisect.bisect_right(starts, lo) - 1, 0)
    for g in image.functions[i:]:
        if g.start > hi:
            break
        code = image.read(g.start, g.end - g.start)
        for a, size, mnem, _ops in cs.LITE.disasm_lite(code, g.start):
            p = a + size
            if p > hi or not mnem.startswith(_UNCOND_MNEMONICS):
                continue
            for at in range(max(p, lo), hi + 1):
                if not dead_padding(image, analysis, g, p, at + JMP32_INSN_SIZE - p):
                    break           # a longer run is not padding either
                if not busy(at, at + JMP32_INSN_SIZE):
                    return at
    return None


def evict_candidates(image, analysis, addr: int):
    """Where a neighbouring region to evict may start for a short jump at addr
    (planner.short_jumps.evict_neighbour()): instruction boundaries n0 of decodable
    functions whose n0 + 5, the slot, is in the jmp rel8's reach.  Nearest the
    probe first, then lower addresses; yields (function, n0)."""
    import bisect
    base = addr + JMP8_INSN_SIZE - JMP32_INSN_SIZE
    lo, hi = base - 128, base + 127
    starts = [f.start for f in image.functions]
    i = max(bisect.bisect_right(starts, lo) - 1, 0)
    out = []
    for g in image.functions[i:]:
        if g.start > hi:
            break
        if g.end <= lo:
            continue
        d = analysis.decoded(g)
        if d.undecodable is not None:
            continue
        for off in d.boundaries:
            n0 = g.start + off
            if lo <= n0 <= hi:
                out.append((abs(n0 - addr), n0, g))
    for _, n0, g in sorted(out, key=lambda t: (t[0], t[1])):
        yield g, n0


def can_evict(image, analysis, func, n0: int) -> list[DcrInsn] | Refusal:
    """can_optimize() for a region at n0 long enough for two jumps (its own, and a
    short-jump probe's in its dead second half), holding no exit of func: no ret,
    no indirect jmp, no jump out of func (a kretprobe's return hook could not see
    it run in the copy)."""
    r = can_optimize(image, analysis, func, n0, min_end=n0 + 2 * JMP32_INSN_SIZE)
    if not isinstance(r, list):
        return r
    end = r[-1].addr + len(r[-1].code)
    if end - n0 > MAX_OPTIMIZED_LENGTH:
        return Refusal("region_size", n0, f"region is {end - n0} bytes, more than {MAX_OPTIMIZED_LENGTH}")
    for i in r if safety.enabled("eviction") else []:
        e = i.info.emulate
        if e in ("ret", "ret imm", "jmp mem", "jmp reg") or \
                (e in ("jmp rel", "jcc rel") and not func.start <= i.info.rel_target < func.end):
            return Refusal("evict_exit", i.addr, "the evicted region would hold an exit of its function")
    return r


def _source_address(why: str, target: int) -> int:
    # "jump from 0x401234" -> the jumping instruction is the offender.
    if why.startswith("jump from "):
        return int(why.split()[2], 16)
    return target




# -- What the detour may assume at a probe point (used by the clean-call template) --

_ARITH_READ = (capstone.x86_const.X86_EFLAGS_TEST_OF | capstone.x86_const.X86_EFLAGS_TEST_SF
               | capstone.x86_const.X86_EFLAGS_TEST_ZF | capstone.x86_const.X86_EFLAGS_TEST_AF
               | capstone.x86_const.X86_EFLAGS_TEST_PF | capstone.x86_const.X86_EFLAGS_TEST_CF)
_WRITES = {
    flag: (getattr(capstone.x86_const, f"X86_EFLAGS_MODIFY_{flag}")
           | getattr(capstone.x86_const, f"X86_EFLAGS_RESET_{flag}")
           | getattr(capstone.x86_const, f"X86_EFLAGS_UNDEFINED_{flag}")
           | (getattr(capstone.x86_const, f"X86_EFLAGS_SET_{flag}", 0)))
    for flag in ("OF", "SF", "ZF", "AF", "PF", "CF")
}


def is_function_entry(image, func, addr: int) -> bool:
    """The probe sits where the function is entered by a call or tail jump
    (its first byte, or just after its endbr64)."""
    return func is not None and func.name != "_start" and \
        (addr == func.start or (addr == func.start + 4 and image.read(func.start, 4) == ENDBR64))


def stack_aligned_at(image, func, addr: int) -> bool:
    """The System V ABI fixes %rsp = 8 (mod 16) at a function's entry, if a call
    lands there (not a stripped cold block entered mid-frame: mid_frame())."""
    return is_function_entry(image, func, addr) and mid_frame(image, addr) is None


def red_zone_free_at(image, func, addr: int) -> bool:
    """The System V ABI's red zone, the 128 bytes below %rsp, is the callee's at
    its entry (nothing of the caller's lies below the return address) and a
    signal frame is built below it: a detour may keep data there without moving
    %rsp.  Anywhere else the function may be using it, and so may the function
    whose `.cold` part (gcc's -freorder-blocks-and-partition) is jumped into
    with its frame live (named so, or stripped and told by its FDE: mid_frame())."""
    return is_function_entry(image, func, addr) and ".cold" not in func.name and mid_frame(image, addr) is None \
        or not safety.enabled("red_zone")


def arith_flags_dead(image, func, addr: int, limit: int = 32) -> bool:
    """Whether OF SF ZF AF PF CF are dead at addr: at a function entry (the ABI
    gives them no role across calls), else when straight-line code from addr
    overwrites all six, or reaches a call or ret, before reading any."""
    if is_function_entry(image, func, addr):
        return True
    written = set()
    pos = addr
    for _ in range(limit):
        if func is None or not func.start <= pos < func.end:
            return False
        ci = next(_cs.disasm(image.read(pos, 16), pos, 1), None)
        if ci is None:
            return False
        ef = ci.eflags or 0
        if ef & _ARITH_READ:
            return False
        written |= {f for f, bits in _WRITES.items() if ef & bits}
        if len(written) == 6:
            return True
        groups = set(ci.groups)
        if capstone.CS_GRP_CALL in groups or capstone.CS_GRP_RET in groups:
            return True
        if capstone.CS_GRP_JUMP in groups or capstone.CS_GRP_INT in groups:
            return False
        pos += ci.size
    return False
