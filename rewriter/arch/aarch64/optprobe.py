"""Which AArch64 instructions may be probed and which jump-optimized: the
kernel's arch_prepare_kprobe() checks (decode-insn.c's arm_kprobe_decode_insn()
and is_probed_address_atomic()), and the checks of a detour reached by one `B`.

Every instruction is 4 bytes and so is the `B`: the detoured code region is the
probed instruction alone.  No other instruction lies under the jump, so no jump
can land inside the region (x86's jump target prohibition region is empty
here), and nothing is left for a short jump or an evicted neighbour."""
from __future__ import annotations

import capstone

from ..base import DcrInsn, Refusal
from . import bti, reach
from . import insn as I
from ... import safety

SHORT_JUMP_SIZE = None          # the B is as small as an instruction


def _word(image, addr: int) -> int:
    return int.from_bytes(image.read(addr, 4), "little")


def adjust_kprobe_addr(image, sym_addr: int, offset: int) -> int:
    """arch_adjust_kprobe_addr(): a function entry past its BTI landing pad
    (`bti c`/`bti jc`), which an indirect call must find there under BTI."""
    if offset == 0:
        try:
            w = _word(image, sym_addr)
        except (ValueError, IndexError):
            return sym_addr
        if w in (0xD503245F, 0xD50324DF):          # bti c, bti jc
            return sym_addr + 4
    return sym_addr + offset


def can_probe_insn(image, addr: int) -> Refusal | None:
    """arm_kprobe_decode_insn() refusals, and is_probed_address_atomic()."""
    if addr & 3:
        return Refusal("can_probe", addr, "not 4-byte aligned (AArch64 instructions are)")
    try:
        w = _word(image, addr)
    except (ValueError, IndexError):
        return Refusal("can_probe", addr, "not readable")
    info = I.classify(w, addr)
    if info.refused:
        return Refusal("can_probe", addr, f"the kernel does not probe {info.refused}")
    f = image.function_at(addr)
    if f is not None:
        at = I.atomic_sequence(lambda a: _word(image, a), addr, f.start)
        if at is not None and safety.enabled("exclusive_monitor"):
            return Refusal("can_probe", addr, f"inside an exclusive sequence (the ldxr at {at:#x}): "
                                              "a trap or detour would clear the exclusive monitor")
    return None


def can_optimize(image, analysis, func, addr: int, min_end: int | None = None,
                 jump_size: int = 4) -> list[DcrInsn] | Refusal:
    """The detoured code region at addr: its one instruction, relocated by emit.relocate()."""
    if min_end is not None and min_end > addr + 4:
        return Refusal("func_size", addr, "a region is one instruction on aarch64")
    if addr + 4 > func.end:
        return Refusal("func_size", addr, f"the jump at {addr:#x} would cross the end of {func.name}")
    r = can_probe_insn(image, addr) or reach.refusal(image, addr)
    if r is not None:
        return r
    w = image.read(addr, 4)
    pad = bti.landing_pad(int.from_bytes(w, "little"))
    if pad is not None and bti.guarded(image) and safety.enabled("landing_pad"):
        # Under BTI an indirect branch must find the pad here; a B would not be one.
        return Refusal("landing_pad", addr, f"a BTI landing pad ({pad}) in a BTI-guarded image: "
                                            "an indirect branch to it would fault on a B")
    return [DcrInsn(addr, bytes(w), I.classify(w, addr))]


def short_jump_slot(image, analysis, addr: int, busy) -> int | None:
    return None


def evict_candidates(image, analysis, addr: int):
    return []


def can_evict(image, analysis, func, n0: int) -> list[DcrInsn] | Refusal:
    return Refusal("evict", n0, "no eviction on aarch64 (a region is one instruction)")


def stack_aligned_at(image, func, addr: int) -> bool:
    """AAPCS64: sp is 16-byte aligned at every instruction that uses it (Linux
    checks it for user code), so always."""
    return True


# Functions entered with a convention of their own, where x16/x17 are not free:
# ld.so's lazy binding (PLT0 passes the GOT slot in x16) and TLS descriptors (their
# callers keep every register but x0, x30 and NZCV across the call: GCC's tlsdesc
# patterns).
_OWN_CONVENTION = ("_dl_runtime_resolve", "_dl_runtime_profile", "_dl_tlsdesc_")


def red_zone_free_at(image, func, addr: int) -> bool:
    """AAPCS64 has no red zone (nothing may live below sp); what it leaves free at a
    function's entry is IP0/IP1, x16 and x17: a linker's veneer or a PLT entry may
    write them between any call and its target, so no caller keeps a value in them
    across a call (GCC names them in every call's clobbers, with -fipa-ra too) and no
    function reads them before writing them.  So at a function's entry (its first
    instruction, or the one after its `bti c`/`bti jc`), not in a part entered
    mid-frame (a stripped cold part: its FDE) nor in a function of another
    convention (_OWN_CONVENTION) nor in one that reads x16/x17 before writing them
    (hand-written assembly), a template uses them without saving them.  Anywhere
    else they may hold the function's values."""
    if not safety.enabled("red_zone"):
        return True
    if func is None or func.name == "_start" or ".cold" in func.name or func.name.startswith(_OWN_CONVENTION):
        return False
    w = int.from_bytes(image.read(func.start, 4), "little")
    if addr != func.start and not (addr == func.start + 4 and w in (0xD503245F, 0xD50324DF)):
        return False
    from .retprobe import _mid_frame
    return _mid_frame(image, func.start) is None and not _reads_ip(image, func, addr)


def _reads_ip(image, func, addr: int, limit: int = 16) -> bool:
    """Whether the straight-line code from addr reads x16 or x17 before writing it
    (up to its first branch, or limit instructions)."""
    from .retprobe import _cs, _A
    ip = {_A.ARM64_REG_X16: 16, _A.ARM64_REG_W16: 16, _A.ARM64_REG_X17: 17, _A.ARM64_REG_W17: 17}
    written = set()
    end = min(func.end, addr + 4 * limit)
    for ci in _cs.disasm(image.read(addr, end - addr), addr):
        read, write = ci.regs_access()
        if any(ip[r] not in written for r in read if r in ip):
            return True
        written |= {ip[r] for r in write if r in ip}
        if ci.group(capstone.CS_GRP_JUMP) or ci.group(capstone.CS_GRP_CALL) or ci.group(capstone.CS_GRP_RET):
            break
    return False


def arith_flags_dead(image, func, addr: int, limit: int = 32) -> bool:
    """Not read yet: NZCV is taken as live (the detours restore it with msr)."""
    return False
