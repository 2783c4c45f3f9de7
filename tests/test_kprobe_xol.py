"""Unit tests of the x86-64 breakpoint probes' out-of-line plan
(rewriter/arch/x86_64/kprobe_xol.py, arch_prepare_kprobe() at rewrite time): which
instructions are emulated, boosted or single-stepped, the emulation descriptors'
fields, the slot's code (decoded back with capstone) and the descriptor hash.
Real instruction bytes assembled by gcc into a tiny static ELF: milliseconds."""
from __future__ import annotations

import subprocess

import capstone
import pytest

from conftest import CC
from rewriter.arch.base import BOOST, EMULATE, SINGLESTEP
from rewriter.arch.x86_64 import kprobe_xol as K
from rewriter.elf.image import Image

ARCHES = ["x86_64"]      # x86-64 only: x86-64's out-of-line plan (rewriter/arch/x86_64/kprobe_xol.py)

# struct pt_regs of arch/x86/include/asm/ptrace.h, word by word (what kp_int3.c indexes).
PT_REGS = ["r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx", "rsi", "rdi"]

CODE = """
.intel_syntax noprefix
.text
.globl _start
_start: ud2
.globl f
.type f, @function
f:
L_call:   call g
L_jmp8:   jmp g
L_jmp32:  jmp away
L_je:     je g
L_jne:    jne f
L_mov:    mov rax, rbx
L_riprel: mov rax, qword ptr [rip + data]
L_fld:    fld st(0)
L_cpuid:  cpuid
L_cs:     cs nop
L_jmpreg: jmp rax
L_callr:  call r12
L_loop:   loop f
L_jcxz:   jecxz f
L_retimm: ret 8
L_ret:    ret
L_jmpmem: jmp qword ptr [rip + data]
L_callm:  call qword ptr [rbx + rcx*8 + 16]
L_fsmem:  jmp qword ptr fs:[rax]
.size f, .-f
.p2align 4
g: ret
.space 300
away: ret
.data
data: .quad 7
"""


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    d = tmp_path_factory.mktemp("xol")
    (d / "x.s").write_text(CODE)
    r = subprocess.run([CC, "-nostdlib", "-static", "-no-pie", "-o", str(d / "x"),
                        str(d / "x.s")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["nm", str(d / "x")], capture_output=True, text=True, check=True)
    labels = {w[2]: int(w[0], 16) for w in (line.split() for line in r.stdout.splitlines()) if len(w) == 3}
    return Image(str(d / "x")), labels


def _md():
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    return md


def test_emulated_branches(image):
    """call/jmp/jcc rel, loop, jcxz and ret are emulated from the descriptor: kind, target
    (the branch's own), condition nibble, ret's immediate; no slot."""
    img, L = image
    want = {"L_call": (K.K_CALL, L["g"]), "L_jmp8": (K.K_JMP, L["g"]), "L_jmp32": (K.K_JMP, L["away"]),
            "L_je": (K.K_JCC, L["g"]), "L_jne": (K.K_JCC, L["f"]), "L_loop": (K.K_LOOP, L["f"]),
            "L_jcxz": (K.K_JCXZ, L["f"]), "L_ret": (K.K_RET, 0), "L_retimm": (K.K_RET, 0)}
    for label, (kind, target) in want.items():
        x = K.prepare(img, L[label])
        assert (x.mode, x.kind, x.target) == (EMULATE, kind, target), label
        assert x.insn.addr == L[label]
        assert x.next_ip == L[label] + len(x.insn.code)
    assert K.prepare(img, L["L_je"]).cc == 0x4 and K.prepare(img, L["L_jne"]).cc == 0x5
    assert K.prepare(img, L["L_loop"]).cc == 2                      # e2: loop (e0 loopne, e1 loope)
    assert K.prepare(img, L["L_jcxz"]).addr32 == 1                  # jecxz: 67 e3
    assert K.prepare(img, L["L_retimm"]).imm == 8 and K.prepare(img, L["L_ret"]).imm == 0


def test_emulated_indirect(image):
    """jmp/call through a register: the register's pt_regs word; through memory (which the
    kernel refuses): RIP-relative to its absolute slot, or base + index * scale + disp;
    a segment-relative operand is not emulated."""
    img, L = image
    x = K.prepare(img, L["L_jmpreg"])
    assert (x.mode, x.kind, PT_REGS[x.reg]) == (EMULATE, K.K_JMP_REG, "rax")
    x = K.prepare(img, L["L_callr"])
    assert (x.mode, x.kind, PT_REGS[x.reg]) == (EMULATE, K.K_CALL_REG, "r12")
    x = K.prepare(img, L["L_jmpmem"])
    assert (x.mode, x.kind, x.rip, x.target, x.reg) == (EMULATE, K.K_JMP_MEM, 1, L["data"], K.NO_REG)
    x = K.prepare(img, L["L_callm"])
    assert (x.mode, x.kind, x.rip, x.target) == (EMULATE, K.K_CALL_MEM, 0, 16)
    assert (PT_REGS[x.reg], PT_REGS[x.index], x.scale) == ("rbx", "rcx", 8)
    assert K.emulates_refused(img, L["L_callm"]) and K.emulates_refused(img, L["L_jmpmem"])
    assert not K.emulates_refused(img, L["L_fsmem"]) and not K.emulates_refused(img, L["L_mov"])
    assert K.prepare(img, L["L_fsmem"]).mode != EMULATE


def test_boost_and_single_step(image):
    """can_boost(): a plain or RIP-relative mov is boosted; an x87 escape, a two-byte
    opcode outside twobyte_is_boostable[] and a cs prefix are single-stepped (with an
    int3 after the copy where the target asks)."""
    img, L = image
    for label in ("L_mov", "L_riprel"):
        assert K.prepare(img, L[label]).mode == BOOST, label
    for label in ("L_fld", "L_cpuid", "L_cs"):
        x = K.prepare(img, L[label])
        assert x.mode == SINGLESTEP and not x.ss_breakpoint and x.insn.info.boost_reason, label
    assert K.prepare(img, L["L_cpuid"], ss_breakpoint=True).ss_breakpoint


def _decode(code: bytes, at: int):
    out = list(_md().disasm(code, at))
    return out


@pytest.mark.parametrize("label,with_post,ss_breakpoint", [("L_mov", False, False), ("L_riprel", False, False),
                                                     ("L_riprel", True, False), ("L_fld", False, False),
                                                     ("L_cpuid", False, True)])
def test_slot_code_round_trip(image, label, with_post, ss_breakpoint):
    """The slot decodes to: the copy (a RIP-relative operand still reaching the same
    address), the post stub (a boosted site with a post_handler), an int3 (a kernel's
    single-step), and the jmp back to the next instruction; place_slot() sizes it and
    finds its jmp back and the copy's end."""
    img, L = image
    x = K.prepare(img, L[label], ss_breakpoint=ss_breakpoint)
    at = L["f"] + 0x200000                       # far from the original: displacements change
    slot = K.place_slot(x, 7, with_post, at, desc=3)
    size = slot.size
    code = K.slot_code(x, 7, with_post, at, at + 0x5000, slot.desc)
    assert len(code) == size == len(K.slot_code(x, 7, with_post, at, at + 0x123456, 3))
    assert slot.addr == at and slot.desc == 3
    insns = _decode(code, at)
    orig = _decode(x.insn.code, x.insn.addr)[0]
    copy = insns[0]
    assert copy.mnemonic == orig.mnemonic
    if x.insn.info.rip_relative:
        assert copy.bytes != orig.bytes
        eff = lambda ci: ci.address + ci.size + next(o.mem.disp for o in ci.operands if o.type == capstone.x86.X86_OP_MEM)
        assert eff(copy) == eff(orig) == L["data"]
    else:
        assert copy.bytes == orig.bytes
    rest = insns[1:]
    if x.mode == SINGLESTEP:
        assert slot.ss_end == at + copy.size
    if ss_breakpoint:
        assert rest[0].mnemonic == "int3"
        rest = rest[1:]
        assert code[-4:] == (3).to_bytes(4, "little")      # the descriptor's index, after the jmp back
    if with_post:
        assert [i.mnemonic for i in rest[:4]] == ["lea", "push", "call", "lea"]
        assert rest[1].op_str == "7" and int(rest[2].op_str, 16) == at + 0x5000
        rest = rest[4:]
    back = rest[0]
    assert back.mnemonic == "jmp" and int(back.op_str, 16) == x.next_ip
    assert back.address == slot.post
    assert back.address + back.size == at + size - (K.SS_INDEX_SIZE if ss_breakpoint else 0)


def test_int3_hash_finds_every_descriptor():
    """The descriptor hash (kp_breakpoint.h's kp_breakpoint_lookup()): at most half full, each
    address found by linear probing from hash_64(addr, bits)."""
    from rewriter.emit import breakpoints as B
    addrs = [0x401000 + 7 * i for i in range(37)] + [0xffffffff81000000 + 5 * i for i in range(20)]
    bits, slots = B.descriptor_hash(addrs)
    assert len(slots) == 1 << bits and 2 * len(addrs) <= len(slots) < 4 * len(addrs)
    assert sorted(s for s in slots if s != B.HASH_EMPTY) == list(range(len(addrs)))
    for i, a in enumerate(addrs):
        h = ((a * B.GOLDEN_RATIO_64) % 2**64) >> (64 - bits)
        while slots[h] != i:
            assert slots[h] != B.HASH_EMPTY, f"{a:#x} not found"
            h = (h + 1) % len(slots)
