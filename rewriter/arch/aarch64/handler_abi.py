"""What linked handler code can touch, read from its machine code (AArch64).

As on x86-64 (E9Tool's clean call): a handler that can never read its `regs`
argument (AAPCS64's second argument, x1) gets the clean template, which saves only
the call-clobbered registers it and the handler write.  The walk is conservative:
x1 named by any instruction other than one that only writes it, passed to a call,
or left by a jump out of the function while it may still hold `regs` counts as a
use.  A handler whose only uses are plain loads from [x1, #imm] gets a partial
pt_regs, those fields stored (regs_loads(), emit.clean_detour's regs_fields).  Vector use is read: the
detours save no FP/SIMD state, so a prebuilt handler object that touches v0-v31 is
refused (C sources are compiled with -mgeneral-regs-only, as kernel code)."""
from __future__ import annotations

import re

import capstone

_cs = capstone.Cs(capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)
_cs.detail = False
_X1 = re.compile(r"\b[xw]1\b")
_REG = re.compile(r"\b([xw])([0-9]|[12][0-9]|30)\b")
# Instructions whose first operand is only written (never read), and whose other
# operands are read: x1 there (and nowhere else) ends regs' life on this path.
_WRITES_FIRST = re.compile(r"^(mov|movz|movn|mvn|ldr|ldrb|ldrh|ldrsb|ldrsh|ldrsw|ldur|ldurb|ldurh|ldursw|"
                           r"add|sub|and|orr|eor|bic|orn|eon|lsl|lsr|asr|ror|adr|adrp|mul|madd|msub|neg|"
                           r"csel|csinc|csinv|csneg|cset|csetm|cinc|ubfx|sbfx|ubfiz|sbfiz|uxt[bhw]|sxt[bhw]|"
                           r"udiv|sdiv|umulh|smulh|clz|rbit|rev)$")
_CALLS = ("bl", "blr", "svc", "hvc", "smc", "brk", "hlt", "udf")
_DIRECT = re.compile(r"^(b|b\.[a-z]+|cbn?z|tbn?z)$")
# What writes NZCV (besides an explicit msr).
_FLAG_SETTERS = re.compile(r"^(adds|subs|ands|bics|adcs|sbcs|negs|ngcs|cmp|cmn|tst|ccmp|ccmn|fcmpe?|fccmpe?|"
                           r"msr|setf(8|16)|rmif|cfinv|axflag|xaflag)$")
_VECTOR = re.compile(r"\b[vqdsbh]([0-9]|[12][0-9]|3[01])\b")
_VECTOR_MNEMONICS = ("fmov", "fadd", "fsub", "fmul", "fdiv", "fcmp", "scvtf", "ucvtf", "fcvt")

VECTOR_STATE = "FP/SIMD (v0-v31)"


def _target(ops: str) -> int | None:
    try:
        return int(ops.split(",")[-1].strip().lstrip("#"), 0)
    except ValueError:
        return None


def _relocated(addr: int, relocs: dict[int, str]) -> bool:
    """A relocation in the instruction: in an unlinked object, a branch to another
    symbol (R_AARCH64_CALL26/JUMP26) encodes a branch to itself."""
    return any(a in relocs for a in range(addr, addr + 4))


def _kills_x1(mnem: str, ops: str) -> bool | None:
    """True: x1 written and not read; False: not named; None: read (a use)."""
    if not _X1.search(ops):
        return False
    first, _, rest = ops.partition(",")
    if _WRITES_FIRST.match(mnem) and _X1.fullmatch(first.strip()) and not _X1.search(rest):
        return True
    return None


_LOAD = re.compile(r"^([xw])([0-9]|[12][0-9]|30|zr), \[x1(?:, #(0x[0-9a-f]+|[0-9]+))?\]$")
_LOAD_SIZE = {"ldr": None, "ldur": None, "ldrb": 1, "ldurb": 1, "ldrsb": 1, "ldursb": 1, "ldrh": 2,
              "ldurh": 2, "ldrsh": 2, "ldursh": 2, "ldrsw": 4, "ldursw": 4}


def _regs_load(mnem: str, ops: str) -> tuple[int, int, bool] | None:
    """(offset, size, x1 overwritten) of a plain load from [x1, #imm] into a register."""
    m = _LOAD.match(ops)
    if m is None or mnem not in _LOAD_SIZE:
        return None
    size = _LOAD_SIZE[mnem] or (8 if m.group(1) == "x" else 4)
    return int(m.group(3) or "0", 0), size, m.group(2) == "1"


def may_use_regs(code: bytes, start: int, end: int, relocs: dict[int, str] | None = None) -> bool:
    """Whether the function [start, end) may use the value x1 (regs) has at entry:
    every path is followed until x1 is overwritten."""
    return _regs_use(code, start, end, relocs, None) is None


def regs_loads(code: bytes, start: int, end: int, relocs: dict[int, str] | None = None,
               limit: int | None = None) -> frozenset[int] | None:
    """The pt_regs fields (byte offsets of 8-byte words) the function may read through
    regs, when its every use of x1 on every path is a plain load from [x1, #imm] within
    pt_regs (`limit` bytes) into a register: it never stores to regs, passes it on, copies
    it or reads at a computed offset.  None: any other use.  An empty set: no use."""
    loads = _regs_use(code, start, end, relocs, set())
    if loads is None:
        return None
    if limit is None:
        from . import offsets as O      # the runtime's struct pt_regs (compiled at first use)
        limit = O.PT_SIZE
    fields = set()
    for off, size in loads:
        if off < 0 or off + size > limit:
            return None
        fields.update(range(off // 8 * 8, off + size, 8))
    return frozenset(fields)


def _regs_use(code: bytes, start: int, end: int, relocs: dict[int, str] | None,
              loads: set | None) -> set | None:
    """The walk of may_use_regs() and regs_loads(): None when x1 may be used (loads:
    None, any read is a use; a set, a plain load through it is added there instead)."""
    relocs = relocs or {}
    seen: set[int] = set()
    work = [start]
    while work:
        addr = work.pop()
        while True:
            if addr in seen:
                break
            if not start <= addr < end or addr & 3:
                return None                      # fell or jumped out: unknown code
            seen.add(addr)
            got = list(_cs.disasm_lite(bytes(code[addr - start:addr - start + 4]), addr))
            if not got:
                return None
            _, _, mnem, ops = got[0]
            if mnem in _CALLS or mnem in ("br", "braa", "brab", "braaz", "brabz", "eret"):
                return None                      # the callee may take it as an argument
            kills = _kills_x1(mnem, ops)
            if kills is None:
                load = _regs_load(mnem, ops) if loads is not None else None
                if load is None:
                    return None
                loads.add(load[:2])
                kills = load[2]
            if mnem in ("ret", "retaa", "retab"):
                break
            if _DIRECT.match(mnem):
                t = _target(ops)
                if t is None or _relocated(addr, relocs):
                    return None                  # a tail call: regs passed on
                if mnem == "b":
                    addr = t
                    continue
                work.append(t)
            if kills:
                break
            addr += 4
    return loads if loads is not None else set()


def vector_use(code: bytes, start: int) -> int | None:
    """The first instruction naming an FP/SIMD register, or None."""
    for addr, _size, mnem, ops in _cs.disasm_lite(bytes(code), start):
        if mnem.startswith(_VECTOR_MNEMONICS) or _VECTOR.search(ops):
            return addr
    return None


SCRATCH = tuple(f"x{i}" for i in range(19)) + ("x30",)     # what a C call may clobber (AAPCS64)


def clobbered_scratch(code: bytes, start: int, relocs: dict[int, str] | None = None) -> set[str] | None:
    """The call-clobbered registers (x0-x18, x30) a leaf function names, and "nzcv"
    when it may write the flags; None when that cannot be known: it calls, makes a
    system call, or jumps out of itself (or, unlinked, to another symbol).  Every
    register an instruction names counts as written: more than it writes, never less."""
    relocs = relocs or {}
    out: set[str] = set()
    n = 0
    for addr, _size, mnem, ops in _cs.disasm_lite(bytes(code), start):
        n += 4
        if mnem in _CALLS or mnem.startswith(("br", "blr", "eret")):
            return None
        if _DIRECT.match(mnem):
            t = _target(ops)
            if t is None or not start <= t < start + len(code) or _relocated(addr, relocs):
                return None
        if _FLAG_SETTERS.match(mnem):
            out.add("nzcv")
        for _w, i in _REG.findall(ops):
            if int(i) <= 18 or i == "30":
                out.add(f"x{i}")
        if mnem in ("ret", "retaa", "retab") and ops.strip() not in ("", "x30"):
            return None
    if n != len(code):
        return None                              # not all of it decodes
    return out
