"""The system calls of an image that set a signal mask or a signal's action
(rt_sigprocmask, rt_sigaction), as a C library's code makes them: `mov $NR, %eax`,
up to three instructions that set the arguments (no branch, %eax and %rsp left
alone), then `syscall`; and the syscall(2) wrapper's, whose number is known at run
time only.  A rewritten image with breakpoint probes sends them to
the runtime (linux_user: kp_signal_syscall()), which keeps SIGTRAP unblocked and
the SIGTRAP handler its own (a blocked SIGTRAP raised by an int3 makes the kernel
kill the process: glibc's pthread_create() and posix_spawn() block every signal
with a raw system call)."""
from __future__ import annotations

import re

import capstone

from ..base import DcrInsn, SignalSyscall
from . import cs
from .insn import classify

NRS = {13: "rt_sigaction", 14: "rt_sigprocmask"}
_MOV = re.compile(rb"\xb8[\x0d\x0e]\x00\x00\x00")
_SYSCALL = b"\x0f\x05"
_RAX = {capstone.x86_const.X86_REG_RAX, capstone.x86_const.X86_REG_EAX, capstone.x86_const.X86_REG_AX,
        capstone.x86_const.X86_REG_AL, capstone.x86_const.X86_REG_AH}
_RSP = {capstone.x86_const.X86_REG_RSP, capstone.x86_const.X86_REG_ESP, capstone.x86_const.X86_REG_SP}


def signal_syscalls(image, analysis) -> list[SignalSyscall]:
    """Every such sequence at instruction boundaries of a decoded function with no
    jump target after its first byte, and the C library's syscall(2) wrapper (the
    number in a register: nr 0, the stub tests it at run time), by address."""
    out = []
    for lo, hi in image.exec_ranges:
        code = image.read(lo, hi - lo)
        for m in _MOV.finditer(code):
            sc = _sequence(image, analysis, code, lo, m.start())
            if sc is not None:
                out.append(sc)
    for f in image.functions:
        if "syscall" in [f.name] + list(f.aliases):
            sc = _wrapper(image, analysis, f)
            if sc is not None:
                out.append(sc)
    return sorted(out, key=lambda sc: sc.addr)


def _wrapper(image, analysis, f) -> SignalSyscall | None:
    """syscall(2): straight-line code whose `syscall` the shortest run of instructions
    before it (5 bytes at least: the jump) leads to, with no jump target inside."""
    code = image.read(f.start, f.end - f.start)
    pos, insns = 0, []
    for ci in cs.DETAIL.disasm(code, f.start):
        b = bytes(code[pos:pos + ci.size])
        if b == _SYSCALL:
            window, size = [], 0
            for insn in reversed(insns):
                window.insert(0, insn)
                size += len(insn.code)
                if size >= 5:
                    break
            if size < 5 or any(i.info.emulate is not None for i in window):
                return None
            start, end = window[0].addr, ci.address + 2
            if analysis.targets_in(start + 1, end):
                return None
            return SignalSyscall(start, end, 0, tuple(window) + (DcrInsn(ci.address, b, classify(b, ci.address)),))
        groups = set(ci.groups)
        _, written = ci.regs_access()
        if groups & {capstone.CS_GRP_JUMP, capstone.CS_GRP_CALL, capstone.CS_GRP_RET, capstone.CS_GRP_INT} \
                or set(written) & _RSP or ci.mnemonic in ("push", "pop", "enter", "leave"):
            insns = []          # a window never spans these
        else:
            insns.append(DcrInsn(ci.address, b, classify(b, ci.address)))
        pos += ci.size
    return None


def _sequence(image, analysis, code: bytes, base: int, off: int) -> SignalSyscall | None:
    addr = base + off
    f = image.function_at(addr)
    if f is None or not analysis.is_boundary(f, addr):
        return None
    insns = [DcrInsn(addr, code[off:off + 5], classify(code[off:off + 5], addr))]
    pos = off + 5
    for _ in range(4):
        if code[pos:pos + 2] == _SYSCALL:
            end = base + pos + 2
            if end > f.end or analysis.targets_in(addr + 1, end):
                return None
            insns.append(DcrInsn(base + pos, _SYSCALL, classify(_SYSCALL, base + pos)))
            return SignalSyscall(addr, end, code[off + 1], tuple(insns))
        ci = next(cs.DETAIL.disasm(code[pos:pos + 15], base + pos, 1), None)
        if ci is None or base + pos + ci.size > f.end:
            return None
        groups = set(ci.groups)
        if groups & {capstone.CS_GRP_JUMP, capstone.CS_GRP_CALL, capstone.CS_GRP_RET, capstone.CS_GRP_INT,
                     capstone.CS_GRP_IRET, capstone.x86_const.X86_GRP_PRIVILEGE}:
            return None
        _, written = ci.regs_access()
        if set(written) & (_RAX | _RSP) or ci.mnemonic in ("syscall", "push", "pop", "enter", "leave"):
            return None
        b = bytes(code[pos:pos + ci.size])
        info = classify(b, base + pos)
        if info.emulate is not None:
            return None
        insns.append(DcrInsn(base + pos, b, info))
        pos += ci.size
    return None
