"""x86-64 instruction classification for kprobes, after the kernel's
arch/x86/kernel/kprobes/core.c: can_boost() with its twobyte_is_boostable
bitmap, the prepare_emulation() classes, and can_probe()'s refusals."""
from __future__ import annotations

from dataclasses import dataclass

import capstone
from capstone import x86 as csx86

_cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
_cs.detail = True


def _bits(*rows):
    s = set()
    for base, flags in rows:
        for i, f in enumerate(flags):
            if f:
                s.add(base + i)
    return frozenset(s)


# twobyte_is_boostable[] of arch/x86/kernel/kprobes/core.c.
TWOBYTE_IS_BOOSTABLE = _bits(
    (0x00, (0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0)),
    (0x10, (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1)),
    (0x20, (1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    (0x30, (0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    (0x40, (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)),
    (0x50, (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    (0x60, (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1)),
    (0x70, (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1)),
    (0x80, (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    (0x90, (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)),
    (0xA0, (1, 1, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1)),
    (0xB0, (1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1)),
    (0xC0, (1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1)),
    (0xD0, (0, 1, 1, 1, 0, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1)),
    (0xE0, (0, 1, 1, 0, 0, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1)),
    (0xF0, (0, 1, 1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 0)),
)

LEGACY_PREFIXES = frozenset([0x66, 0x67, 0xF2, 0xF3, 0x2E, 0x36, 0x3E, 0x26, 0x64, 0x65, 0xF0])


@dataclass(frozen=True)
class InsnInfo:
    length: int
    opcode_map: int
    opcode: int
    modrm_reg: int | None
    boostable: bool
    boost_reason: str
    emulate: str | None
    probe_refused: str | None
    rip_relative: bool
    rel_target: int | None
    rel_size: int


def decode_length(code: bytes, address: int) -> int:
    for i in _cs.disasm(code, address, 1):
        return i.size
    raise ValueError(f"cannot decode at {address:#x}")


def _can_boost(prefixes, omap, op, reg) -> tuple[bool, str]:
    if omap == 3:
        return False, "three-byte opcode"
    if omap == 2:
        if op in TWOBYTE_IS_BOOSTABLE:
            return True, ""
        return False, f"twobyte 0f {op:02x} not boostable"
    if omap == 1:
        if 0x2E in prefixes:
            return False, "cs prefix"
        if 0x67 in prefixes:
            return False, "address-size prefix"
    if op == 0x62:
        return False, "bound"
    if 0x70 <= op <= 0x7F:
        return False, "jcc"
    if op == 0x9A:
        return False, "far call"
    if 0xCC <= op <= 0xCE:
        return False, "software exception"
    if op == 0xD6:
        return False, "undefined opcode d6"
    if 0xD8 <= op <= 0xDF:
        return False, "x87 escape"
    if 0xE0 <= op <= 0xE3:
        return False, "loop/jcxz"
    if op in (0xE8, 0xE9, 0xEB):
        return False, {0xE8: "call rel32", 0xE9: "jmp rel32", 0xEB: "jmp rel8"}[op]
    if 0xF0 <= op <= 0xF4:
        return False, "lock/rep/hlt opcode"
    if op in (0xC0, 0xC1, 0xD0, 0xD1, 0xD2, 0xD3):
        return (reg != 6, "" if reg != 6 else "grp2 /6")
    if op in (0xF6, 0xF7):
        return (reg != 1, "" if reg != 1 else "grp3 /1")
    if op == 0xFE:
        return (reg in (0, 1), "" if reg in (0, 1) else f"grp4 /{reg}")
    if op == 0xFF:
        return (reg in (0, 1, 4), "" if reg in (0, 1, 4) else f"grp5 /{reg}")
    return True, ""


def classify(code: bytes, address: int) -> InsnInfo:
    ci = None
    for ci in _cs.disasm(code, address, 1):
        break
    if ci is None:
        raise ValueError(f"cannot decode at {address:#x}")
    raw = ci.bytes
    i = 0
    prefixes = []
    while i < len(raw) and raw[i] in LEGACY_PREFIXES:
        prefixes.append(raw[i]); i += 1
    if i < len(raw) and 0x40 <= raw[i] <= 0x4F:
        i += 1
    omap = 1
    if raw[i] in (0xC4, 0xC5, 0x62) and ci.size > i + 2:
        # VEX/EVEX: the kernel's decoder keeps the opcode byte as a one-byte opcode.
        vlen = {0xC4: 3, 0xC5: 2, 0x62: 4}[raw[i]]
        i += vlen
        omap = 4
    elif raw[i] == 0x0F:
        if raw[i + 1] in (0x38, 0x3A):
            omap, i = 3, i + 2
        else:
            omap, i = 2, i + 1
    op = raw[i]
    reg = (raw[i + 1] >> 3) & 7 if i + 1 < len(raw) else None
    boost_map = 1 if omap == 4 else omap
    boostable, reason = _can_boost(prefixes, boost_map, op, reg)
    emulate = None
    refused = None
    rel_target, rel_size = None, 0
    if omap in (1, 4) and omap == 1:
        if op == 0xFA: emulate = "cli"
        elif op == 0xFB: emulate = "sti"
        elif op == 0x9C: emulate = "pushf"
        elif op == 0x9D: emulate = "popf"
        elif op == 0xC3: emulate = "ret"
        elif op == 0xC2: emulate = "ret imm"
        elif op in (0xCA, 0xCB): emulate = "lret"
        elif op == 0xE8: emulate = "call rel"
        elif op in (0xE9, 0xEB): emulate = "jmp rel"
        elif 0x70 <= op <= 0x7F: emulate = "jcc rel"
        elif op in (0xE0, 0xE1, 0xE2): emulate = "loop"
        elif op == 0xE3: emulate = "jcxz"
        elif op == 0xFF and reg in (2, 4) and (raw[i + 1] >> 6) == 3:
            emulate = "call reg" if reg == 2 else "jmp reg"
        elif op == 0xCC: emulate, refused = "int3", "int3"
        if op == 0xCD: refused = "int n"
        elif op == 0xCE: refused = "into"
        elif op == 0xF1: refused = "int1"
        elif op == 0x9A: refused = None
    elif omap == 2:
        if 0x80 <= op <= 0x8F: emulate = "jcc rel"
        elif op == 0x0B: refused = "ud2"
        elif op == 0xB9: refused = "ud1"
        elif op == 0xFF: refused = "ud0"
    if emulate in ("call rel", "jmp rel", "jcc rel", "loop", "jcxz"):
        for o in ci.operands:
            if o.type == csx86.X86_OP_IMM:
                rel_target = o.imm & (2**64 - 1)
        rel_size = 1 if (omap == 1 and op != 0xE8 and op != 0xE9) else 4
    rip = any(o.type == csx86.X86_OP_MEM and o.mem.base == csx86.X86_REG_RIP for o in ci.operands)
    return InsnInfo(ci.size, omap if omap != 4 else 4, op, reg, boostable, reason, emulate, refused, rip, rel_target, rel_size)
