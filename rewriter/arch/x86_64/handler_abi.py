"""What linked handler code can touch, read from its machine code (x86-64).

The kernel's optprobe always builds a full struct pt_regs, because a module's
handler is opaque to it.  kprewrite compiles and links the handlers itself, so it
can read them: a handler that can never read its `regs` argument (the System V
ABI's second argument, %rsi) is called through a clean call, which saves only
what a C call clobbers (E9Tool's distinction between a clean call and a call
with the `state` argument).  The analysis is conservative: any path on which
%rsi may still hold `regs` when it is read, copied, passed to a call or left by
a jump out of the function counts as a use.

It also finds vector and x87 register use: the detour does not save the
SSE/AVX state, so a prebuilt handler object that touches it is refused (C
sources are compiled with -mgeneral-regs-only, like kernel code).
"""
from __future__ import annotations

import re

import capstone
from capstone import x86_const as X
from . import cs

_cs = cs.DETAIL

_RSI_FULL = {X.X86_REG_RSI, X.X86_REG_ESI}            # writing these kills the old value
_RSI_ANY = _RSI_FULL | {X.X86_REG_SI, X.X86_REG_SIL}
_BRANCH_GROUPS = (capstone.CS_GRP_JUMP, capstone.CS_GRP_CALL, capstone.CS_GRP_RET,
                  capstone.CS_GRP_INT, capstone.CS_GRP_IRET)


def _reads_rsi(ci) -> bool:
    if ci.mnemonic in ("syscall", "sysenter", "int", "int3"):
        return True
    if _zero_idiom(ci):
        return False
    try:
        read, _ = ci.regs_access()
    except capstone.CsError:
        return True
    if any(r in _RSI_ANY for r in read):
        return True
    # Memory operands use their base/index registers (regs_access covers them,
    # but be explicit: `mov 8(%rsi),%rax` is the typical use of regs).
    for op in ci.operands:
        if op.type == X.X86_OP_MEM and (op.mem.base in _RSI_ANY or op.mem.index in _RSI_ANY):
            return True
    return False


def _zero_idiom(ci) -> bool:
    """`xor %esi,%esi` and `sub %esi,%esi` write %rsi without depending on it."""
    ops = ci.operands
    return (ci.mnemonic in ("xor", "sub") and len(ops) == 2 and ops[0].type == ops[1].type == X.X86_OP_REG
            and ops[0].reg == ops[1].reg)


def _kills_rsi(ci) -> bool:
    if ci.mnemonic.startswith("cmov"):
        return False                             # written only when the condition holds
    try:
        _, written = ci.regs_access()
    except capstone.CsError:
        return False
    return any(r in _RSI_FULL for r in written)


def _relocated(ci, relocs: dict[int, str]) -> bool:
    """A relocation other than the return thunk lies in the instruction's bytes:
    its operand names another symbol (an unlinked object's call or jump out)."""
    return any(relocs.get(a) not in (None, *RETURN_THUNKS) for a in range(ci.address + 1, ci.address + ci.size))


def _target(ci):
    if ci.operands and ci.operands[0].type == X.X86_OP_IMM:
        return ci.operands[0].imm
    return None


# A jmp to one of these is a return: a kernel built with CONFIG_RETHUNK (and code
# compiled for it, -mfunction-return=thunk-extern) returns through the thunk.
# The register state detours do not save (handlers are compiled -mgeneral-regs-only).
VECTOR_STATE = "SSE/AVX/x87"

RETURN_THUNKS = frozenset({"__x86_return_thunk"})


def may_use_regs(code: bytes, start: int, end: int, relocs: dict[int, str] | None = None) -> bool:
    """Whether the function [start, end) (code = its bytes) may use the value
    %rsi has at entry.  Follows every path until %rsi is overwritten.
    relocs: offset of a relocated field -> the symbol it names (an object's)."""
    return _regs_use(code, start, end, relocs, None) is None


# Instructions whose memory operand (through regs) is only read, and which write
# nothing but their register destination and the flags: (mnemonic, where the memory
# operand may be: 1, the source of a two-operand form; 0 or 1: either, cmp and test).
_LOAD_SOURCE = re.compile(r"^(mov|movzx|movsx|movsxd|add|sub|and|or|xor|adc|sbb|imul|cmov[a-z]+)$")
_LOAD_EITHER = ("cmp", "test")
_RSI_PART = {X.X86_REG_SI, X.X86_REG_SIL}              # writing these leaves a pointer derived from regs


def _regs_load(ci) -> tuple[int, int] | None:
    """(offset, size) when the instruction's one use of %rsi is a plain load from
    [%rsi + constant] into a register or the flags; None for any other use."""
    if ci.mnemonic == "imul" and len(ci.operands) not in (2, 3):
        return None
    where = (1,) if _LOAD_SOURCE.match(ci.mnemonic) else (0, 1) if ci.mnemonic in _LOAD_EITHER else ()
    mem = None
    for i, op in enumerate(ci.operands):
        if op.type == X.X86_OP_MEM:
            if mem is not None or i not in where:
                return None
            m = op.mem
            if m.base not in _RSI_FULL - {X.X86_REG_ESI} or m.index != 0 or m.segment != 0:
                return None
            mem = (m.disp, op.size)
        elif op.type == X.X86_OP_REG and op.reg in _RSI_ANY:
            # %rsi as a register operand: only as a plain load's destination (it then no
            # longer holds regs), never as a value read.
            if not (i == 0 and ci.mnemonic in ("mov", "movzx", "movsx", "movsxd")):
                return None
    if mem is None or ci.prefix[0] not in (0,) or ci.mnemonic.startswith("lock"):
        return None
    try:
        read, written = ci.regs_access()
    except capstone.CsError:
        return None
    if any(r in _RSI_PART for r in written):
        return None
    return mem


def regs_loads(code: bytes, start: int, end: int, relocs: dict[int, str] | None = None,
               limit: int | None = None) -> frozenset[int] | None:
    """The pt_regs fields (their byte offsets, 8-byte words) the function [start, end)
    may read through its regs argument, when every use of the %rsi it has at entry is a
    load from [%rsi + constant] inside the first `limit` bytes (pt_regs' size) into a
    register or the flags, on every path until %rsi is overwritten: it never stores to
    regs, passes it on, copies it or reads at a computed offset.  None: any other use
    (may_use_regs()'s uses but these loads).  An empty set: no use at all."""
    loads = _regs_use(code, start, end, relocs, set())
    if loads is None:
        return None
    if limit is None:
        from . import offsets as O      # the runtime's struct pt_regs (compiled at first use)
        limit = O.PT_SIZE
    fields = set()
    for off, size in loads:
        if off < 0 or size <= 0 or (limit is not None and off + size > limit):
            return None
        fields.update(range(off // 8 * 8, off + size, 8))
    return frozenset(fields)


def _regs_use(code: bytes, start: int, end: int, relocs: dict[int, str] | None,
              loads: set | None) -> set | None:
    """The walk of may_use_regs() and regs_loads(): None when %rsi may be used (loads:
    None, any read is a use; a set, a plain load through it is added there instead)."""
    relocs = relocs or {}
    seen: set[int] = set()
    work = [start]
    while work:
        addr = work.pop()
        while True:
            if addr in seen:
                break
            if not start <= addr < end:
                return None                      # fell or jumped out: unknown code
            seen.add(addr)
            ci = next(_cs.disasm(code[addr - start:addr - start + 16], addr, 1), None)
            if ci is None:
                return None
            if _reads_rsi(ci):
                load = _regs_load(ci) if loads is not None else None
                if load is None:
                    return None
                loads.add(load)
            groups = set(ci.groups)
            if capstone.CS_GRP_RET in groups:
                break
            if ci.mnemonic == "jmp" and relocs.get(addr + 1) in RETURN_THUNKS:
                break                            # jmp __x86_return_thunk: a return
            if capstone.CS_GRP_JUMP in groups and _relocated(ci, relocs):
                return None                      # a jump to another symbol: a tail call, regs passed on
            if capstone.CS_GRP_CALL in groups:
                return None                      # the callee may take it as an argument
            if capstone.CS_GRP_INT in groups or capstone.CS_GRP_IRET in groups:
                return None
            if _kills_rsi(ci):
                break                            # this path no longer holds regs
            nxt = addr + ci.size
            if capstone.CS_GRP_JUMP in groups:
                t = _target(ci)
                if t is None:
                    return None                  # indirect jump: could go anywhere
                if ci.mnemonic == "jmp":
                    addr = t
                    continue
                work.append(t)                   # conditional: both ways
            if ci.mnemonic == "ud2" or ci.mnemonic == "hlt":
                break
            addr = nxt
    return loads if loads is not None else set()


_VECTOR_GROUPS = {X.X86_GRP_SSE1, X.X86_GRP_SSE2, X.X86_GRP_SSE3, X.X86_GRP_SSSE3, X.X86_GRP_SSE41,
                  X.X86_GRP_SSE42, X.X86_GRP_SSE4A, X.X86_GRP_AVX, X.X86_GRP_AVX2, X.X86_GRP_AVX512,
                  X.X86_GRP_FMA, X.X86_GRP_FMA4, X.X86_GRP_F16C, X.X86_GRP_FPU, X.X86_GRP_MMX,
                  X.X86_GRP_3DNOW, X.X86_GRP_AES, X.X86_GRP_PCLMUL, X.X86_GRP_SHA, X.X86_GRP_XOP}
_VECTOR_REG = re.compile(r"^(xmm|ymm|zmm|mm|st)\d*$|^k[0-7]$")


# Whole-state saves and restores, and the x87 control/status moves: capstone puts
# them in no vector group and lists no vector register.
_VECTOR_STATE_MNEMONICS = re.compile(r"^(fx(save|rstor)|xsave|xrstor|fn?(stcw|stsw|ldcw|stenv|ldenv|save|rstor))")


def vector_use(code: bytes, start: int) -> int | None:
    """Address of the first instruction that touches SSE/AVX/AVX-512/x87/MMX
    state in `code` (loaded at `start`), or None."""
    for ci in _cs.disasm(code, start):
        if _VECTOR_GROUPS & set(ci.groups) or _VECTOR_STATE_MNEMONICS.match(ci.mnemonic):
            return ci.address
        try:
            read, written = ci.regs_access()
        except capstone.CsError:
            continue
        if any(_VECTOR_REG.match(ci.reg_name(r) or "") for r in (*read, *written)):
            return ci.address
    return None


SCRATCH = ("rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11")   # what a C call may clobber
_PARENT = {}
for _r in ("ax", "cx", "dx"):
    for _n in (f"r{_r}", f"e{_r}", _r, _r[0] + "l", _r[0] + "h"):
        _PARENT[_n] = f"r{_r}"
for _r in ("si", "di"):
    for _n in (f"r{_r}", f"e{_r}", _r, _r + "l"):
        _PARENT[_n] = f"r{_r}"
for _i in (8, 9, 10, 11):
    for _s in ("", "d", "w", "b"):
        _PARENT[f"r{_i}{_s}"] = f"r{_i}"


def clobbered_scratch(code: bytes, start: int, relocs: dict[int, str] | None = None) -> set[str] | None:
    """The call-clobbered registers a leaf function writes (code loaded at
    `start`), or None when that cannot be known: it calls, makes a system call,
    or jumps out of itself (relocs: offset of a relocated field -> the symbol it
    names; in an unlinked object a jump to another symbol holds a zero, relocated
    displacement that would read as a jump inside).  Lets the clean-call template
    save only those."""
    relocs = relocs or {}
    out: set[str] = set()
    end = start
    for ci in _cs.disasm(code, start):
        end = ci.address + ci.size
        groups = set(ci.groups)
        if groups & {capstone.CS_GRP_CALL, capstone.CS_GRP_INT, capstone.CS_GRP_IRET} or \
                ci.mnemonic in ("syscall", "sysenter"):
            return None
        if capstone.CS_GRP_JUMP in groups:
            t = _target(ci)
            if t is None or not start <= t < start + len(code) or _relocated(ci, relocs):
                return None
        try:
            _, written = ci.regs_access()
        except capstone.CsError:
            return None
        for r in written:
            parent = _PARENT.get(ci.reg_name(r) or "")
            if parent:
                out.add(parent)
    if end != start + len(code):
        return None                              # not all of it decodes
    return out
