"""rewriter/arch/x86_64/insn.py: the port of arch/x86/kernel/kprobes/core.c's
can_boost() / twobyte_is_boostable[], prepare_emulation() and can_probe()'s
refusals.  Encodings below were checked against GNU as + objdump."""
from __future__ import annotations

import dataclasses
import os

import capstone
import pytest
from capstone import x86 as csx86

from rewriter.arch.x86_64 import insn as x86insn
from rewriter.arch.x86_64.insn import InsnInfo, classify, decode_length

ARCHES = ["x86_64"]      # x86-64 only: x86-64 instruction encodings (rewriter/arch/x86_64/insn.py)

A = 0x401000

# (name, bytes, expected fields).  Unlisted fields are not checked, except that
# boostable must agree with boost_reason == "".
CASES = [
    # --- plain, boostable, single-steppable -------------------------------------------
    ("push rbp", "55", dict(length=1, opcode_map=1, opcode=0x55, modrm_reg=None, boostable=True,
                            emulate=None, probe_refused=None, rip_relative=False, rel_target=None, rel_size=0)),
    ("pop rbx", "5b", dict(length=1, boostable=True, emulate=None)),
    ("push r12", "4154", dict(length=2, opcode=0x54, boostable=True)),
    ("mov rsp,rbp", "4889e5", dict(length=3, opcode=0x89, modrm_reg=4, boostable=True, rip_relative=False)),
    ("mov 0x10(rdi),rax", "488b4710", dict(length=4, opcode=0x8B, modrm_reg=0, boostable=True, rip_relative=False)),
    ("lea 0x100(rip),rdi", "488d3d00010000", dict(length=7, opcode=0x8D, modrm_reg=7, boostable=True,
                                                   rip_relative=True, rel_target=None, rel_size=0)),
    ("add $8,rsp", "4883c408", dict(length=4, opcode=0x83, modrm_reg=0, boostable=True)),
    ("cmp rsi,rdi", "4839f7", dict(length=3, opcode=0x39, boostable=True)),
    ("xchg rax,rbx", "4893", dict(length=2, boostable=True)),
    ("enter", "c8100000", dict(length=4, opcode=0xC8, boostable=True, emulate=None)),
    ("leave", "c9", dict(length=1, boostable=True, emulate=None)),
    ("imul $3,rsi,rax", "486bc603", dict(length=4, boostable=True)),
    ("div rcx (f7 /6)", "48f7f1", dict(length=3, modrm_reg=6, boostable=True)),
    ("idivl 8(rsp) (f7 /7)", "f77c2408", dict(length=4, modrm_reg=7, boostable=True)),
    ("testb $1,(rdi) (f6 /0)", "f60701", dict(length=3, modrm_reg=0, boostable=True)),
    ("not rax (f7 /2)", "48f7d0", dict(length=3, modrm_reg=2, boostable=True)),
    ("shl $3,rax (c1 /4)", "48c1e003", dict(length=4, modrm_reg=4, boostable=True)),
    ("sar cl,rdx (d3 /7)", "48d3fa", dict(length=3, modrm_reg=7, boostable=True)),
    ("incl (rdi) (ff /0)", "ff07", dict(length=2, modrm_reg=0, boostable=True, emulate=None)),
    ("decb al (fe /1)", "fec8", dict(length=2, modrm_reg=1, boostable=True)),
    ("movslq (63)", "4863c7", dict(length=3, boostable=True)),
    ("cld", "fc", dict(boostable=True)),
    ("xlat", "d7", dict(boostable=True)),
    ("nop", "90", dict(length=1, boostable=True)),
    ("xchg ax,ax (66 90)", "6690", dict(length=2, boostable=True)),
    # --- KERNEL: lock/rep are prefixes to the decoder, never opcode.bytes[0] -----------
    ("lock addl $1,(rdi)", "f0830701", dict(length=4, opcode=0x83, modrm_reg=0, boostable=True, emulate=None)),
    ("rep movsb", "f3a4", dict(length=2, opcode=0xA4, boostable=True)),
    ("repz ret", "f3c3", dict(length=2, boostable=True, emulate="ret")),
    # --- two-byte opcodes: the twobyte_is_boostable bitmap ------------------------------
    ("nopl (0f 1f)", "0f1f0400", dict(length=4, opcode_map=2, opcode=0x1F, modrm_reg=0, boostable=True)),
    ("nopl 0(rax,rax) 5-byte", "0f1f440000", dict(length=5, opcode_map=2, boostable=True)),
    ("cs nopw (prefixes ignored for 0f xx)", "2e660f1f0400", dict(length=6, opcode_map=2, boostable=True)),
    ("66 cs nopw 10-byte", "662e0f1f840000000000", dict(length=10, opcode_map=2, boostable=True)),
    ("movzbl (rsi)", "0fb606", dict(length=3, opcode_map=2, opcode=0xB6, boostable=True)),
    ("movzbl with 67 (two-byte: prefix not checked)", "670fb606", dict(length=4, boostable=True)),
    ("movsbq", "480fbec0", dict(length=4, opcode=0xBE, boostable=True)),
    ("cmove", "480f44c6", dict(length=4, opcode_map=2, opcode=0x44, boostable=True)),
    ("sete", "0f94c0", dict(length=3, opcode=0x94, boostable=True)),
    ("imul rsi,rax (0f af)", "480fafc6", dict(length=4, opcode=0xAF, boostable=True)),
    ("bsf", "480fbcc7", dict(length=4, opcode=0xBC, boostable=True)),
    ("movdqa", "660f6fc1", dict(length=4, opcode_map=2, opcode=0x6F, boostable=True)),
    ("movq rax,xmm0", "66480f6ec0", dict(length=5, opcode=0x6E, boostable=True)),
    ("pcmpeqb (0f 74: boostable in the kernel bitmap)", "660f74c1", dict(length=4, boostable=True)),
    ("rdtsc (0f 31)", "0f31", dict(length=2, opcode=0x31, modrm_reg=None, boostable=True)),
    ("cmpxchg (0f b1)", "480fb10f", dict(length=4, boostable=True)),
    ("xadd (0f c1)", "0fc107", dict(length=3, boostable=True)),
    ("bswap (0f c8)", "0fc8", dict(length=2, modrm_reg=None, boostable=True)),
    ("syscall", "0f05", dict(length=2, opcode_map=2, opcode=0x05, boostable=False,
                             boost_reason="twobyte 0f 05 not boostable", emulate=None, probe_refused=None)),
    ("cpuid", "0fa2", dict(length=2, boostable=False, boost_reason="twobyte 0f a2 not boostable")),
    ("endbr64", "f30f1efa", dict(length=4, opcode_map=2, opcode=0x1E, boostable=False,
                                 boost_reason="twobyte 0f 1e not boostable", probe_refused=None)),
    ("cmpxchg8b (0f c7)", "0fc70f", dict(length=3, boostable=False, boost_reason="twobyte 0f c7 not boostable")),
    ("xgetbv (0f 01 /2)", "0f01d0", dict(length=3, boostable=False, emulate=None, probe_refused=None)),
    ("rdtscp", "0f01f9", dict(length=3, boostable=False, probe_refused=None)),
    ("pause", "f390", dict(length=2, boostable=True)),
    # --- three-byte opcodes -----------------------------------------------------------
    ("pshufb (0f 38 00)", "660f3800c1", dict(length=5, opcode_map=3, opcode=0x00, modrm_reg=0,
                                            boostable=False, boost_reason="three-byte opcode")),
    ("palignr (0f 3a 0f)", "660f3a0fc104", dict(length=6, opcode_map=3, opcode=0x0F, boostable=False,
                                                boost_reason="three-byte opcode")),
    # --- VEX / EVEX: the kernel reads the VEX opcode byte as a one-byte opcode --------
    ("vmovdqu (rdi),ymm0", "c5fe6f07", dict(length=4, opcode_map=4, opcode=0x6F, modrm_reg=0, boostable=True,
                                            rip_relative=False, emulate=None)),
    ("vmovdqu 0x20(rip),ymm1", "c5fe6f0d20000000", dict(length=8, opcode_map=4, opcode=0x6F, boostable=True,
                                                         rip_relative=True)),
    ("vbroadcastss (rip) VEX3 0f38", "c4e279180500000000", dict(length=9, opcode_map=4, opcode=0x18,
                                                               rip_relative=True, boostable=True)),
    ("EVEX vmovups (rip),zmm0", "62f17c48100500000000", dict(length=10, opcode_map=4, opcode=0x10,
                                                              rip_relative=True, boostable=True)),
    ("vpxor", "c5edefd9", dict(length=4, opcode_map=4, opcode=0xEF, boostable=True)),
    ("vzeroupper (VEX 77 -> 'jcc')", "c5f877", dict(length=3, opcode_map=4, opcode=0x77, modrm_reg=None,
                                                   boostable=False, emulate=None, probe_refused=None,
                                                   rel_target=None)),
    ("vpor (VEX eb -> 'jmp rel8')", "c5edebd9", dict(length=4, opcode=0xEB, boostable=False, emulate=None,
                                                     rel_target=None, rel_size=0)),
    ("vpsllw (VEX f1 -> refused as int1)", "c5f9f1c1", dict(length=4, opcode=0xF1, boostable=False, emulate=None)),
    # --- relative branches: emulated, never boostable ---------------------------------
    ("je rel8", "7410", dict(length=2, opcode=0x74, boostable=False, boost_reason="jcc", emulate="jcc rel",
                             rel_target=A + 0x12, rel_size=1)),
    ("jne rel8 backwards", "75fe", dict(length=2, emulate="jcc rel", rel_target=A, rel_size=1)),
    ("jne rel32", "0f8500010000", dict(length=6, opcode_map=2, opcode=0x85, boostable=False,
                                       boost_reason="twobyte 0f 85 not boostable", emulate="jcc rel",
                                       rel_target=A + 6 + 0x100, rel_size=4)),
    ("jl rel32 backwards", "0f8cf0ffffff", dict(length=6, emulate="jcc rel", rel_target=A + 6 - 0x10, rel_size=4)),
    ("jmp rel8", "eb05", dict(length=2, opcode=0xEB, boostable=False, boost_reason="jmp rel8",
                              emulate="jmp rel", rel_target=A + 7, rel_size=1)),
    ("jmp rel32", "e9fbffffff", dict(length=5, boostable=False, boost_reason="jmp rel32", emulate="jmp rel",
                                     rel_target=A, rel_size=4)),
    ("call rel32", "e800100000", dict(length=5, opcode=0xE8, boostable=False, boost_reason="call rel32",
                                      emulate="call rel", rel_target=A + 5 + 0x1000, rel_size=4, probe_refused=None)),
    ("bnd jmp rel32", "f2e900000000", dict(length=6, emulate="jmp rel", rel_target=A + 6, rel_size=4)),
    ("loop", "e2fe", dict(length=2, boostable=False, boost_reason="loop", emulate="loop", rel_target=A, rel_size=1)),
    ("loope", "e110", dict(length=2, emulate="loop", rel_target=A + 0x12)),
    ("loopne", "e010", dict(length=2, emulate="loop", rel_target=A + 0x12)),
    ("jrcxz", "e308", dict(length=2, boostable=False, boost_reason="jcxz", emulate="jcxz",
                           rel_target=A + 0xA, rel_size=1)),
    ("jecxz (67 prefix)", "67e308", dict(length=3, boostable=False, boost_reason="address-size prefix",
                                         emulate="jcxz", rel_target=A + 0xB, rel_size=1)),
    ("xbegin (not boosted: relative abort target)", "c7f800010000",
     dict(length=6, boostable=False, emulate=None, rel_target=A + 6 + 0x100, rel_size=4)),
    # --- returns and flag modifiers: emulated -----------------------------------------
    ("ret", "c3", dict(length=1, opcode=0xC3, boostable=True, emulate="ret", probe_refused=None)),
    ("ret $8", "c20800", dict(length=3, boostable=True, emulate="ret imm")),
    ("lret", "cb", dict(length=1, emulate="lret")),
    ("pushf", "9c", dict(length=1, boostable=True, emulate="pushf")),
    ("popf", "9d", dict(length=1, boostable=True, emulate="popf")),
    ("cli", "fa", dict(length=1, boostable=True, emulate="cli")),
    ("sti", "fb", dict(length=1, boostable=True, emulate="sti")),
    # --- indirect branches (Grp5) -------------------------------------------------------
    ("call *rax", "ffd0", dict(length=2, opcode=0xFF, modrm_reg=2, boostable=False, boost_reason="grp5 /2",
                               emulate="call reg", probe_refused=None, rel_target=None)),
    ("call *r11", "41ffd3", dict(length=3, modrm_reg=2, emulate="call reg", probe_refused=None)),
    ("jmp *rax (ff /4 is boostable)", "ffe0", dict(length=2, modrm_reg=4, boostable=True, emulate="jmp reg",
                                                   probe_refused=None)),
    ("notrack jmp *rdx", "3effe2", dict(length=3, modrm_reg=4, boostable=True, emulate="jmp reg")),
    ("jmp *0x100(rip)", "ff2500010000", dict(length=6, modrm_reg=4, boostable=True, rip_relative=True,
                                             emulate="jmp mem", probe_refused="indirect jmp through memory",
                                             rel_target=None)),
    ("call *0x10(rax)", "ff5010", dict(length=3, modrm_reg=2, boostable=False, emulate="call mem",
                                      probe_refused="indirect call through memory")),
    ("call *rax with 67", "67ffd0", dict(length=3, emulate="call reg",
                                         probe_refused="indirect call with address-size prefix")),
    ("ljmp *(rax) (ff /5)", "ff28", dict(length=2, modrm_reg=5, boostable=False, boost_reason="grp5 /5",
                                         emulate="far jmp", probe_refused="far jmp")),
    ("lcall *(rax) (ff /3)", "ff18", dict(length=2, modrm_reg=3, boostable=False, probe_refused="far call")),
    ("pushq 0x100(rip) (ff /6)", "ff3500010000", dict(length=6, modrm_reg=6, boostable=False,
                                                      boost_reason="grp5 /6", rip_relative=True, emulate=None,
                                                      probe_refused=None)),
    # --- groups with reserved/special encodings -----------------------------------------
    ("test imm with f6 /1", "f6c801", dict(length=3, modrm_reg=1, boostable=False, boost_reason="grp3 /1")),
    ("shl with d1 /6 (sal alias)", "d1f0", dict(length=2, modrm_reg=6, boostable=False, boost_reason="grp2 /6")),
    # --- cannot be probed ---------------------------------------------------------------
    ("ud2", "0f0b", dict(length=2, opcode_map=2, opcode=0x0B, boostable=False, probe_refused="ud2")),
    ("ud1", "0fb9", dict(opcode_map=2, opcode=0xB9, boostable=False, probe_refused="ud1")),
    ("ud0", "0fff", dict(opcode_map=2, opcode=0xFF, boostable=False, probe_refused="ud0")),
    ("int3", "cc", dict(length=1, opcode=0xCC, boostable=False, boost_reason="int3", emulate="int3",
                        probe_refused="int3")),
    ("int $0x80", "cd80", dict(length=2, opcode=0xCD, boostable=False, boost_reason="int n", probe_refused="int n")),
    ("int1", "f1", dict(length=1, boostable=False, boost_reason="int1", probe_refused="int1")),
    ("into (invalid in 64-bit, decoded as 1 byte)", "ce", dict(length=1, boostable=False, boost_reason="into",
                                                               probe_refused="into")),
    ("iretq", "48cf", dict(length=2, boostable=True, emulate="iret", probe_refused="iret")),
    ("mov eax,ss (masks exceptions)", "8ed0", dict(length=2, modrm_reg=2, probe_refused="mov ss")),
    ("vmcall", "0f01c1", dict(length=3, boostable=False, emulate="vmx", probe_refused="vmx")),
    ("hlt", "f4", dict(length=1, boostable=False, boost_reason="hlt", probe_refused=None)),
    ("x87 fldl", "dd07", dict(length=2, opcode=0xDD, boostable=False, boost_reason="x87 escape")),
    ("x87 fxch", "d9c9", dict(length=2, boostable=False, boost_reason="x87 escape")),
    # --- prefixes that block boosting of one-byte opcodes ------------------------------
    ("cs-prefixed mov", "2e8b00", dict(length=3, boostable=False, boost_reason="cs prefix")),
    ("addr32 mov", "678b00", dict(length=3, boostable=False, boost_reason="address-size prefix")),
    ("ds-prefixed mov (boostable)", "3e8b00", dict(length=3, boostable=True)),
    ("fs-prefixed mov (boostable)", "64488b042528000000", dict(length=9, boostable=True, rip_relative=False)),
    ("EIP-relative (67, mod=0 rm=5, as insn_rip_relative())", "678b0500000000",
     dict(length=7, boostable=False, rip_relative=True)),
]


@pytest.mark.parametrize("name,hexcode,want", CASES, ids=[c[0] for c in CASES])
def test_classify(name, hexcode, want):
    info = classify(bytes.fromhex(hexcode) + b"\xcc" * 8, A)
    got = dataclasses.asdict(info)
    for k, v in want.items():
        assert got[k] == v, f"{name}: {k} = {got[k]!r}, expected {v!r} ({info})"
    assert info.boostable == (info.boost_reason == "")
    if info.rel_target is None:
        assert info.rel_size == 0


def test_enough_cases():
    assert len(CASES) >= 40


def test_reason_strings():
    """The not-boostable reasons are stable short names."""
    def r(h):
        return classify(bytes.fromhex(h) + bytes(8), A).boost_reason
    assert r("0f05") == "twobyte 0f 05 not boostable"
    assert r("660f3800c1") == "three-byte opcode"
    assert r("2e8b00") == "cs prefix"
    assert r("678b00") == "address-size prefix"
    assert r("e800000000") == "call rel32"
    assert r("f6c801") == "grp3 /1"
    assert r("fec0") == "" and r("fec8") == ""
    assert r("ffd0") == "grp5 /2" and r("ff30") == "grp5 /6" and r("ffe0") == ""
    assert r("7400") == "jcc"
    assert r("cc") == "int3"
    assert r("c5f877").startswith("vex/evex opcode 77") and r("c5f877").endswith("jcc")


def test_twobyte_bitmap_matches_kernel_source():
    """twobyte_is_boostable[] of arch/x86/kernel/kprobes/core.c, transcribed
    from the kernel's W() rows independently of the module's table."""
    kernel_rows = """
        W(0x00, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0)
        W(0x10, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1)
        W(0x20, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        W(0x30, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        W(0x40, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)
        W(0x50, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        W(0x60, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1)
        W(0x70, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1)
        W(0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        W(0x90, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)
        W(0xa0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1)
        W(0xb0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1)
        W(0xc0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
        W(0xd0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1)
        W(0xe0, 0, 1, 1, 0, 0, 1, 0, 0, 1, 1, 0, 1, 1, 1, 0, 1)
        W(0xf0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1, 1, 1, 0)
    """
    want = set()
    words = [0] * 8
    for line in kernel_rows.split("W(")[1:]:
        vals = [int(v.strip(" )\n"), 0) for v in line.split(",")]
        row, bits = vals[0], vals[1:]
        assert len(bits) == 16
        for k, bit in enumerate(bits):
            if bit:
                want.add(row + k)
                words[(row + k) // 32] |= 1 << ((row + k) % 32)
    assert set(x86insn.TWOBYTE_IS_BOOSTABLE) == want
    # the u32 words the kernel's macro produces (test_bit() on them)
    assert words == [0x8000034C, 0x0002000F, 0x0000FFFF, 0xC0F0CFFF,
                     0xFFFF0000, 0xF8FFBB3B, 0xBB2EFF03, 0x772EBB26]
    for op in range(256):
        code = bytes([0x0F, op]) + bytes(13)
        try:
            info = classify(code, A)
        except ValueError:
            continue
        if info.opcode_map == 2:
            assert info.boostable == (op in want), hex(op)


def test_all_jcc_forms():
    for cc in range(16):
        short = classify(bytes([0x70 | cc, 0x10]), A)
        assert (short.emulate, short.rel_size, short.rel_target, short.boostable) == ("jcc rel", 1, A + 0x12, False)
        near = classify(bytes([0x0F, 0x80 | cc, 0x00, 0x01, 0x00, 0x00]), A)
        assert (near.emulate, near.rel_size, near.rel_target, near.boostable) == ("jcc rel", 4, A + 0x106, False)


def test_target_wraps_to_64_bits():
    info = classify(bytes.fromhex("e800ffffff"), 0x10)
    assert info.rel_target == (0x15 - 0x100) & (2**64 - 1)


def test_accepts_bytearray_and_memoryview():
    b = bytearray.fromhex("488d3d00010000") + bytearray(20)
    assert classify(b, A) == classify(memoryview(b), A) == classify(bytes(b), A)
    assert classify(b, A).length == 7


@pytest.mark.parametrize("hexcode", ["", "0f", "f0", "66", "4866", "e8000000", "d500", "0f3800"])
def test_undecodable_raises(hexcode):
    with pytest.raises(ValueError):
        classify(bytes.fromhex(hexcode), A)


def test_decode_length():
    assert decode_length(bytes.fromhex("488d3d00010000cc"), A) == 7
    assert decode_length(bytes.fromhex("662e0f1f840000000000"), A) == 10
    assert decode_length(bytes.fromhex("c3"), A) == 1
    with pytest.raises(ValueError):
        decode_length(b"", A)
    with pytest.raises(ValueError):
        decode_length(bytes.fromhex("e800"), A)


def test_interface():
    names = [f.name for f in dataclasses.fields(InsnInfo)]
    assert names == ["length", "opcode_map", "opcode", "modrm_reg", "boostable", "boost_reason", "emulate",
                     "probe_refused", "rip_relative", "rel_target", "rel_size"]
    info = classify(b"\x90", A)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.length = 2


def _text_section(path):
    from elftools.elf.elffile import ELFFile
    with open(path, "rb") as f:
        sec = ELFFile(f).get_section_by_name(".text")
        return sec.data(), sec["sh_addr"]


@pytest.mark.skipif(not os.path.exists("/bin/ls"), reason="no /bin/ls")
def test_bin_ls_text_decodes_linearly():
    """Every instruction of /bin/ls's .text, decoded one after another, is
    classified without an exception; lengths, RIP-relative operands, ModRM
    presence and relative-branch targets agree with Capstone's detailed view."""
    data, base = _text_section("/bin/ls")
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    cs.detail = True
    pos = count = 0
    maps = set()
    while pos < len(data):
        addr = base + pos
        chunk = data[pos:pos + 15]
        info = classify(chunk, addr)
        ci = next(cs.disasm(chunk, addr, 1))
        assert info.length == ci.size, hex(addr)
        rip = any(o.type == csx86.X86_OP_MEM and o.mem.base in (csx86.X86_REG_RIP, csx86.X86_REG_EIP)
                  for o in ci.operands)
        assert info.rip_relative == rip, (hex(addr), ci.mnemonic, ci.op_str)
        assert (info.modrm_reg is not None) == (ci.modrm_offset != 0), (hex(addr), ci.mnemonic)
        if ci.group(csx86.X86_GRP_BRANCH_RELATIVE):
            imm = [o.imm & (2**64 - 1) for o in ci.operands if o.type == csx86.X86_OP_IMM]
            assert [info.rel_target] == imm, (hex(addr), ci.mnemonic, ci.op_str)
            assert info.rel_size in (1, 4)
        else:
            assert info.rel_target is None, (hex(addr), ci.mnemonic)
        maps.add(info.opcode_map)
        pos += info.length
        count += 1
    assert pos == len(data)
    assert count > 1000
    assert {1, 2} <= maps


@pytest.mark.skipif(not os.path.exists("/bin/ls"), reason="no /bin/ls")
def test_length_decoder_matches_disasm_lite():
    """classify()'s lengths (insn._length: cs_disasm_iter() into one cs_insn) are
    disasm_lite()'s, and 0 where it decodes nothing, at every offset of the first
    40 KB of /bin/ls's .text (instruction starts or not), and at the end of the bytes."""
    data, base = _text_section("/bin/ls")
    lite = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    for pos in range(min(len(data), 40_000)):
        chunk = data[pos:pos + 15]
        want = next((size for _a, size, _m, _o in lite.disasm_lite(chunk, base + pos, 1)), 0)
        assert x86insn._length(chunk, base + pos) == want, hex(base + pos)
    for tail in (b"", b"\x0f", b"\xe8\x00", b"\x90"):
        assert x86insn._length(tail, A) == next((s for _a, s, _m, _o in lite.disasm_lite(tail, A, 1)), 0)


def test_length_hint_changes_nothing():
    """A length the caller already has (a decoded function's boundaries: copy_region())
    gives the classification Capstone's own length gives."""
    for name, hexcode, _ in CASES:
        code = bytes.fromhex(hexcode) + bytes(15)
        x86insn._MEMO.clear()
        want = classify(code, A)
        x86insn._MEMO.clear()
        assert classify(code, A, want.length) == want, name
