"""Whole-function decoding for x86-64 (Capstone), as can_probe() and
can_optimize() do it in arch/x86/kernel/kprobes/{core,opt}.c: decode from the
function's start so that every instruction boundary is known, and note every
direct branch target and every indirect jump on the way."""
from __future__ import annotations

import re

from array import array
from dataclasses import dataclass
from itertools import accumulate

from . import cs

_cs = cs.LITE

_JUMPS = frozenset(["jmp", "je", "jne", "ja", "jae", "jb", "jbe", "jg", "jge", "jl", "jle", "jo",
                    "jno", "jp", "jnp", "js", "jns", "jcxz", "jecxz", "jrcxz", "loop", "loope",
                    "loopne", "call", "bnd jmp", "bnd call", "notrack jmp", "notrack call",
                    "bnd je", "bnd jne", "xbegin"])


_RIP = re.compile(r"\[rip ([+-]) (0x[0-9a-f]+)\]")
_RIP_B = re.compile(_RIP.pattern.encode())

_EXIT_MNEMONICS = ("ret", "j", "loop", "repz ret", "bnd ret", "bnd j", "notrack j")


@dataclass
class DecodedFunction:
    boundaries: array            # offsets of instruction starts, from the function start
    undecodable: int | None      # address where decoding failed, if it did
    branches: list[tuple[int, int]]   # (target, address of the branch) of direct jumps/calls
    sets_df: int | None = None   # address of the first `std`: DF may be set inside the function
    exits: list[int] | None = None   # addresses of every ret, jmp, jcc, loop: where a function may leave
    indirect_jumps: list[int] | None = None   # every indirect jump (jumptable.py decides which are bounded)
    code_refs: list[tuple[int, int]] | None = None   # (address, lea) of every RIP-relative lea: addresses the code computes

    @property
    def indirect_jump(self) -> int | None:
        """The address of the first indirect jump, if any (derived, not kept beside the list)."""
        return self.indirect_jumps[0] if self.indirect_jumps else None


# What decode_function() does with a mnemonic, worked out once per mnemonic:
# bit 1 an exit, bit 2 a direct or indirect jump/call (_JUMPS), bit 4 ljmp,
# bit 8 lea, bit 16 std.  Most instructions are none of these.
_KINDS: dict[str, int] = {}


def _kind(mnem: str) -> int:
    k = (1 if mnem.startswith(_EXIT_MNEMONICS) else 0)
    if mnem in _JUMPS:
        k |= 2
    elif mnem == "ljmp":
        k |= 4
    elif mnem == "lea":
        k |= 8
    elif mnem == "std":
        k |= 16
    return k


# The first three letters of every mnemonic _kind() does not give 0 (ret, repz ret,
# j*, loop*, ljmp, lea, bnd *, notrack *, call, std, xbegin), as three tables of bit
# masks, one bit per first letter: an instruction whose three letters' masks share a
# bit is one decode_function() reads the mnemonic of (a third of libpython's
# instructions, mostly jumps, calls and leas; not a cmp, a nop, a xor or a sub); the
# rest make a boundary and nothing else.  A superset (a leave, a rep stos): the
# mnemonic read decides.
_FIRST3 = {"j": ("", ""), "r": ("e", "tp"), "l": ("eoj", "aom"), "b": ("n", "d"), "n": ("o", "t"),
           "c": ("a", "l"), "s": ("t", "d"), "x": ("b", "e")}


def _letter_masks() -> tuple[bytes, bytes, bytes]:
    t1, t2, t3 = bytearray(256), bytearray(256), bytearray(256)
    for bit, (first, (second, third)) in enumerate(_FIRST3.items()):
        t1[ord(first)] |= 1 << bit
        for t, allowed in ((t2, second), (t3, third)):
            for c in (range(256) if not allowed else map(ord, allowed)):     # "": any letter
                t[c] |= 1 << bit
    return bytes(t1), bytes(t2), bytes(t3)


_MASKS = _letter_masks()
_NONZERO = re.compile(rb"[^\0]")
# Code this short (a probe's first bytes: Analysis.is_boundary) costs less through disasm_lite().
SHORT = 128
_KINDS_B: dict[bytes, int] = {}


# Instructions decoded a cs_disasm() call (CHUNK records of 248 bytes: 124 KB, under
# malloc's mmap threshold).  A whole big function's records at once (a kernel's 6.8
# million instructions: 1.7 GB, allocated by Capstone and copied by records()) came
# from fresh mappings, paged in each time: 0.6 s of system time in the kernel's
# decoding, and more user time besides.
CHUNK = 512


def decode_function(code: bytes, start: int) -> DecodedFunction:
    """Every instruction from `start` to the end of `code` or the first byte that
    does not decode, from LITE's cs_disasm() records (cs.records(), CHUNK at a time):
    the sizes of all give the boundaries in one pass, and only an instruction whose
    mnemonic may matter (_MASKS) has its mnemonic read."""
    if cs.LAYOUT is None or len(code) <= SHORT:
        return _decode_lite(code, start)
    rec, o_size, o_mn, n_mn, o_ops, n_ops = cs.LAYOUT
    bounds = array("I")
    branches: list[tuple[int, int]] = []
    std = None
    exits: list[int] = []
    indirects: list[int] = []
    refs: list[tuple[int, int]] = []
    kinds = _KINDS_B
    rip = _RIP_B.search
    t1, t2, t3 = _MASKS
    frm = int.from_bytes
    length = 0
    for n, buf in cs.record_chunks(code, start, CHUNK):
        sizes = memoryview(buf).cast("H")[o_size // 2::rec // 2]
        at = array("I", accumulate(sizes, initial=length))
        length = at.pop()
        bounds += at
        index = buf.index
        # One byte an instruction, not 0 where its three letters' masks share a bit: the
        # columns' masks ANDed as whole numbers, not a Python step an instruction.
        maybe = (frm(buf[o_mn::rec].translate(t1), "little") & frm(buf[o_mn + 1::rec].translate(t2), "little")
                 & frm(buf[o_mn + 2::rec].translate(t3), "little")).to_bytes(n, "little")
        for m in _NONZERO.finditer(maybe):
            i = m.start()
            o = i * rec
            mb = buf[o + o_mn:index(0, o + o_mn, o + o_mn + n_mn)]
            k = kinds.get(mb)
            if k is None:
                k = kinds[mb] = _kind(mb.decode("ascii"))
            if not k:
                continue
            addr = start + at[i]
            if k & 1:
                exits.append(addr)
            if k & 2:
                o += o_ops
                if 48 <= buf[o] <= 57:          # a digit: an address (the op_str's bytes, as int() reads them)
                    try:
                        branches.append((int(buf[o:index(0, o, o + n_ops)], 0), addr))
                    except ValueError:
                        pass
                elif b"jmp" in mb:
                    indirects.append(addr)
            elif k & 4:
                indirects.append(addr)
            elif k & 8:
                o += o_ops
                # `lea X(%rip)`: a code address a register may hold, then jump to.
                r = rip(buf, o, index(0, o, o + n_ops))
                if r:
                    refs.append((addr + sizes[i] + int(r.group(1) + r.group(2), 16), addr))
            elif k & 16 and std is None:
                std = addr
    end = start + length
    undecodable = end if end < start + len(code) else None
    return DecodedFunction(bounds, undecodable, branches, std, exits,
                           indirects, refs)


def _decode_lite(code: bytes, start: int) -> DecodedFunction:
    """decode_function() through disasm_lite(): a Capstone binding without capstone 5's
    cs_insn layout."""
    bounds = array("I")
    append = bounds.append
    branches: list[tuple[int, int]] = []
    std = None
    exits: list[int] = []
    indirects: list[int] = []
    refs: list[tuple[int, int]] = []
    kinds = _KINDS
    end = start
    addr = size = None
    for addr, size, mnem, ops in _cs.disasm_lite(code, start):
        append(addr - start)
        k = kinds.get(mnem)
        if k is None:
            k = kinds[mnem] = _kind(mnem)
        if not k:
            continue
        if k & 1:
            exits.append(addr)
        if k & 2:
            if ops.startswith("0x") or ops[:1].isdigit():
                try:
                    branches.append((int(ops, 0), addr))
                except ValueError:
                    pass
            elif "jmp" in mnem:
                indirects.append(addr)
        elif k & 4:
            indirects.append(addr)
        elif k & 8:
            if "[rip " in ops:
                # `lea X(%rip)`: a code address a register may hold, then jump to.
                m = _RIP.search(ops)
                if m:
                    refs.append((addr + size + int(m.group(1) + m.group(2), 16), addr))
        elif k & 16 and std is None:
            std = addr
    if addr is not None:
        end = addr + size
    undecodable = end if end < start + len(code) else None
    return DecodedFunction(bounds, undecodable, branches, std, exits,
                           indirects, refs)
