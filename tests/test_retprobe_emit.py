"""Unit tests of the x86-64 return-probe emitters (rewriter/arch/x86_64/retprobe.py):
the code each writes decodes with capstone, reaches what it names, and ends as
the exit it replaces: hook_then_exit() (a jump to the hook's returning variant for
a plain ret, else call hook + the exit), ret_detour() (the region's copy, then the
hook and the exit), hook_copy(), and kret_entry_body() (pre_handler_kretprobe()
inlined).  Pure code generation at fixed addresses: milliseconds."""
from __future__ import annotations

import capstone
import pytest

from rewriter.arch.base import DcrInsn
from rewriter.arch.x86_64 import emit as em
from rewriter.arch.x86_64 import insn as x86insn
from rewriter.arch.x86_64 import retprobe as rp

ARCHES = ["x86_64"]      # x86-64 only: x86-64's return-probe emitters (rewriter/arch/x86_64/retprobe.py)

AT = 0x7000_0000          # where the emitted code goes
SITE = 0x40_1000          # the original code
HOOK, JMP_HOOK = 0x7100_0000, 0x7100_0040


def _insn(code: bytes, addr: int) -> DcrInsn:
    info = x86insn.classify(code, addr)
    assert info.length == len(code)
    return DcrInsn(addr, code, info)


def _dis(code: bytes, at: int):
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    out = list(md.disasm(code, at))
    assert sum(i.size for i in out) == len(code), "does not decode to its end"
    return out


def _target(ci) -> int:
    return int(ci.op_str, 16)


RET = _insn(b"\xc3", SITE)
REPZ_RET = _insn(b"\xf3\xc3", SITE)
RET_IMM = _insn(b"\xc2\x08\x00", SITE)
TAIL = _insn(b"\xe9\xfb\x0f\x00\x00", SITE)            # jmp SITE + 0x1000


def test_plain_ret_jumps_to_the_returning_hook():
    """A plain ret (also repz ret) with a returning variant: one jmp to it, nothing after."""
    for ret in (RET, REPZ_RET):
        code = rp.hook_then_exit(ret, (HOOK, JMP_HOOK), AT)
        (j,) = _dis(code, AT)
        assert j.mnemonic == "jmp" and _target(j) == JMP_HOOK


@pytest.mark.parametrize("exit_,last", [(RET, "ret"), (RET_IMM, "ret"), (TAIL, "jmp")])
def test_call_then_exit(exit_, last):
    """No returning variant, a ret imm16 or a tail jmp: call hook, then the exit itself
    (a tail jmp re-encoded to reach its own target from the copy)."""
    for hook in ((HOOK, None), (HOOK, JMP_HOOK)):
        if exit_ is RET and hook[1] is not None:
            continue
        code = rp.hook_then_exit(exit_, hook, AT)
        call, ex = _dis(code, AT)
        assert call.mnemonic == "call" and _target(call) == HOOK
        assert ex.mnemonic == last
        if exit_ is TAIL:
            assert _target(ex) == exit_.info.rel_target == SITE + 0x1000
        else:
            assert ex.bytes == exit_.code


def test_callable_hook_inlines():
    """A hook given as a function (clean_ret_hook) writes the whole exit."""
    assert rp.hook_then_exit(RET, lambda e, at: b"\x90" * (at - AT + 1) + e.code, AT + 2) == b"\x90\x90\x90\xc3"


def test_ret_detour_copies_the_region_then_hooks():
    """pop rbx; mov rax,[rip+x]; pop rbp; ret moved to the detour: the copies (the
    RIP-relative one still reaching x), then the jmp to the returning hook."""
    a = SITE
    dcr = [_insn(b"\x5b", a), _insn(b"\x48\x8b\x05\x10\x20\x00\x00", a + 1), _insn(b"\x5d", a + 8),
           _insn(b"\xc3", a + 9)]
    x = a + 1 + 7 + 0x2010
    code = rp.ret_detour(dcr, (HOOK, JMP_HOOK), AT)
    ins = _dis(code, AT)
    assert [i.mnemonic for i in ins] == ["pop", "mov", "pop", "jmp"]
    assert ins[1].address + ins[1].size + ins[1].operands[1].mem.disp == x
    assert _target(ins[-1]) == JMP_HOOK
    code = rp.ret_detour(dcr, (HOOK, None), AT)
    assert [i.mnemonic for i in _dis(code, AT)] == ["pop", "mov", "pop", "call", "ret"]


def test_hook_copy_hooks_only_exits():
    """In a detour whose region holds a return-probed exit, only that exit calls its hook."""
    copy = rp.hook_copy({SITE: (HOOK, None)})
    other = _insn(b"\x5b", SITE - 1)
    assert copy(other, AT) == b"\x5b"
    call, ret = _dis(copy(RET, AT), AT)
    assert call.mnemonic == "call" and _target(call) == HOOK and ret.mnemonic == "ret"


RP, TRAMP, ENTRY_H, ENTER_C = 0x7200_0000, 0x7200_1000, 0x7200_2000, 0x7200_3000


def _body(regs: bool, inline: bool = True, entry_handler=ENTRY_H, aligned=True):
    c = em._Code(AT)
    body = rp.kret_entry_body(rp=RP, tramp=TRAMP, entry_handler=entry_handler, enter_c=ENTER_C,
                              aligned=aligned, inline=inline, regs=regs)
    if regs:
        body(c)
    else:
        slot = {r: 8 * i for i, r in enumerate(("rcx", "rsi", "r8"))}
        body(c, ("rcx",), slot)
    return bytes(c.out)


def _rip_refs(ins):
    return {i.address + i.size + op.mem.disp for i in ins for op in i.operands
            if op.type == capstone.x86.X86_OP_MEM and op.mem.base == capstone.x86.X86_REG_RIP}


@pytest.mark.parametrize("regs", [False, True])
def test_kret_entry_body(regs):
    """The inlined entry decodes whole; it claims an instance with lock cmpxchg, calls
    the entry_handler and (on the slow path) kp_kretprobe_enter, reads the kretprobe's
    fields and the trampoline RIP-relative, every jump lands on one of its own
    instructions or at its end, and it ends as its caller expects: the thread block
    marked idle (clean form) or eax = 0 (pre_handler_kretprobe()'s return, full form)."""
    code = _body(regs)
    ins = _dis(code, AT)
    end = AT + len(code)
    starts = {i.address for i in ins} | {end}
    assert any(i.mnemonic == "lock cmpxchg" or (i.mnemonic == "cmpxchg" and i.prefix[0] == 0xF0) for i in ins)
    calls = [_target(i) for i in ins if i.mnemonic == "call"]
    assert calls == [ENTRY_H, ENTER_C]
    for i in ins:
        if i.group(capstone.CS_GRP_JUMP):
            assert _target(i) in starts and AT < _target(i) <= end, (i.mnemonic, i.op_str)
    refs = _rip_refs(ins)
    assert {RP, TRAMP, RP + em.RP_HINT, RP + em.RP_MAXACTIVE, RP + em.RP_STRIDE, RP + em.RP_POOL} <= refs
    last = ins[-1]
    if regs:
        assert (last.mnemonic, last.op_str) == ("xor", "eax, eax")
        assert any(i.mnemonic == "mov" and i.op_str == "rsi, rbx" for i in ins)     # regs to the entry_handler
    else:
        assert last.mnemonic == "mov" and last.op_str == f"dword ptr [rdx + {em.THREAD_ACTIVE:#x}], 0"
        assert any(i.mnemonic == "xor" and i.op_str == "esi, esi" for i in ins)      # no regs
        # The slow path saves what the fast path did not (here rcx) around the C call.
        saves = [i for i in ins if i.mnemonic == "mov" and i.op_str == "qword ptr [rsp], rcx"]
        assert len(saves) == 1


def test_kret_entry_body_not_inline():
    """inline=False (a kretprobe whose returns use the trampoline): straight to the C call."""
    ins = _dis(_body(False, inline=False, entry_handler=None), AT)
    assert ins[1].mnemonic == "jmp"
    slow = _target(ins[1])
    after = [i for i in ins if i.address >= slow]
    assert [_target(i) for i in after if i.mnemonic == "call"] == [ENTER_C]
    assert not any(i.mnemonic == "call" for i in ins if i.address < slow)


def test_kret_entry_body_realigns_when_asked():
    """aligned=False: each call realigns the stack and restores it after."""
    ins = _dis(_body(False, aligned=False), AT)
    text = [(i.mnemonic, i.op_str) for i in ins]
    assert text.count(("and", "rsp, 0xfffffffffffffff0")) == 2
    assert text.count(("mov", "rsp, qword ptr [rsp + 8]")) == 2
