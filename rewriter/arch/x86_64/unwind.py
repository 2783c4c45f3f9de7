"""Call frame information for x86-64 detours (what objtool computes for the
kernel's own code and turns into ORC; here, DWARF CFI for a user ELF's
.eh_frame).

A detour is described as a frame of its own standing for the probed function
at the hit: its CFA is the stack pointer at the hit, its return address the
probe's address + 1 (as regs->ip reads, and as a return address: an unwinder
looks up the instruction before it, the probed one, whose CFA rule describes
the function's frame at the hit).  So a backtrace taken in a handler shows the
handler, the runtime, the detour, the probed function, and its callers, as the
kernel's kprobes give one: the pt_regs frame, then the probed function.

The stack depth at each instruction comes from following the detour's code (a
data flow over its own branches, as objtool's does): pushes, pops and `lea`
moves of %rsp keep it known; a realignment (`and $-16, %rsp`) after `mov %rsp,
%REG` makes the CFA REG-based, and the old %rsp stored at [%rsp + k] makes it
[%rsp + k]-based.  The return address is computed, not read: the address a call
in the detour pushed (just below the caller's %rsp as the unwinder recovers it:
the callee's CFA) plus the distance from there to the hit, so it holds at every
call site, where an unwinder needs it (a handler, the runtime's entries); at
any other instruction only the CFA is exact."""
from __future__ import annotations

import bisect
import functools
import re

from . import cs
from ...elf.ehframe.write import sleb as _sleb, uleb as _uleb

# DWARF register numbers (the x86-64 psABI's).
DWARF = {"rax": 0, "rdx": 1, "rcx": 2, "rbx": 3, "rsi": 4, "rdi": 5, "rbp": 6, "rsp": 7,
         **{f"r{i}": i for i in range(8, 16)}}
RA_COLUMN = 16
CODE_ALIGN, DATA_ALIGN = 1, -8
# The CIE's initial rule, as gcc's: CFA = %rsp + 8, return address at CFA - 8.
CIE_INSNS = bytes([0x0C, 7, 8, 0x80 | RA_COLUMN, 1])
CALLEE_SAVED = ("rbx", "rbp", "r12", "r13", "r14", "r15")

_MEM = re.compile(r"^(?:qword ptr )?\[rsp(?: ([+-]) (0x[0-9a-f]+|\d+))?\]$")


def _num(s: str) -> int:
    return int(s, 0)


def _rsp_disp(op: str) -> int | None:
    """k of a `[rsp + k]` operand, None for any other."""
    m = _MEM.match(op)
    if not m:
        return None
    k = _num(m.group(2)) if m.group(2) else 0
    return -k if m.group(1) == "-" else k


def _step(state, mn: str, ops: list[str]):
    """The state after one instruction.  state: (kind, base, d, saved) with kind
    "rsp" (CFA = %rsp + d), "reg" (CFA = base + d), "mem" (CFA = [%rsp + base] + d)
    or None (unknown); aliases: registers holding %rsp + x, as (reg, x) pairs in base
    when kind is "rsp"; saved: callee-saved registers' slots, CFA-relative."""
    kind, base, d, saved = state
    dst = ops[0] if ops else ""
    if kind == "rsp":
        aliases = dict(base)
        if mn == "push" or mn == "pushfq":
            return ("rsp", tuple(aliases.items()), d + 8, saved)
        if mn == "pop" or mn == "popfq":
            aliases.pop(dst, None)
            if dst == "rsp":
                return (None, None, 0, saved)
            return ("rsp", tuple(aliases.items()), d - 8, saved)
        if dst == "rsp":
            src = ops[1] if len(ops) > 1 else ""
            if mn == "lea":
                k = _rsp_disp(src)
                return ("rsp", base, d - k, saved) if k is not None else (None, None, 0, saved)
            if mn in ("sub", "add") and re.fullmatch(r"0x[0-9a-f]+|\d+", src):
                n = _num(src) * (1 if mn == "sub" else -1)
                return ("rsp", base, d + n, saved)
            if mn == "and" and aliases:
                reg, x = sorted(aliases.items())[0]
                return ("reg", reg, d + x, saved)
            if mn == "mov" and src in aliases:
                return ("rsp", base, d + aliases[src], saved)
            return (None, None, 0, saved)
        if mn == "mov" and len(ops) == 2:
            k = _rsp_disp(dst)
            if k is not None and ops[1] in CALLEE_SAVED and ops[1] not in dict(saved):
                saved = tuple(sorted(saved + ((ops[1], k - d),)))
            if ops[1] == "rsp" and dst in DWARF:
                aliases[dst] = 0        # dst = %rsp, so CFA = dst + d
                return ("rsp", tuple((r, (x if r != dst else 0)) for r, x in aliases.items()), d, saved)
        if dst in aliases and mn not in ("cmp", "test", "push") and k_write(mn):
            aliases.pop(dst)
            return ("rsp", tuple(aliases.items()), d, saved)
        return state
    if kind == "reg":
        if dst == "rsp":
            src = ops[1] if len(ops) > 1 else ""
            if mn == "mov" and src == base:
                return ("rsp", (), d, saved)
            if mn in ("sub", "add", "and"):
                return state            # %rsp moves below a fixed base
            return (None, None, 0, saved)
        if mn in ("push", "pop", "pushfq", "popfq", "call"):
            return state
        if mn == "mov" and len(ops) == 2 and ops[1] == base:
            k = _rsp_disp(dst)
            if k is not None:
                return ("mem", k, d, saved)     # the old %rsp stored: survives calls
        if dst == base and k_write(mn):
            return (None, None, 0, saved)
        return state
    if kind == "mem":
        if dst == "rsp":
            if mn == "mov" and len(ops) == 2 and _rsp_disp(ops[1]) == base:
                return ("rsp", (), d, saved)
            return (None, None, 0, saved)
        if mn in ("push", "pop", "pushfq", "popfq"):
            return (None, None, 0, saved)
        return state
    return state


def k_write(mn: str) -> bool:
    """Whether an instruction writes its first operand (enough for the detours' code)."""
    return mn not in ("cmp", "test", "jmp", "call", "push", "bt", "ucomisd") and not mn.startswith("j")


_ENDS = ("jmp", "ret", "ud2", "hlt", "retq")
# _step() of (state, mnemonic, operands): detours of one template repeat the same steps.
_STEPS: dict[tuple, tuple] = {}
# The operands of a branch or call -> its literal target, or None (_target()).
_FLOW: dict[str, int | None] = {}
_START = ("rsp", (), 0, ())
_DIRECT = re.compile(r"0x[0-9a-f]+")
# What moves %rsp without naming it (_step()).
_STACK_MNS = frozenset({"push", "pop", "pushfq", "popfq"})


def _target(ops_s: str) -> int | None:
    """The literal target in a branch's or call's operands, None for an indirect one."""
    op0 = ops_s.split(",", 1)[0].strip()
    return int(op0, 16) if _DIRECT.fullmatch(op0) else None


def rows(code: bytes, at: int, hit: int) -> list[tuple[int, tuple]]:
    """(address, rule) where the rule changes, for the code at `at` of a detour
    whose hit is at `hit`.  A rule is (kind, base, d, saved, k): the CFA (see
    _step; kind None: unknown, the return address undefined there), and k, what
    to add to the address a call here pushed to get hit + 1."""
    # In address order, each instruction right after the one before (Capstone
    # decodes forwards and stops at bytes it cannot read).
    insns = list(cs.LITE.disasm_lite(code, at))
    count = len(insns)
    if not count:
        return []
    end = at + len(code)
    states = [None] * count
    states[0] = _START
    addrs = None                # the instructions' addresses, for the branches' targets
    work = [0]
    steps, flows, ends, direct, stack_mns = _STEPS, _FLOW, _ENDS, _DIRECT.fullmatch, _STACK_MNS
    while work:
        i = work.pop()
        a, n, mn, ops_s = insns[i]
        state = states[i]
        t = None
        if mn[0] == "j" or mn == "call":
            if "," not in ops_s and direct(ops_s):    # the usual direct branch: its target
                t = int(ops_s, 16)
            elif ops_s in flows:
                t = flows[ops_s]
            else:
                t = flows[ops_s] = _target(ops_s)
        if t is not None:
            out = state         # a direct branch or call: _step keeps the state
        elif state[0] is None or ((state[0] == "mem" or (state[0] == "rsp" and not state[1]))
                                  and mn not in stack_mns and "rsp" not in ops_s):
            out = state         # so does an unknown CFA, and an instruction that names no %rsp (nor an alias)
        else:
            out = steps.get((state, mn, ops_s))
            if out is None:
                out = steps[state, mn, ops_s] = _step(state, mn, [o.strip() for o in ops_s.split(",")] if ops_s else [])
        if mn not in ends and i + 1 < count and states[i + 1] is None:
            states[i + 1] = out
            work.append(i + 1)
        if t is not None and at <= t < end and mn != "call":
            if addrs is None:
                addrs = [x[0] for x in insns]
            j = bisect.bisect_left(addrs, t)
            if j < count and addrs[j] == t and states[j] is None:    # else not an instruction's start
                states[j] = out
                work.append(j)
    out, last = [], None
    unknown = (None, None, 0, ())
    prev = out                  # no state: the first instruction is always read
    for (a, n, mn, _), st in zip(insns, states):
        if st == prev and mn != "call":
            continue            # its rule's CFA is the last row's: no row (and k is the last's)
        prev = st
        kind, base, d, saved = st or unknown
        if kind == "rsp":
            base = None
        k = hit + 1 - (a + n) if mn == "call" else (last[4] if last else hit + 1 - a)
        rule = (kind, base, d, saved if kind else (), k if kind else 0)
        if rule != last and (mn == "call" or last is None or rule[:4] != last[:4]):
            out.append((a, rule))
            last = rule
    return out


def _expr(ops: bytes) -> bytes:
    return _uleb(len(ops)) + ops


def rule_insns(rule) -> bytes:
    """The DW_CFA_* instructions that set one row's rule in full."""
    kind, base, d, saved, k = rule
    cfa = _cfa_insns(kind, base, d, saved)
    return cfa if cfa == _UNDEFINED else cfa + _ra_insns(k)


_UNDEFINED = bytes([0x07, RA_COLUMN])                          # DW_CFA_undefined: the unwinder stops


@functools.lru_cache(maxsize=None)
def _cfa_insns(kind, base, d, saved) -> bytes:
    """A rule's CFA and saved registers (shared by the detours of one template),
    or _UNDEFINED."""
    if kind is None or (kind != "mem" and d < 0 and d % -DATA_ALIGN):
        return _UNDEFINED
    if kind in ("rsp", "reg"):
        reg = DWARF["rsp" if kind == "rsp" else base]
        if d >= 0:
            out = bytes([0x0C, reg]) + _uleb(d)                 # DW_CFA_def_cfa
        else:                                                   # above the stack pointer (a copied pop)
            out = bytes([0x12, reg]) + _sleb(d // DATA_ALIGN)   # DW_CFA_def_cfa_sf, factored
    else:                                                       # DW_CFA_def_cfa_expression
        e = bytes([0x77]) + _sleb(base) + b"\x06" + b"\x11" + _sleb(d) + b"\x22"
        out = b"\x0f" + _expr(e)
    for reg, off in saved:                                      # DW_CFA_offset_extended_sf
        if off % DATA_ALIGN == 0:
            out += bytes([0x11, DWARF[reg]]) + _sleb(off // DATA_ALIGN)
    return out


@functools.lru_cache(maxsize=4096)      # k is a distance within a detour: few of them repeat for all
def _ra_insns(k: int) -> bytes:
    """DW_CFA_val_expression RA: [the caller's %rsp - 8] + k (DW_OP_breg7 -8, deref, consts k, plus)."""
    ra = b"\x77\x78\x06\x11" + _sleb(k) + b"\x22"
    return bytes([0x16, RA_COLUMN]) + _expr(ra)


def fde_program(code: bytes, at: int, hit: int) -> bytes:
    """The call frame program of a detour's FDE (after the CIE's initial rule)."""
    out, pc = bytearray(), at
    for a, rule in rows(code, at, hit):
        delta = a - pc
        if delta:
            if delta < 0x40:
                out.append(0x40 | delta)                        # DW_CFA_advance_loc
            elif delta < 0x100:
                out += bytes([0x02, delta])
            elif delta < 0x10000:
                out += bytes([0x03]) + delta.to_bytes(2, "little")
            else:
                out += bytes([0x04]) + delta.to_bytes(4, "little")
            pc = a
        out += rule_insns(rule)
    return bytes(out)
