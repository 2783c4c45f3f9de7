"""x86-64 instruction classification for kprobes: a Python port of
arch/x86/kernel/kprobes/core.c (Linux mainline, v6.x) --

* can_boost() with its twobyte_is_boostable[] bitmap (may the copied
  instruction run out of line, followed by a jmp back?),
* prepare_emulation() (which instructions are emulated, and which make
  arch_prepare_kprobe() fail with -EOPNOTSUPP),
* can_probe()'s is_exception_insn() (INT3 / INT n / INTO / INT1 / UD0 / UD1 /
  UD2 cannot be probed) and __copy_instruction()'s insn_masking_exception()
  (mov/pop %ss).

The kernel decides all of this on its own decoder's view of the instruction
(arch/x86/lib/insn.c): legacy prefixes and one REX are skipped, opcode.bytes[]
holds 1 byte (one-byte map, and *also* every VEX/EVEX instruction, whose
opcode byte is stored as a one-byte opcode), 2 bytes (0f xx) or 3 bytes
(0f 38 xx / 0f 3a xx).  This module parses the raw bytes the same way.  The
instruction length comes from Capstone (no detail, so it is cheap); ModRM
presence comes from the opcode tables below, RIP-relative addressing from the
ModRM byte (mod == 00, rm == 101, as the kernel's insn_rip_relative()).

Where the kernel and common summaries of its rules (which list fewer cases)
differ, this module follows the kernel; every such place is marked "KERNEL:".
In short:

* lock/rep (f0 f2 f3) are prefixes to the kernel decoder, so `lock add`,
  `rep movs` are boostable; the "f0-f4" refusal only catches int1 and hlt.
* 0x2e / 0x67 block boosting of one-byte opcodes only; a two-byte opcode is
  decided by twobyte_is_boostable[] alone (`cs nopw`, `addr32 movzx` boost).
* VEX/EVEX opcode bytes go through the one-byte rules (vzeroupper is a "jcc").
* ff /4 (jmp *r/m) is boostable whatever the addressing mode.
* probe_refused also carries what arch_prepare_kprobe() refuses after
  can_probe(): mov %ss (insn_masking_exception), and prepare_emulation()'s
  -EOPNOTSUPP cases -- far call/jmp (9a, ea, ff /3, ff /5), int3, iret,
  VMX (0f 01 c0-c7), and call/jmp through memory or with an address-size
  prefix (such summaries list only some of these).

Deliberately not ported (the kernel would misbehave, or it does not apply):
the kernel's emulation of VEX opcodes that look like branches, boosting of
xbegin, (mis)decoding of AMD XOP (refused here), single-stepping of opcodes
invalid in 64-bit mode (refused here), search_exception_tables(), and the
kCFI / kgdb checks of can_probe().
"""
from __future__ import annotations

from dataclasses import dataclass

from . import cs

# Length decoding only: detail off (LITE), all we take from Capstone is the size
# (cs.length(): one instruction at a time, into one cs_insn).
_disasm_lite = cs.LITE.disasm_lite
_length = cs.length

_MASK64 = (1 << 64) - 1


def _bits(*rows):
    s = set()
    for base, flags in rows:
        assert len(flags) == 16
        for i, f in enumerate(flags):
            if f:
                s.add(base + i)
    return frozenset(s)


# twobyte_is_boostable[] of arch/x86/kernel/kprobes/core.c, row by row exactly
# as the kernel's W(row, b0..bf) table (unchanged in mainline from v2.6.25 to
# v6.x): "Undefined/reserved opcodes, conditional jump, Opcode Extension
# Groups, and some special opcodes can not boost."
#              0  1  2  3  4  5  6  7  8  9  a  b  c  d  e  f
TWOBYTE_IS_BOOSTABLE = _bits(
    (0x00, (0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0)),
    (0x10, (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1)),
    (0x20, (1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    (0x30, (0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    (0x40, (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)),
    (0x50, (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    (0x60, (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1)),
    (0x70, (0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1)),
    (0x80, (0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    (0x90, (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)),
    (0xA0, (1, 1, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1)),
    (0xB0, (1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1)),
    (0xC0, (1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)),
    (0xD0, (0, 1, 1, 1, 0, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1)),
    (0xE0, (0, 1, 1, 0, 0, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1)),
    (0xF0, (0, 1, 1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 0)),
)

# Legacy prefixes (inat_is_legacy_prefix()); REX 40-4f is handled separately.
LEGACY_PREFIXES = frozenset([0x66, 0x67, 0xF2, 0xF3, 0x2E, 0x36, 0x3E, 0x26, 0x64, 0x65, 0xF0])

# One-byte opcodes with a ModRM byte (64-bit mode; 62/c4/c5 are EVEX/VEX there).
_MODRM_1 = _bits(
    (0x00, (1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)),
    (0x10, (1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)),
    (0x20, (1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)),
    (0x30, (1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)),
    (0x60, (0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0)),
    (0x80, (1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)),
    (0xC0, (1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)),
    (0xD0, (1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)),
    (0xF0, (0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1)),
)

# Two-byte (0f xx) opcodes WITHOUT a ModRM byte.  0f ff (UD0) and 0f b9 (UD1)
# are listed because Capstone decodes them as 2-byte instructions (the SDM has
# them /r); the length is Capstone's either way.
_NO_MODRM_2 = frozenset(
    [0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0A, 0x0B, 0x0C, 0x0E,
     0x30, 0x31, 0x32, 0x33, 0x34, 0x35, 0x36, 0x37, 0x39, 0x3B, 0x3C, 0x3D, 0x3E, 0x3F,
     0x77, 0xA0, 0xA1, 0xA2, 0xA8, 0xA9, 0xAA, 0xB9, 0xFF]
    + list(range(0x80, 0x90)) + list(range(0xC8, 0xD0)))

# One-byte opcodes marked (i64) in arch/x86/lib/x86-opcode-map.txt.  Since
# "x86/insn: Stop decoding i64 instructions in x86-64 mode at opcode" the
# kernel decodes them as a bare opcode byte; Capstone refuses them.  (d6 has no
# entry at all in the kernel map, which also decodes it as one byte.)
_INVALID64 = frozenset([0x06, 0x07, 0x0E, 0x16, 0x17, 0x1E, 0x1F, 0x27, 0x2F, 0x37, 0x3F,
                        0x60, 0x61, 0x82, 0x9A, 0xCE, 0xD4, 0xD6, 0xEA])

# can_boost()'s one-byte "... are not boostable" cases.
# KERNEL: d8-df (x87 ESC) are still refused in current mainline, as the fact
# sheet says.  f0/f2/f3 are in the kernel's "case 0xf0 ... 0xf4: LOCK/REP, HLT"
# but can never be opcode.bytes[0]: the decoder has already consumed them as
# prefixes, and can_boost() only checks prefixes for 0x2e and address-size.  So
# `lock add`, `rep movsb`, `repz ret`... are boostable in the kernel (only f1
# int1 and f4 hlt are caught by that line); there is no "lock prefix" refusal.
_ONEBYTE_NOT_BOOSTABLE = {0x62: "bound", 0x9A: "far call", 0xCC: "int3", 0xCD: "int n",
                          0xCE: "into", 0xD6: "undefined opcode d6", 0xE0: "loop",
                          0xE1: "loop", 0xE2: "loop", 0xE3: "jcxz", 0xE8: "call rel32",
                          0xE9: "jmp rel32", 0xEB: "jmp rel8", 0xF0: "lock/rep opcode",
                          0xF1: "int1", 0xF2: "lock/rep opcode", 0xF3: "lock/rep opcode",
                          0xF4: "hlt"}
_ONEBYTE_NOT_BOOSTABLE.update({op: "jcc" for op in range(0x70, 0x80)})
_ONEBYTE_NOT_BOOSTABLE.update({op: "x87 escape" for op in range(0xD8, 0xE0)})

# is_exception_insn() of can_probe(): "INT and UD are special and should not
# be kprobed".
_EXC_ONEBYTE = {0xCC: "int3", 0xCD: "int n", 0xCE: "into", 0xF1: "int1"}
_EXC_TWOBYTE = {0xFF: "ud0", 0xB9: "ud1", 0x0B: "ud2"}

# prepare_emulation(): one-byte cases.  Opcodes it returns -EOPNOTSUPP for are
# listed in _EMULATE_UNSUPPORTED.
_EMULATE_ONEBYTE = {0xFA: "cli", 0xFB: "sti", 0x9C: "pushf", 0x9D: "popf",
                    0xC2: "ret imm", 0xC3: "ret", 0xCA: "lret", 0xCB: "lret",
                    0xE8: "call rel", 0xE9: "jmp rel", 0xEB: "jmp rel",
                    0xE0: "loop", 0xE1: "loop", 0xE2: "loop", 0xE3: "jcxz",
                    0x9A: "far call", 0xEA: "far jmp", 0xCC: "int3", 0xCF: "iret"}
_EMULATE_ONEBYTE.update({op: "jcc rel" for op in range(0x70, 0x80)})
_EMULATE_UNSUPPORTED = {0x9A: "far call", 0xEA: "far jmp", 0xCC: "int3", 0xCF: "iret"}
_REL_CLASSES = frozenset(["call rel", "jmp rel", "jcc rel", "loop", "jcxz"])


@dataclass(frozen=True)
class InsnInfo:
    length: int
    opcode_map: int           # 1 = one-byte, 2 = 0f xx, 3 = 0f 38/0f 3a (three-byte), 4 = VEX/EVEX (/XOP)
    opcode: int               # the opcode byte within its map
    modrm_reg: int | None
    boostable: bool           # the kernel's can_boost() verdict
    boost_reason: str         # '' if boostable, else a short name
    emulate: str | None       # the kernel's prepare_emulation() class, or None
    probe_refused: str | None  # why arch_prepare_kprobe() would refuse a kprobe here, else None
    rip_relative: bool        # has a RIP-relative memory operand
    rel_target: int | None    # relative branches/calls/loops/jcxz: absolute target
    rel_size: int             # size in bytes of the relative displacement, 0 if none


def decode_length(code: bytes, address: int) -> int:
    """Length of the instruction at the start of `code` (Capstone); ValueError if invalid."""
    for _addr, size, _mn, _ops in _disasm_lite(bytes(code[:15]), address, 1):
        return size
    raise ValueError(f"cannot decode instruction at {address:#x}: {bytes(code[:15]).hex()}")


def _can_boost(omap: int, op: int, reg: int, prefixes: list[int]) -> str:
    """can_boost() minus its search_exception_tables() check (user code has no
    exception table).  Returns '' if boostable, else the reason."""
    # /* 2nd-byte opcode */ -- decided by the bitmap alone: prefixes are NOT
    # looked at, so `66 2e 0f 1f 84 ..` (cs nopw) and `67 0f b6 ..` boost.
    if omap == 2:
        return "" if op in TWOBYTE_IS_BOOSTABLE else f"twobyte 0f {op:02x} not boostable"
    if omap == 3:
        return "three-byte opcode"
    # Only one-byte opcodes (which, to the kernel, includes VEX/EVEX) get here.
    for p in prefixes:
        # "Can't boost Address-size override prefix and CS override prefix"
        if p == 0x2E:
            return "cs prefix"
        if p == 0x67:
            return "address-size prefix"
    why = _ONEBYTE_NOT_BOOSTABLE.get(op)
    if why is None:
        if op in (0xC0, 0xC1, 0xD0, 0xD1, 0xD2, 0xD3):
            # Grp2: "AMD uses nnn == 110 as SHL/SAL, but Intel makes it reserved."
            why = "grp2 /6" if reg == 6 else None
        elif op in (0xF6, 0xF7):
            # Grp3: "AMD uses nnn == 001 as TEST, but Intel makes it reserved."
            why = "grp3 /1" if reg == 1 else None
        elif op == 0xFE:
            # Grp4: "Only INC and DEC are boostable"
            why = None if reg in (0, 1) else f"grp4 /{reg}"
        elif op == 0xFF:
            # Grp5: "Only INC, DEC, and indirect JMP are boostable" -- ff /4
            # (jmp *r/m) IS boostable, whatever its addressing mode.
            why = None if reg in (0, 1, 4) else f"grp5 /{reg}"
    if why is None:
        return ""
    if omap == 4:
        # KERNEL: a VEX/EVEX opcode byte is opcode.bytes[0] with nbytes == 1,
        # so it goes through the one-byte switch: vzeroupper (c5 f8 77) is a
        # "jcc", vpor (.. eb) a "jmp rel8", vpunpckldq (.. 62) a "bound"...
        return f"vex/evex opcode {op:02x} read as one-byte: {why}"
    return why


_MEMO: dict[tuple[bytes, int], InsnInfo] = {}
_MEMO_SIZE = 1 << 16


def classify(code: bytes, address: int, length: int | None = None) -> InsnInfo:
    """Classify the single instruction at the start of `code`, located at
    `address` (x86-64).  Raise ValueError if it cannot be decoded.  Memoized:
    registration, the optimizer and the int3 plan ask about the same sites.
    length: the instruction's length where the caller has it from Capstone already
    (a decoded function's boundaries), which then is not decoded again."""
    code = bytes(code[:15])
    key = (code, address)
    info = _MEMO.get(key)
    if info is None:
        if len(_MEMO) >= _MEMO_SIZE:
            _MEMO.clear()
        info = _MEMO[key] = _classify(code, address, length)
    return info


def _classify(code: bytes, address: int, n: int | None = None) -> InsnInfo:
    if n is None:
        n = _length(code, address)
    ncode = len(code)

    # Prefixes, as insn_get_prefixes(): legacy prefixes, then REX (a REX
    # followed by a legacy prefix is ignored by the CPU; skipped here too).
    i = 0
    prefixes: list[int] = []
    while i < ncode:
        b = code[i]
        if b in LEGACY_PREFIXES:
            prefixes.append(b)
        elif not 0x40 <= b <= 0x4F:
            break
        i += 1
    if i >= ncode:
        raise ValueError(f"cannot decode instruction at {address:#x}: {code.hex()}")
    b = code[i]

    if not n:
        # KERNEL: (i64) opcodes decode as one bare byte ("Stop decoding").
        if b in _INVALID64:
            n = i + 1
        else:
            raise ValueError(f"cannot decode instruction at {address:#x}: {code.hex()}")

    has_modrm = True
    if b in (0xC4, 0xC5, 0x62):
        # VEX3 / VEX2 / EVEX (in 64-bit mode c4, c5 and 62 are always these).
        omap = 4
        j = i + (3 if b == 0xC4 else 2 if b == 0xC5 else 4)
        if j >= n:
            raise ValueError(f"cannot decode instruction at {address:#x}: {code.hex()}")
        op = code[j]
        if op == 0x77 and (b == 0xC5 or (b == 0xC4 and code[i + 1] & 0x1F == 1)):
            has_modrm = False                           # vzeroupper / vzeroall
        mi = j + 1
    elif b == 0x8F and i + 3 < n and code[i + 1] & 0x1F >= 8:
        # AMD XOP (8f RXBmmmmm WvvvvLpp opcode modrm): map 8/9/a.  The kernel's
        # decoder does not know XOP (it reads 8f as Grp1a pop and gets the
        # length wrong), so such an instruction cannot be probed or copied
        # there; see the refusal below.
        omap, op, mi = 4, code[i + 3], i + 4
    elif b == 0x0F and i + 1 < n:
        b2 = code[i + 1]
        if b2 in (0x38, 0x3A) and i + 2 < n:
            omap, op, mi = 3, code[i + 2], i + 3
        else:
            omap, op, mi = 2, b2, i + 2
            has_modrm = op not in _NO_MODRM_2
    else:
        omap, op, mi = 1, b, i + 1
        has_modrm = op in _MODRM_1
    if has_modrm and mi < n:
        modrm = code[mi]
        mod, reg, rm = modrm >> 6, (modrm >> 3) & 7, modrm & 7
        modrm_reg: int | None = reg
        # insn_rip_relative(): mod == 00 && rm == 101 (no SIB in 64-bit mode);
        # like the kernel, this includes EIP-relative ([eip + disp32], 67 prefix).
        # mov to/from CR/DR (0f 20-23) ignore mod: always registers.
        rip = mod == 0 and rm == 5 and not (omap == 2 and 0x20 <= op <= 0x27)
    else:
        mod, reg, rm = 0, 0, 0      # the kernel reads modrm.bytes[0] == 0
        modrm_reg = None
        rip = False

    reason = _can_boost(omap, op, reg, prefixes)

    emulate = None
    refused = None
    if omap == 1:
        # prepare_emulation()
        emulate = _EMULATE_ONEBYTE.get(op)
        unsupported = _EMULATE_UNSUPPORTED.get(op)
        if op == 0xFF and modrm_reg is not None:
            # "Since the 0xff is an extended group opcode, the instruction is
            # determined by the MOD/RM byte."
            if reg in (2, 4):
                kind = "call" if reg == 2 else "jmp"
                emulate = f"{kind} reg" if mod == 3 else f"{kind} mem"
                if 0x67 in prefixes:        # insn->addr_bytes != sizeof(unsigned long)
                    unsupported = f"indirect {kind} with address-size prefix"
                elif mod != 3:              # "TODO: support memory addressing"
                    unsupported = f"indirect {kind} through memory"
            elif reg in (3, 5):             # call/jmp far, absolute indirect
                emulate = unsupported = "far call" if reg == 3 else "far jmp"
        # can_probe()'s is_exception_insn() first, then __copy_instruction()'s
        # insn_masking_exception(), then prepare_emulation()'s -EOPNOTSUPP.
        refused = _EXC_ONEBYTE.get(op)
        if refused is None:
            if op == 0x17 or (op == 0x8E and reg == 2 and modrm_reg is not None):
                refused = "pop ss" if op == 0x17 else "mov ss"
            elif unsupported is not None:
                refused = unsupported
            elif op in _INVALID64:
                # Not refused by the kernel (it would single-step into #UD).
                refused = "invalid in 64-bit mode"
    elif omap == 2:
        refused = _EXC_TWOBYTE.get(op)                      # UD0 / UD1 / UD2
        if 0x80 <= op <= 0x8F:
            emulate = "jcc rel"
        elif op == 0x01 and modrm_reg == 0 and mod == 3:
            # 0f 01 c0-c7 (vmcall, vmlaunch, vmresume, vmxoff, ...):
            # "VM extensions - not supported"
            emulate = refused = "vmx"
    elif omap == 4 and b == 0x8F:
        reason = "xop (unknown to the kernel decoder)"
        refused = "xop (unknown to the kernel decoder)"
    elif omap == 4:
        # KERNEL: is_exception_insn() and prepare_emulation() switch on
        # opcode.bytes[0], which for VEX/EVEX is the opcode byte within its
        # map, so the kernel refuses to probe e.g. vpsllw (VEX 0f f1: "int1"),
        # vpminsw (VEX 0f ea: "far jmp"), vfmsub132ps (VEX 0f38 9a: "far
        # call"), vgf2p8mulb / vgf2p8affine(inv)qb (0f38 cf, 0f3a ce/cf).
        # Those refusals are ported (they only make us more conservative).
        # The kernel's *emulation* of VEX opcodes that look like branches
        # (vpor as "jmp rel8", vcmpps as "ret", vpsubsb as "call rel"...) is a
        # latent kernel bug and is NOT ported: emulate stays None for VEX/EVEX.
        why = _EXC_ONEBYTE.get(op) or _EMULATE_UNSUPPORTED.get(op)
        if why is None and op == 0xFF and modrm_reg is not None:
            if reg in (3, 5):
                why = "far call" if reg == 3 else "far jmp"
            elif reg in (2, 4) and (mod != 3 or 0x67 in prefixes):
                why = "indirect call/jmp through memory"
        if why is not None:
            refused = f"vex/evex opcode {op:02x} read as {why}"

    rel_target = None
    rel_size = 0
    if omap == 1 and op == 0xC7 and modrm_reg == 7 and mod == 3:
        # xbegin rel16/32 (c7 f8).  KERNEL: can_boost() lets c7 through and
        # prepare_emulation() has no case for it, so the kernel would run it
        # out of line with its abort target relative to the copy.  Not ported:
        # refused boosting here, and the target is reported.
        reason = "xbegin (relative abort target)"
        rel_size = n - (mi + 1)
        rel_target = (address + n + int.from_bytes(code[mi + 1:n], "little", signed=True)) & _MASK64
    elif emulate in _REL_CLASSES:
        # The displacement is the whole tail after the opcode (no ModRM, no
        # other immediate): 1 byte for jcc8/jmp8/loop/jcxz, 4 for the rest.
        start = i + 2 if omap == 2 else i + 1
        rel_size = n - start
        rel = int.from_bytes(code[start:n], "little", signed=True)
        rel_target = (address + n + rel) & _MASK64

    return InsnInfo(n, omap, op, modrm_reg, not reason, reason, emulate, refused,
                    rip, rel_target, rel_size)
