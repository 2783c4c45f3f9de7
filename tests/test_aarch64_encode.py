"""The AArch64 back end's encoder and relocator, without a cross toolchain:
each PC-relative class relocated to a far address decodes (Capstone) to an
instruction sequence with the original meaning; out-of-reach operands are
errors, never a wrapped offset (Keystone 0.9.2's defect); the kernel's
refusals are classified; direct branches are named and retargeted."""
import capstone
import pytest

from rewriter.arch import get_arch
from rewriter.arch.aarch64 import emit, encode
from rewriter.arch.aarch64 import insn as I
from rewriter.arch.base import DcrInsn

from conftest import ALL_ARCHES

ARCHES = ALL_ARCHES      # conftest: pure Python, any host

_cs = capstone.Cs(capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)
ORIG, NEW = 0x400000, 0x400000 + 100 * (1 << 20)      # 100 MiB away: beyond adr/b.cond/tbz reach


def _insn(word: int, addr: int = ORIG) -> DcrInsn:
    code = word.to_bytes(4, "little")
    return DcrInsn(addr, code, I.classify(code, addr))


def _dis(code: bytes, at: int) -> list[str]:
    return [f"{m} {o}".strip() for _, _, m, o in _cs.disasm_lite(code, at)]




CASES = {
    # word at ORIG, expected disassembly of the copy at NEW
    "b": (encode.b(ORIG, ORIG + 0x1000), [f"b #{ORIG + 0x1000:#x}"]),
    "bl": (encode.b(ORIG, ORIG + 0x1000, True),
           [f"adrp x30, #{(ORIG + 4) & ~0xFFF:#x}", "add x30, x30, #4", f"b #{ORIG + 0x1000:#x}"]),
    "b.ne": (encode.b_cond(ORIG, 1, ORIG + 0x40), [f"b.eq #{NEW + 8:#x}", f"b #{ORIG + 0x40:#x}"]),
    "cbz": (encode.cbz(ORIG, 3, 1, 0, ORIG - 0x40), [f"cbnz x3, #{NEW + 8:#x}", f"b #{ORIG - 0x40:#x}"]),
    "tbnz": (encode.tbz(ORIG, 5, 33, 1, ORIG + 0x80), [f"tbz x5, #0x21, #{NEW + 8:#x}", f"b #{ORIG + 0x80:#x}"]),
    "adr": (encode.adr(ORIG, 2, ORIG + 0x123), [f"adrp x2, #{ORIG:#x}", "add x2, x2, #0x123"]),
    "adrp": (encode.adrp(ORIG, 7, ORIG + 0x5000), [f"adrp x7, #{ORIG + 0x5000:#x}"]),
    "ldr x": (encode.ldr_lit(ORIG, 4, ORIG + 0x208, 8), [f"adrp x4, #{ORIG:#x}", "add x4, x4, #0x208", "ldr x4, [x4]"]),
    "ldr w": (encode.ldr_lit(ORIG, 4, ORIG + 0x20c, 4), [f"adrp x4, #{ORIG:#x}", "add x4, x4, #0x20c", "ldr w4, [x4]"]),
    "ldrsw": (encode.ldr_lit(ORIG, 9, ORIG - 0x10, -4),
              [f"adrp x9, #{(ORIG - 0x10) & ~0xFFF:#x}", f"add x9, x9, #{(ORIG - 0x10) & 0xFFF:#x}", "ldrsw x9, [x9]"]),
}


@pytest.mark.parametrize("name", CASES)
def test_relocated_copies_keep_their_meaning(name):
    code, want = CASES[name]
    got = _dis(emit.relocate(DcrInsn(ORIG, code, I.classify(code, ORIG)), NEW), NEW)
    assert got == want


def test_position_independent_instructions_are_copied_as_they_are():
    for word in (0xD65F03C0, 0xD63F0100, 0xD503233F, 0xA9BF7BFD, 0x8B020020):   # ret, blr x8, paciasp, stp, add
        i = _insn(word)
        assert emit.relocate(i, NEW) == i.code


def test_out_of_reach_is_an_error_not_a_wrapped_offset():
    with pytest.raises(encode.EncodeError, match="out of reach"):
        encode.b(0, 1 << 27)                  # +128 MiB: one past B's reach
    assert _dis(encode.b(0, (1 << 27) - 4), 0) == [f"b #{(1 << 27) - 4:#x}"]
    with pytest.raises(encode.EncodeError):
        encode.tbz(0, 0, 0, 0, 1 << 15)
    # A copy whose B back cannot reach: EmitError (layout turns it into a one-line error).
    with pytest.raises(emit.EmitError):
        emit.relocate(_insn(int.from_bytes(encode.b(ORIG, ORIG + 8), "little")), ORIG + (1 << 28))


@pytest.mark.parametrize("word,why", [
    (0xD4000001, "svc"), (0xD4200080, "brk"), (0xD51B4200, "msr"), (0xD50323BF, "autiasp"),
    (0xC85F7C20, "exclusive"), (0xC8027C20, "exclusive"), (0xD69F03E0, "eret"), (0xD65F0BFF, "pointer authentication"),
    (0x1C000040, "floating-point literal"), (0xD8000040, "prfm"),
])
def test_refused_as_the_kernel_refuses(word, why):
    assert why in I.classify(word, ORIG).refused


def test_allowed_hints_and_exclusive_sequences():
    for word in (0xD503201F, 0xD503233F, 0xD503245F, 0xD50320FF):    # nop, paciasp, bti c, xpaclri
        assert I.classify(word, ORIG).refused == ""
    words = {ORIG: 0xC85F7C20, ORIG + 4: 0x91000400, ORIG + 8: 0xC8027C20, ORIG + 12: 0x35FFFFA2}
    assert I.atomic_sequence(words.get, ORIG + 4, ORIG) == ORIG        # between ldxr and stxr
    assert I.atomic_sequence(words.get, ORIG + 12, ORIG) is None        # after the stxr


def test_direct_branches_are_named_and_retargeted():
    arch = get_arch("aarch64")
    bl = _insn(int.from_bytes(encode.b(ORIG, ORIG + 0x10, True), "little"))
    assert arch.direct_branch_target(bl) == ORIG + 0x10 and arch.is_branch(bl)
    moved = arch.with_branch_target(bl, ORIG + 0x2000)
    assert arch.direct_branch_target(moved) == ORIG + 0x2000 and moved.code == bl.code
    assert _dis(emit.relocate(moved, NEW), NEW)[-1] == f"b #{ORIG + 0x2000:#x}"
    assert arch.direct_branch_target(_insn(0xD503201F)) is None
    addr, patch = emit.retarget_patch(ORIG, bl.code, NEW)
    assert addr == ORIG and _dis(patch, ORIG) == [f"bl #{NEW:#x}"]


def test_template_instructions_decode_as_asked():
    """The instructions the inlined kretprobe templates add (no PC-relative operand)."""
    got = [_dis(code, 0)[0] for code in (
        encode.add_lsl(4, 1, 3, 3), encode.sub_reg(4, 30, 4), encode.sub_reg_w(4, 3, 5), encode.add_imm_w(3, 3, 1),
        encode.sub_imm_w(3, 3, 1), encode.umaddl(4, 3, 4, 30), encode.ldaxr_w(30, 4), encode.stxr_w(5, 30, 4),
        encode.stlr_w(31, 4))]
    assert got == ["add x4, x1, x3, lsl #3", "sub x4, x30, x4", "sub w4, w3, w5", "add w3, w3, #1", "sub w3, w3, #1",
                   "umaddl x4, w3, w4, x30", "ldaxr w30, [x4]", "stxr w5, w30, [x4]", "stlr wzr, [x4]"]
