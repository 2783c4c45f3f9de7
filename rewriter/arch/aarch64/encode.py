"""The AArch64 instructions kprewrite writes, encoded here rather than by
Keystone: Keystone 0.9.2 wraps out-of-range PC-relative offsets silently (a `b`
of +128 MiB becomes -128 MiB), mis-encodes `adr` to a numeric target and knows
no PAC/BTI mnemonic.  Every PC-relative instruction is range-checked, then
decoded back with Capstone and compared with what was asked (check())."""
from __future__ import annotations

import struct

import capstone

_cs = capstone.Cs(capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)
_cs.detail = False


class EncodeError(Exception):
    """A PC-relative operand out of its instruction's reach (or misaligned)."""


def _word(w: int) -> bytes:
    return struct.pack("<I", w & 0xFFFFFFFF)


def _imm(delta: int, bits: int, scale: int, what: str) -> int:
    if delta % scale:
        raise EncodeError(f"{what}: offset {delta:#x} is not a multiple of {scale}")
    v = delta // scale
    if not -(1 << (bits - 1)) <= v < (1 << (bits - 1)):
        raise EncodeError(f"{what}: offset {delta:#x} is out of reach (+-{(1 << (bits - 1)) * scale:#x})")
    return v & ((1 << bits) - 1)


def check(code: bytes, at: int, mnemonic: str, target: int | None = None) -> bytes:
    """Decode `code` at `at` with Capstone: one instruction, `mnemonic`, whose last
    operand is `target` when given.  Raises EncodeError otherwise."""
    got = list(_cs.disasm_lite(code, at))
    if len(got) != 1 or got[0][2] != mnemonic:
        raise EncodeError(f"encoding check at {at:#x}: {code.hex()} decodes as {got!r}, not {mnemonic}")
    if target is not None:
        last = got[0][3].split(",")[-1].strip().lstrip("#")
        try:
            value = int(last, 0) & 0xFFFFFFFFFFFFFFFF
        except ValueError:
            raise EncodeError(f"encoding check at {at:#x}: {got[0][2]} {got[0][3]} names no address") from None
        if value != target & 0xFFFFFFFFFFFFFFFF:
            raise EncodeError(f"encoding check at {at:#x}: {got[0][2]} {got[0][3]} does not reach {target:#x}")
    return code


def b(at: int, target: int, link: bool = False) -> bytes:
    """B / BL (+-128 MiB)."""
    w = (0x94000000 if link else 0x14000000) | _imm(target - at, 26, 4, "bl" if link else "b")
    return check(_word(w), at, "bl" if link else "b", target)


COND_NAMES = ["eq", "ne", "hs", "lo", "mi", "pl", "vs", "vc", "hi", "ls", "ge", "lt", "gt", "le", "al", "nv"]


def b_cond(at: int, cond: int, target: int) -> bytes:
    """B.cond (+-1 MiB)."""
    w = 0x54000000 | (_imm(target - at, 19, 4, "b.cond") << 5) | cond
    return check(_word(w), at, f"b.{COND_NAMES[cond]}", target)


def cbz(at: int, rt: int, sf: int, nonzero: int, target: int) -> bytes:
    """CBZ / CBNZ (+-1 MiB)."""
    w = 0x34000000 | (sf << 31) | (nonzero << 24) | (_imm(target - at, 19, 4, "cbz") << 5) | rt
    return check(_word(w), at, "cbnz" if nonzero else "cbz", target)


def tbz(at: int, rt: int, bit: int, nonzero: int, target: int) -> bytes:
    """TBZ / TBNZ (+-32 KiB)."""
    w = 0x36000000 | ((bit >> 5) << 31) | (nonzero << 24) | ((bit & 31) << 19) \
        | (_imm(target - at, 14, 4, "tbz") << 5) | rt
    return check(_word(w), at, "tbnz" if nonzero else "tbz", target)


def adr(at: int, rd: int, target: int) -> bytes:
    """ADR (+-1 MiB)."""
    v = _imm(target - at, 21, 1, "adr")
    w = 0x10000000 | ((v & 3) << 29) | ((v >> 2) << 5) | rd
    return check(_word(w), at, "adr", target)


def adrp(at: int, rd: int, target: int) -> bytes:
    """ADRP (+-4 GiB, the 4 KiB page of target)."""
    v = _imm((target & ~0xFFF) - (at & ~0xFFF), 21, 4096, "adrp")
    w = 0x90000000 | ((v & 3) << 29) | ((v >> 2) << 5) | rd
    return check(_word(w), at, "adrp", target & ~0xFFF)


def ldr_lit(at: int, rt: int, target: int, size: int = 8) -> bytes:
    """LDR Wt/Xt, label (size 4 or 8) or LDRSW Xt, label (size -4); +-1 MiB."""
    opc = {4: 0, 8: 1, -4: 2}[size]
    w = (opc << 30) | 0x18000000 | (_imm(target - at, 19, 4, "ldr literal") << 5) | rt
    return check(_word(w), at, "ldrsw" if size == -4 else "ldr", target)


# Position-independent instructions (no check needed beyond their fields).

def movz(rd: int, imm16: int, shift: int = 0) -> bytes:
    return _word(0xD2800000 | ((shift // 16) << 21) | ((imm16 & 0xFFFF) << 5) | rd)


def movk(rd: int, imm16: int, shift: int = 0) -> bytes:
    return _word(0xF2800000 | ((shift // 16) << 21) | ((imm16 & 0xFFFF) << 5) | rd)


def mov_imm64(rd: int, value: int) -> bytes:
    """MOVZ + MOVKs: a 64-bit constant in rd (a link-time address, where no PC-relative form reaches)."""
    value &= 0xFFFFFFFFFFFFFFFF
    out = movz(rd, value & 0xFFFF)
    for s in (16, 32, 48):
        if (value >> s) & 0xFFFF:
            out += movk(rd, (value >> s) & 0xFFFF, s)
    return out


def br(rn: int) -> bytes:
    return _word(0xD61F0000 | (rn << 5))


def blr(rn: int) -> bytes:
    return _word(0xD63F0000 | (rn << 5))


def brk(imm: int) -> bytes:
    return _word(0xD4200000 | ((imm & 0xFFFF) << 5))


def ldr_x(rt: int, rn: int, off: int = 0) -> bytes:
    """LDR Xt, [Xn, #off] (unsigned, 8-aligned)."""
    return _word(0xF9400000 | ((off // 8) << 10) | (rn << 5) | rt)


def str_x(rt: int, rn: int, off: int = 0) -> bytes:
    """STR Xt, [Xn, #off] (unsigned, 8-aligned)."""
    return _word(0xF9000000 | ((off // 8) << 10) | (rn << 5) | rt)


def str_pre(rt: int, rn: int, off: int) -> bytes:
    """STR Xt, [Xn, #off]! (pre-index, -256 <= off < 256)."""
    assert -256 <= off < 256
    return _word(0xF8000C00 | ((off & 0x1FF) << 12) | (rn << 5) | rt)


def ldr_post(rt: int, rn: int, off: int) -> bytes:
    """LDR Xt, [Xn], #off (post-index, -256 <= off < 256)."""
    assert -256 <= off < 256
    return _word(0xF8400400 | ((off & 0x1FF) << 12) | (rn << 5) | rt)


def movn_w(rd: int, imm16: int) -> bytes:
    """MOVN Wd, #imm16 (~imm16 in 32 bits, the upper half zeroed)."""
    return _word(0x12800000 | ((imm16 & 0xFFFF) << 5) | rd)


def ldr_w(rt: int, rn: int, off: int = 0) -> bytes:
    return _word(0xB9400000 | ((off // 4) << 10) | (rn << 5) | rt)


def ldrsw(rt: int, rn: int, off: int = 0) -> bytes:
    return _word(0xB9800000 | ((off // 4) << 10) | (rn << 5) | rt)


def add_imm(rd: int, rn: int, imm12: int) -> bytes:
    """ADD Xd, Xn, #imm12 (31 is sp)."""
    return _word(0x91000000 | ((imm12 & 0xFFF) << 10) | (rn << 5) | rd)


def sub_imm(rd: int, rn: int, imm12: int) -> bytes:
    return _word(0xD1000000 | ((imm12 & 0xFFF) << 10) | (rn << 5) | rd)


def stp_pre(rt: int, rt2: int, rn: int, off: int) -> bytes:
    """STP Xt, Xt2, [Xn, #off]! (off a multiple of 8 in [-512, 504])."""
    return _word(0xA9800000 | (((off // 8) & 0x7F) << 15) | (rt2 << 10) | (rn << 5) | rt)


def ldp_post(rt: int, rt2: int, rn: int, off: int) -> bytes:
    """LDP Xt, Xt2, [Xn], #off."""
    return _word(0xA8C00000 | (((off // 8) & 0x7F) << 15) | (rt2 << 10) | (rn << 5) | rt)


def stp(rt: int, rt2: int, rn: int, off: int) -> bytes:
    """STP Xt, Xt2, [Xn, #off]."""
    return _word(0xA9000000 | (((off // 8) & 0x7F) << 15) | (rt2 << 10) | (rn << 5) | rt)


def ldp(rt: int, rt2: int, rn: int, off: int) -> bytes:
    return _word(0xA9400000 | (((off // 8) & 0x7F) << 15) | (rt2 << 10) | (rn << 5) | rt)


def load_address(at: int, rd: int, target: int) -> bytes:
    """rd = target: adrp + add (8 bytes, +-4 GiB), PC-relative so a PIE's load bias holds."""
    return adrp(at, rd, target) + add_imm(rd, rd, target & 0xFFF)


def add_reg(rd: int, rn: int, rm: int) -> bytes:
    """ADD Xd, Xn, Xm."""
    return _word(0x8B000000 | (rm << 16) | (rn << 5) | rd)


def add_imm_hi(rd: int, rn: int, imm: int) -> bytes:
    """ADD Xd, Xn, #imm12, LSL #12 (31 is sp)."""
    return _word(0x91400000 | (((imm >> 12) & 0xFFF) << 10) | (rn << 5) | rd)


def and_bits(rd: int, rn: int, lo: int, n: int) -> bytes:
    """AND Xd, Xn, #mask: the n bits from bit lo kept (a logical immediate)."""
    assert 0 < n < 64 and 0 <= lo < 64
    return _word(0x92400000 | (((64 - lo) % 64) << 16) | ((n - 1) << 10) | (rn << 5) | rd)


def ldxr(rt: int, rn: int) -> bytes:
    """LDXR Xt, [Xn]."""
    return _word(0xC85F7C00 | (rn << 5) | rt)


def stxr(rs: int, rt: int, rn: int) -> bytes:
    """STXR Ws, Xt, [Xn]."""
    return _word(0xC8007C00 | (rs << 16) | (rn << 5) | rt)


def mrs_tpidr_el0(rt: int) -> bytes:
    return _word(0xD53BD040 | rt)


def mrs_nzcv(rt: int) -> bytes:
    return _word(0xD53B4200 | rt)


def msr_nzcv(rt: int) -> bytes:
    return _word(0xD51B4200 | rt)


def ldrb(rt: int, rn: int, off: int = 0) -> bytes:
    """LDRB Wt, [Xn, #off]."""
    return _word(0x39400000 | ((off & 0xFFF) << 10) | (rn << 5) | rt)


def str_w(rt: int, rn: int, off: int = 0) -> bytes:
    """STR Wt, [Xn, #off] (unsigned, 4-aligned)."""
    return _word(0xB9000000 | ((off // 4) << 10) | (rn << 5) | rt)


def ldr_x_index(rt: int, rn: int, rm: int) -> bytes:
    """LDR Xt, [Xn, Xm, LSL #3]."""
    return _word(0xF8607800 | (rm << 16) | (rn << 5) | rt)


def eor_reg(rd: int, rn: int, rm: int) -> bytes:
    """EOR Xd, Xn, Xm."""
    return _word(0xCA000000 | (rm << 16) | (rn << 5) | rd)


def orr_lsl_w(rd: int, rn: int, rm: int, shift: int) -> bytes:
    """ORR Wd, Wn, Wm, LSL #shift."""
    return _word(0x2A000000 | (rm << 16) | ((shift & 31) << 10) | (rn << 5) | rd)


def ubfx(rd: int, rn: int, lo: int, n: int) -> bytes:
    """UBFX Xd, Xn, #lo, #n."""
    return _word(0xD3400000 | (lo << 16) | ((lo + n - 1) << 10) | (rn << 5) | rd)


def mov_reg(rd: int, rm: int) -> bytes:
    """MOV Xd, Xm (ORR Xd, XZR, Xm)."""
    return _word(0xAA0003E0 | (rm << 16) | rd)


def movz_w(rd: int, imm16: int) -> bytes:
    return _word(0x52800000 | ((imm16 & 0xFFFF) << 5) | rd)


# --- what the inlined kretprobe templates add (retprobe.py) ---

def add_lsl(rd: int, rn: int, rm: int, shift: int) -> bytes:
    """ADD Xd, Xn, Xm, LSL #shift."""
    return _word(0x8B000000 | (rm << 16) | (shift << 10) | (rn << 5) | rd)


def sub_reg(rd: int, rn: int, rm: int) -> bytes:
    """SUB Xd, Xn, Xm (no flags)."""
    return _word(0xCB000000 | (rm << 16) | (rn << 5) | rd)


def sub_reg_w(rd: int, rn: int, rm: int) -> bytes:
    """SUB Wd, Wn, Wm (no flags)."""
    return _word(0x4B000000 | (rm << 16) | (rn << 5) | rd)


def add_imm_w(rd: int, rn: int, imm12: int) -> bytes:
    """ADD Wd, Wn, #imm12."""
    return _word(0x11000000 | ((imm12 & 0xFFF) << 10) | (rn << 5) | rd)


def sub_imm_w(rd: int, rn: int, imm12: int) -> bytes:
    """SUB Wd, Wn, #imm12."""
    return _word(0x51000000 | ((imm12 & 0xFFF) << 10) | (rn << 5) | rd)


def umaddl(rd: int, rn: int, rm: int, ra: int) -> bytes:
    """UMADDL Xd, Wn, Wm, Xa: Xa + Wn * Wm, unsigned."""
    return _word(0x9BA00000 | (rm << 16) | (ra << 10) | (rn << 5) | rd)


def ldaxr_w(rt: int, rn: int) -> bytes:
    """LDAXR Wt, [Xn]."""
    return _word(0x885FFC00 | (rn << 5) | rt)


def stxr_w(rs: int, rt: int, rn: int) -> bytes:
    """STXR Ws, Wt, [Xn]."""
    return _word(0x88007C00 | (rs << 16) | (rn << 5) | rt)


def stlr_w(rt: int, rn: int) -> bytes:
    """STLR Wt, [Xn]."""
    return _word(0x889FFC00 | (rn << 5) | rt)
