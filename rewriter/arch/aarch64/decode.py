"""Whole-function decoding for AArch64: every instruction is a 4-byte word, so
boundaries are every fourth byte; decoding from the function's start notes the
direct branch targets, the exits, the indirect jumps (br) and the code addresses
the code computes (adr, adrp + add), as x86_64/decode.py does for x86-64."""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import capstone

from . import insn as I

_cs = capstone.Cs(capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)
_cs.detail = False


@dataclass
class DecodedFunction:
    boundaries: array            # offsets of instruction starts, from the function start
    undecodable: int | None      # address of the first word Capstone does not decode
    branches: list[tuple[int, int]]   # (target, address of the branch) of direct branches
    sets_df: int | None = None   # x86's direction flag: none here
    exits: list[int] | None = None    # every ret, b, b.cond, cbz, tbz, br: where a function may leave
    indirect_jumps: list[int] | None = None
    code_refs: list[tuple[int, int]] | None = None   # (address, adr/adrp) of code addresses computed

    @property
    def indirect_jump(self) -> int | None:
        """The address of the first indirect jump, if any (derived, not kept beside the list)."""
        return self.indirect_jumps[0] if self.indirect_jumps else None


def decode_function(code: bytes, start: int) -> DecodedFunction:
    n = len(code) // 4
    bounds = array("I", range(0, n * 4, 4))
    branches, exits, indirects, refs = [], [], [], []
    words = array("I")
    words.frombytes(bytes(code[:n * 4]))
    undecodable = None
    end = start
    for a, size, _m, _o in _cs.disasm_lite(bytes(code[:n * 4]), start):
        end = a + size
    if end < start + n * 4:
        undecodable = end
    for i, w in enumerate(words):
        addr = start + 4 * i
        info = I.classify(w, addr)
        k = info.kind
        if k in I.DIRECT:
            branches.append((info.target, addr))
            if k != I.BL:
                exits.append(addr)
        elif k in (I.RET, I.BR):
            exits.append(addr)
            if k == I.BR:
                indirects.append(addr)
        elif k == I.ADR:
            refs.append((info.target, addr))
        elif k == I.ADRP and i + 1 < n:
            nxt = words[i + 1]
            # add xd, xd, #lo12 right after: the full address.
            if (nxt & 0xFFC00000) == 0x91000000 and (nxt & 31) == info.rt and ((nxt >> 5) & 31) == info.rt:
                refs.append((info.target + ((nxt >> 10) & 0xFFF), addr))
    return DecodedFunction(bounds, undecodable, branches, None, exits,
                           indirects, refs)
