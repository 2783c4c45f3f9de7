"""Helpers the optimized probes (optprobe.py) and the return hooks (retprobe.py)
both use: whether an instruction can run from a detour, whether bytes after an
exit are dead padding a region may take, and whether an address is entered by a
call (its unwind rule)."""
from __future__ import annotations

import capstone
import capstone.x86_const

from . import cs

PAD_OK = ("nop", "int3")
DWARF_RBP, DWARF_RSP = 6, 7     # the x86-64 psABI's DWARF register numbers

_CONTROL = frozenset([capstone.CS_GRP_JUMP, capstone.CS_GRP_CALL, capstone.CS_GRP_RET, capstone.CS_GRP_INT,
                      capstone.CS_GRP_IRET, capstone.CS_GRP_PRIVILEGE, capstone.CS_GRP_BRANCH_RELATIVE])
_NOT_RELOCATABLE = frozenset(["popf", "popfq", "popfd", "xbegin", "xabort", "xend", "enclu", "sysenter",
                              "sysexit", "sysret", "iretq", "iretd", "iret", "rsm", "hlt"])


def relocatable(code: bytes, addr: int, info) -> str:
    """Beyond can_boost(): an instruction that behaves the same at another
    address followed by more code, because it neither transfers control nor
    touches TF/RTM state, and its only use of its own address is a RIP-relative
    operand, which relocate() re-encodes (SSE/AVX moves and compares, bt,
    push m64...).  Returns '' if so, else why not."""
    if info.emulate:
        return f"{info.emulate} is emulated"
    ci = next(cs.DETAIL.disasm(code, addr, 1), None)
    if ci is None:
        return "not decoded"
    if _CONTROL & set(ci.groups):
        return "transfers control"
    if ci.mnemonic in _NOT_RELOCATABLE:
        return f"{ci.mnemonic} changes TF, RTM or privilege state"
    for op in ci.operands:
        if op.type == capstone.x86_const.X86_OP_MEM and op.mem.base == capstone.x86_const.X86_REG_RIP \
                and not info.rip_relative:
            return "RIP-relative operand not found by the decoder"
    return ""


def dead_padding(image, analysis, part, start: int, need: int) -> bool:
    """May [start, start + need) be overwritten?  It follows an unconditional
    exit, so only a jump could reach it: it must be alignment padding (nop,
    int3) that no known jump lands in, inside this function or between
    functions."""
    if need <= 0:
        return True
    if analysis.targets_in(start, start + need):
        return False
    for a in range(start, start + need):
        f = image.function_at(a)
        if not image.is_code(a) or (f is not None and f.start != part.start):
            return False
    code = image.read(start, need + 15)
    pos = 0
    for _a, size, mnem, _ops in cs.LITE.disasm_lite(code, start):
        if mnem not in PAD_OK:
            return False
        pos += size
        if pos >= need:
            return True
    return False


def mid_frame(image, addr: int):
    """None if a call may land at `addr` as far as the unwind information says (no FDE
    covers it, or its rule is CFA = %rsp + 8 with the return address at CFA - 8),
    else (the CFA rule, the return address's offset): a block of a larger function
    with an FDE of its own (GCC's hot/cold splitting, stripped of its `.cold` name)
    starts mid-frame, the parent's frame and red zone live."""
    rule = image.cfa.at(addr)
    ra = image.cfa.return_address(addr)
    if rule is None or rule == (DWARF_RSP, 8) and ra in (-8, None):
        return None
    return rule, ra
