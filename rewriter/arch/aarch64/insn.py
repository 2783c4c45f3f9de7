"""AArch64 instruction classes, from the encoding's bit fields (the kernel's
arch/arm64/include/asm/insn.h predicates, as arch/arm64/kernel/probes/decode-insn.c
uses them): which instructions are PC-relative (simulated by the trap handler,
relocated in a detour), which branch, and which a kprobe refuses.

Every instruction is one little-endian 32-bit word at a 4-aligned address."""
from __future__ import annotations

from dataclasses import dataclass

# Kinds (simulate-insn.c's simulate_* functions, and what a detour relocates).
B, BL, BCOND, CBZ, TBZ, ADR, ADRP, LDR_LIT, LDRSW_LIT, BR, BLR, RET = (
    "b", "bl", "b.cond", "cbz", "tbz", "adr", "adrp", "ldr literal", "ldrsw literal", "br", "blr", "ret")
DIRECT = (B, BL, BCOND, CBZ, TBZ)
PC_RELATIVE = DIRECT + (ADR, ADRP, LDR_LIT, LDRSW_LIT)
BRANCHES = DIRECT + (BR, BLR, RET)

NOP = 0xD503201F
# Hints a kprobe may step (aarch64_insn_is_steppable_hint()): NOP, PACIA1716 (8),
# PACIB1716 (10), XPACLRI (7), PACIAZ (24), PACIASP (25), PACIBZ (26), PACIBSP (27),
# BTI, BTI c, BTI j, BTI jc (32, 34, 36, 38).  AUTI* (12, 14, 28-31) were removed:
# with FEAT_FPAC they fault.
STEPPABLE_HINTS = frozenset([0, 7, 8, 10, 24, 25, 26, 27, 32, 34, 36, 38])
HINT_NAMES = {12: "autia1716", 14: "autib1716", 28: "autiaz", 29: "autiasp", 30: "autibz", 31: "autibsp"}
SPCLREG_DAIF = 0xDA21          # aarch64_insn_extract_system_reg() of DAIF (op0 3, op1 3, CRn 4, CRm 2, op2 1)


def sext(v: int, bits: int) -> int:
    return v - (1 << bits) if v & (1 << (bits - 1)) else v


@dataclass(frozen=True)
class Info:
    """One instruction's class: `kind` (one of the PC-relative or branch kinds
    above, or "" for the rest), its PC-relative `target`, its register `rt`
    (the destination, or the tested / branched-through register), and for
    b.cond/cbz/tbz the condition, size and bit; `refused`: why a kprobe may not
    take it ("" if it may)."""
    word: int
    kind: str = ""
    target: int | None = None
    rt: int = 0
    cond: int = 0              # b.cond: the condition; cbz/tbz: 1 for the "not" form (cbnz, tbnz)
    sf: int = 1                # cbz: 64-bit register; ldr literal: 8-byte load
    bit: int = 0               # tbz: the tested bit
    refused: str = ""
    length: int = 4

    @property
    def emulate(self) -> str:
        """The x86 back end's name for it: the kind, or "" (not simulated)."""
        return self.kind

    @property
    def rel_target(self) -> int | None:
        return self.target


def is_load_ex(w: int) -> bool:
    """aarch64_insn_is_load_ex(): load exclusive/acquire (the exclusive class, L=1)."""
    return (w & 0x3F400000) == 0x08400000


def is_store_ex(w: int) -> bool:
    """aarch64_insn_is_store_ex()."""
    return (w & 0x3F400000) == 0x08000000


def classify(word: int | bytes, addr: int) -> Info:
    """The class of the instruction `word` at `addr` (the decode-insn.c order)."""
    w = int.from_bytes(word[:4], "little") if isinstance(word, (bytes, bytearray, memoryview)) else word
    if (w & 0x7C000000) == 0x14000000:                       # B, BL
        return Info(w, BL if w >> 31 else B, addr + sext(w & 0x3FFFFFF, 26) * 4)
    if (w & 0xFF000010) == 0x54000000:                       # B.cond
        return Info(w, BCOND, addr + sext((w >> 5) & 0x7FFFF, 19) * 4, cond=w & 0xF)
    if (w & 0x7E000000) == 0x34000000:                       # CBZ, CBNZ
        return Info(w, CBZ, addr + sext((w >> 5) & 0x7FFFF, 19) * 4, rt=w & 31, cond=(w >> 24) & 1, sf=w >> 31)
    if (w & 0x7E000000) == 0x36000000:                       # TBZ, TBNZ
        return Info(w, TBZ, addr + sext((w >> 5) & 0x3FFF, 14) * 4, rt=w & 31, cond=(w >> 24) & 1,
                    bit=((w >> 31) << 5) | ((w >> 19) & 31))
    if (w & 0x1F000000) == 0x10000000:                       # ADR, ADRP
        imm = sext((((w >> 5) & 0x7FFFF) << 2) | ((w >> 29) & 3), 21)
        if w >> 31:
            return Info(w, ADRP, (addr & ~0xFFF) + (imm << 12), rt=w & 31)
        return Info(w, ADR, addr + imm, rt=w & 31)
    if (w & 0x3B000000) == 0x18000000:                       # load register (literal)
        opc, v = w >> 30, (w >> 26) & 1
        target = addr + sext((w >> 5) & 0x7FFFF, 19) * 4
        if v:
            return Info(w, "", target, rt=w & 31, refused="a floating-point literal load (PC-relative)")
        if opc == 3:
            return Info(w, "", target, refused="prfm literal (PC-relative)")
        if opc == 2:
            return Info(w, LDRSW_LIT, target, rt=w & 31)
        return Info(w, LDR_LIT, target, rt=w & 31, sf=opc)
    if (w & 0xFFFFFC1F) == 0xD61F0000:
        return Info(w, BR, rt=(w >> 5) & 31)
    if (w & 0xFFFFFC1F) == 0xD63F0000:
        return Info(w, BLR, rt=(w >> 5) & 31)
    if (w & 0xFFFFFC1F) == 0xD65F0000:
        return Info(w, RET, rt=(w >> 5) & 31)
    if (w & 0xFE000000) == 0xD6000000:                       # other branch-register forms
        if (w & 0xFFFFFBFF) == 0xD69F03E0 or (w & 0xFFFFFBFF) == 0xD69F0BFF:
            return Info(w, refused="eret")
        return Info(w, refused="a branch through a register with pointer authentication (braa, retaa, ...)")
    if (w & 0xFF000000) == 0xD4000000:                       # exception generation
        name = {0: {1: "svc", 2: "hvc", 3: "smc"}, 1: "brk", 2: "hlt", 5: "dcps"}.get((w >> 21) & 7, "an exception")
        if isinstance(name, dict):
            name = name.get(w & 3, "an exception")
        return Info(w, refused=f"{name} (exception generating)")
    if (w & 0xFFC00000) == 0xD5000000:                       # system instructions
        if (w & 0xFFFFF01F) == 0xD503201F:                   # HINT
            n = (w >> 5) & 0x7F
            if n in STEPPABLE_HINTS:
                return Info(w)
            return Info(w, refused=f"{HINT_NAMES.get(n, f'hint #{n}')} (a hint outside the kernel's steppable list)")
        if (w & 0xFFF00000) == 0xD5100000:
            return Info(w, refused="msr (system register write)")
        if (w & 0xFFF8F01F) == 0xD500401F:
            return Info(w, refused="msr (immediate: PSTATE write)")
        if (w & 0xFFF00000) == 0xD5300000 and ((w >> 5) & 0xFFFF) == SPCLREG_DAIF:
            return Info(w, refused="mrs of DAIF (reads the stepping state)")
        return Info(w)
    if is_load_ex(w) or is_store_ex(w):
        return Info(w, refused="an exclusive load/store (the monitor would not survive the trap)")
    return Info(w)


def atomic_sequence(read, addr: int, func_start: int) -> int | None:
    """is_probed_address_atomic(): scanning back up to 32 instructions (not
    before the function's start), a load-exclusive met before any
    store-exclusive means addr lies inside an ldxr ... stxr sequence: its address,
    else None.  read(a) gives the word at a."""
    a = addr - 4
    while a >= func_start and a >= addr - 32 * 4:
        w = read(a)
        if is_load_ex(w):
            return a
        if is_store_ex(w):
            return None
        a -= 4
    return None
