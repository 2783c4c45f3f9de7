"""A module's optimized (jump) probes: the detoured code region copied into the
module's own code, its relocations carried with it.

The kernel's optprobe copies the region's instructions into an insn slot and fixes
their displacements for the slot's address (copy_optimized_instructions()).  A
module's detour lives in the module, whose addresses are the loader's: nothing is
known at rewrite time but each reference's symbol and addend.  So the copy is
made as the image target makes it (arch/x86_64/emit.relocate(): relative branches
re-encoded with rel32, a final call emulated with the original return address
pushed, RIP-relative displacements moved), at a stand-in address, and each of its
address fields becomes a relocation the module loader applies at insmod:

- a field the original instruction's relocation filled (a call or a tail jump to
  a kernel function, RIP-relative data, `mov $sym, %reg`'s R_X86_64_32S) takes
  that relocation (the same symbol and addend: the field keeps its distance to the
  instruction's end);
- a field the assembler had resolved inside the section (a branch within the
  function, the return address of an emulated call) gets one against the
  section: R_X86_64_PC32 to section + offset.

The writer (writer.py) emits each field as a reference to a placeholder symbol,
links, then points each placeholder's relocation where this module says (the
placeholders are dropped).  At the probed address the jump's relocation is added,
and the original relocations its five bytes cover are made R_X86_64_NONE (their
fields are gone).  A relocation this cannot carry refuses the probe, naming the
check and the address.
"""
from __future__ import annotations

from dataclasses import dataclass

import capstone
import capstone.x86_const

from ....arch.x86_64 import cs
from ....arch.x86_64.emit import EmitError, relocate
from .relocatable import R_X86_64_32, R_X86_64_32S, R_X86_64_64, R_X86_64_PC32, R_X86_64_PC64, R_X86_64_PLT32
from ..ko import relocations  # noqa: F401  (writer.py and rules.py ask it here)

FIELD_SIZE = {R_X86_64_64: 8, R_X86_64_PC64: 8, R_X86_64_PC32: 4, R_X86_64_PLT32: 4, R_X86_64_32: 4,
              R_X86_64_32S: 4}
PC_RELATIVE = (R_X86_64_PC32, R_X86_64_PLT32)
# The copy is made at this stand-in address (within 2 GiB of the module's view and of the
# kernel symbols' stand-ins, so every displacement of the copy fits in 32 bits).
COPY_AT = 0xFFFFFFFFA0000000
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Field:
    """A relocated field of the copy: at `at` in it, `size` bytes.  Either the original
    relocation of (section, offset) carried (`carry`, its addend plus `addend`), or
    R_X86_64_PC32 against the section `section` with `addend`."""
    at: int
    size: int
    section: str
    carry: int | None = None
    addend: int = 0


class CopyRefused(Exception):
    """(check, address, why): the copy cannot be written for the module."""


def _pc_fields(code: bytes, at: int, copy: bool = True):
    """The PC-relative fields of code decoded at `at`: (offset, end of its instruction,
    absolute target).  In a copy (copy), CopyRefused for a relative branch left with a
    1-byte displacement (loop, jrcxz: emit.relocate() copies them as they are); in an
    original, such a branch has no field a relocation fills, and is skipped."""
    for ci in cs.DETAIL.disasm(code, at):
        o = ci.address - at
        if capstone.CS_GRP_BRANCH_RELATIVE in ci.groups:
            if ci.imm_size != 4 and not copy:
                continue
            if ci.imm_size != 4:
                raise CopyRefused("module_relocation", at, f"{ci.mnemonic} has a {ci.imm_size}-byte displacement")
            yield o + ci.imm_offset, o + ci.size, ci.operands[0].imm & _MASK
            continue
        for op in ci.operands:
            if op.type == capstone.x86_const.X86_OP_MEM and op.mem.base == capstone.x86_const.X86_REG_RIP:
                yield o + ci.disp_offset, o + ci.size, (ci.address + ci.size + op.mem.disp) & _MASK


def copy(mod, relocs, insn) -> tuple[bytes, list[Field]]:
    """One region instruction's copy for a module's detour: its bytes (relocated fields
    zero, as the loader requires of a RELA field) and its fields.  CopyRefused when a
    field cannot be named."""
    placed = mod.place(insn.addr)
    sec, off = placed[0].name, placed[1]
    orig = {k - off: v for k, v in relocs.get(sec, {}).items() if off <= k < off + len(insn.code)}
    for k, (_, typ, _) in orig.items():
        if typ not in FIELD_SIZE or k + FIELD_SIZE[typ] > len(insn.code):
            raise CopyRefused("module_relocation", insn.addr, f"relocation type {typ} at {sec}+{off + k:#x} "
                                                              f"cannot be carried to a detour")
    try:
        out = bytearray(relocate(insn, COPY_AT))
    except EmitError as e:
        raise CopyRefused("module_relocation", insn.addr, str(e))
    same = len(out) == len(insn.code)
    fields = []
    done = set()
    try:
        pcs = list(_pc_fields(bytes(out), COPY_AT))
        # The original's operands: which relocation filled the one with each target.
        by_target = {t: (k, end - k) for k, end, t in _pc_fields(insn.code, insn.addr, copy=False)
                     if k in orig and orig[k][1] in PC_RELATIVE}
    except CopyRefused as e:
        raise CopyRefused(e.args[0], insn.addr, e.args[2])
    for f, end, target in pcs:
        k, dist = by_target.get(target, (None, 0))
        if k is not None and k not in done:
            if dist != end - f:
                raise CopyRefused("module_relocation", insn.addr, f"the relocation at {sec}+{off + k:#x} "
                                                                  f"would move within its instruction's copy")
            done.add(k)
            fields.append(Field(f, 4, sec, carry=off + k))
            continue
        where = mod.place(target)
        if where is None:                   # a kernel symbol's stand-in, with no relocation
            raise CopyRefused("module_relocation", insn.addr, f"the copy's operand at {target:#x} has no "
                                                              f"relocation to carry")
        fields.append(Field(f, 4, where[0].name, addend=where[1] - (end - f)))
    for k, (_, typ, _) in sorted(orig.items()):
        if k in done:
            continue
        if typ in PC_RELATIVE or not same:
            raise CopyRefused("module_relocation", insn.addr, f"the relocation at {sec}+{off + k:#x} has no "
                                                              f"place in the instruction's copy")
        fields.append(Field(k, FIELD_SIZE[typ], sec, carry=off + k))
    for fl in fields:
        out[fl.at:fl.at + fl.size] = bytes(fl.size)
    return bytes(out), sorted(fields, key=lambda fl: fl.at)


def region(mod, relocs, site) -> list[tuple[bytes, list[Field]]]:
    """The copies of a site's region, in order."""
    return [copy(mod, relocs, i) for i in site.dcr]


def branch_target(mod, relocs, insn) -> Field:
    """A relative branch's target as a PC-relative field (its value the target minus the
    field's own address): the original's relocation carried, its addend moved by the field's
    distance to the instruction's end (a call or jump to the kernel, to another section), else
    R_X86_64_PC32 to the target's section (a branch the assembler resolved).  CopyRefused when
    the target can be named neither way."""
    placed = mod.place(insn.addr)
    sec, off = placed[0].name, placed[1]
    end = len(insn.code)
    for k in range(1, end - 3):
        r = relocs.get(sec, {}).get(off + k)
        if r is not None and r[1] in PC_RELATIVE and k + 4 == end:
            return Field(0, 4, sec, carry=off + k, addend=end - k)
    where = mod.place(insn.info.rel_target)
    if where is None:
        raise CopyRefused("module_relocation", insn.addr, "the branch's target has no relocation to carry")
    return Field(0, 4, where[0].name, addend=where[1])
