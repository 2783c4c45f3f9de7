"""Code emission for x86-64: detour buffers, the jump at the probe, start-up stubs.

The per-probe stub and start-up stubs are assembled with Keystone; copied
instructions are relocated byte-wise as the kernel's __copy_instruction() does
(RIP-relative displacement adjusted; relative branches re-encoded with rel32)."""
from __future__ import annotations

import struct

import capstone
from keystone import KS_ARCH_X86, KS_MODE_64, Ks

from .optprobe import DcrInsn

_ks = Ks(KS_ARCH_X86, KS_MODE_64)
_cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
_cs.detail = True

RED_ZONE = 128


class EmitError(Exception):
    pass


def asm(text: str, addr: int) -> bytes:
    enc, _ = _ks.asm(text, addr)
    return bytes(enc or b"")


def _s32(v: int, what: str) -> bytes:
    if not -(1 << 31) <= v < (1 << 31):
        raise EmitError(f"{what}: displacement {v:#x} does not fit in 32 bits")
    return struct.pack("<i", v)


def relocate(insn: DcrInsn, new: int) -> bytes:
    """One DCR instruction copied to `new`."""
    info = insn.info
    if info.emulate == "jmp rel":
        return b"\xe9" + _s32(info.rel_target - (new + 5), "jmp")
    if info.emulate == "jcc rel":
        op = insn.code[0] if insn.code[0] != 0x0F else insn.code[1]
        cc = op & 0x0F
        return bytes([0x0F, 0x80 | cc]) + _s32(info.rel_target - (new + 6), "jcc")
    if info.emulate == "call rel":
        # A call pushes the original return address, so returns, unwinding and
        # __builtin_return_address() see the program's own code, not the detour.
        ret = insn.addr + len(insn.code)
        head = asm("lea rsp, [rsp-8]; push rax", new)
        lea_at = new + len(head)
        lea = b"\x48\x8d\x05" + _s32(ret - (lea_at + 7), "call")
        tail = asm("mov [rsp+8], rax; pop rax", lea_at + 7)
        jmp_at = lea_at + 7 + len(tail)
        return head + lea + tail + b"\xe9" + _s32(info.rel_target - (jmp_at + 5), "call")
    if info.rip_relative:
        ci = next(_cs.disasm(insn.code, insn.addr, 1))
        off = ci.disp_offset
        disp = struct.unpack_from("<i", insn.code, off)[0]
        new_disp = disp + insn.addr - new
        return insn.code[:off] + _s32(new_disp, f"RIP-relative operand at {insn.addr:#x}") + insn.code[off + 4:]
    return insn.code


def relocated_size(insn: DcrInsn) -> int:
    return len(relocate(insn, insn.addr + 0x10000000))


def probe_stub(site: int, entry: int, at: int) -> bytes:
    """lea -128(%rsp),%rsp; push $site; call entry; lea 136(%rsp),%rsp"""
    return asm(f"lea rsp, [rsp-{RED_ZONE:#x}]; push {site:#x}; call {entry:#x}; "
               f"lea rsp, [rsp+{RED_ZONE + 8:#x}]", at)


def detour(site: int, dcr: list[DcrInsn], with_post: bool, at: int,
           entry: int, post_entry: int) -> tuple[bytes, int, int]:
    """The detour buffer of one site.  Returns (code, resume, resume_post): where
    the DCR copy starts and where the part after the post_handler starts."""
    out = bytearray(probe_stub(site, entry, at))
    resume = at + len(out)
    resume_post = resume
    for i, insn in enumerate(dcr):
        out += relocate(insn, at + len(out))
        if i == 0 and with_post:
            out += probe_stub(site, post_entry, at + len(out))
            resume_post = at + len(out)
    back = dcr[-1].addr + len(dcr[-1].code)
    pos = at + len(out)
    out += b"\xe9" + _s32(back - (pos + 5), "jmp back")
    return bytes(out), resume, resume_post


def detour_size(site: int, dcr: list[DcrInsn], with_post: bool) -> int:
    far = dcr[0].addr + 0x10000000
    return len(detour(site, dcr, with_post, far, far + 0x100000, far + 0x100000)[0])


def jump_patch(addr: int, region_len: int, target: int) -> bytes:
    """The optimized probe itself: jmp rel32 to the detour; the rest of the DCR
    becomes int3 so a stray jump into it traps loudly."""
    return b"\xe9" + _s32(target - (addr + 5), "jmp to detour") + b"\xcc" * (region_len - 5)


def entry_stub(at: int, start_fn: int, orig_entry: int) -> bytes:
    """New e_entry of an executable: call kp_user_start(sp, rdx) before the
    program's entry, pass its result on in %rdx (the ELF ABI's exit function)."""
    return asm(f"mov rbx, rsp; mov rdi, rsp; mov rsi, rdx; and rsp, -16; call {start_fn:#x}; "
               f"mov rsp, rbx; mov rdx, rax; xor ebx, ebx; jmp {orig_entry:#x}", at)


def chain_stub(at: int, fn: int, then: int) -> bytes:
    """An init/fini function for a shared object: call fn(argc, argv, envp) and
    go on to the function the slot held before."""
    return asm(f"push rdi; push rsi; push rdx; call {fn:#x}; pop rdx; pop rsi; pop rdi; jmp {then:#x}", at)


def ret_stub(at: int, fn: int) -> bytes:
    """An init/fini function where the slot held nothing to chain to."""
    return asm(f"push rdi; push rsi; push rdx; call {fn:#x}; pop rdx; pop rsi; pop rdi; ret", at)


# -- The clean-call optprobe template -------------------------------------------
#
# Layouts the template reads directly; kprewrite's generated probe table
# asserts them (_Static_assert) so a change in the C structures fails the build.
KPROBE_SIZE = 72             # sizeof(struct kprobe)
KPROBE_FLAGS = 48            # offsetof(struct kprobe, flags)
THREAD_ACTIVE = 16           # offsetof(struct kp_thread, active)
THREAD_HITS = 24             # offsetof(struct kp_thread, hits)
THREAD_TABLE_MASK = 8191     # KP_TABLE_SIZE - 1; KP_HASH(key) = key >> 12 & mask
CLEAN_FRAME = RED_ZONE + 88  # red zone + rax rcx rdx rsi rdi r8-r11, flags, the thread block
_SCRATCH = ("rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11")


def _rip(text: str, at: int, target: int) -> bytes:
    """One instruction with a [rip + X] operand reaching `target` (text holds {d})."""
    size = len(asm(text.format(d=0x12345678), at))
    code = asm(text.format(d=target - (at + size)), at)
    assert len(code) == size
    return code


def clean_detour(site: int, dcr: list[DcrInsn], at: int, *, fast: int, table: int, probe: int,
                 probe_index: int, handler: int | None, callback: int,
                 flags_live: bool, aligned: bool) -> tuple[bytes, int]:
    """The detour of a site with one probe whose handler never reads pt_regs:
    arch/x86/kernel/kprobes/opt.c's optprobe_template with the dispatch of the
    common case inlined (kprobes armed, the thread known, no handler running,
    probe enabled: count the hit, mark the thread, call the pre_handler).
    Anything else calls the generic clean callback.  Only the registers a C call
    clobbers are saved, the arithmetic flags only where they are live, and the
    stack is realigned only where its alignment is not fixed by the ABI.
    Returns (code, resume): where the relocated DCR starts."""
    out = bytearray()

    def a(text: str):
        out.extend(asm(text, at + len(out)))

    def r(text: str, target: int):
        out.extend(_rip(text, at + len(out), target))

    frame = CLEAN_FRAME
    a(f"lea rsp, [rsp - {frame:#x}]")
    a("mov qword ptr [rsp], rax")
    if flags_live:
        a("seto al; lahf; mov word ptr [rsp + 72], ax")
    for i, reg in enumerate(_SCRATCH[1:], 1):
        a(f"mov qword ptr [rsp + {8 * i}], {reg}")
    r("cmp dword ptr [rip + {d}], 0", fast)
    jumps_to_slow = [len(out)]
    out += b"\x0f\x84\0\0\0\0"                              # je slow
    out += b"\x64\x48\x8b\x3c\x25\0\0\0\0"                # mov %fs:0,%rdi: the thread pointer (linux_user)
    a(f"mov rax, rdi; shr rax, 12; and eax, {THREAD_TABLE_MASK:#x}")
    r("lea rdx, [rip + {d}]", table)
    a("mov rdx, qword ptr [rdx + rax*8]; cmp rdi, qword ptr [rdx]")
    jumps_to_slow.append(len(out))
    out += b"\x0f\x85\0\0\0\0"                              # jne slow: thread not seen yet
    a(f"cmp dword ptr [rdx + {THREAD_ACTIVE}], 0")
    jumps_to_slow.append(len(out))
    out += b"\x0f\x85\0\0\0\0"                              # jne slow: nmissed
    r("test byte ptr [rip + {d}], 3", probe + KPROBE_FLAGS)   # KPROBE_FLAG_GONE|DISABLED
    jumps_to_restore = [len(out)]
    out += b"\x0f\x85\0\0\0\0"                              # jne restore: disabled, silent
    a(f"inc qword ptr [rdx + {THREAD_HITS + 8 * probe_index}]")
    if handler is not None:
        a(f"mov dword ptr [rdx + {THREAD_ACTIVE}], 1")
        if aligned:
            a("mov qword ptr [rsp + 80], rdx")
        else:
            a("mov rcx, rsp; and rsp, -16; sub rsp, 16; mov qword ptr [rsp + 8], rcx; mov qword ptr [rsp], rdx")
        r("lea rdi, [rip + {d}]", probe)
        a("xor esi, esi")
        a(f"call {handler:#x}")
        a("mov rdx, qword ptr [rsp + 80]" if aligned else "mov rdx, qword ptr [rsp]; mov rsp, qword ptr [rsp + 8]")
        a(f"mov dword ptr [rdx + {THREAD_ACTIVE}], 0")
    restore = len(out)
    if flags_live:
        a("movzx eax, word ptr [rsp + 72]; add al, 0x7f; sahf")
    for i, reg in enumerate(_SCRATCH):
        a(f"mov {reg}, qword ptr [rsp + {8 * i}]")
    a(f"lea rsp, [rsp + {frame:#x}]")
    resume = at + len(out)
    for insn in dcr:
        out += relocate(insn, at + len(out))
    back = dcr[-1].addr + len(dcr[-1].code)
    out += b"\xe9" + _s32(back - (at + len(out) + 5), "jmp back")
    slow = len(out)
    a(f"mov edi, {site:#x}")
    if aligned:
        a(f"call {callback:#x}")
    else:
        a(f"mov rcx, rsp; and rsp, -16; sub rsp, 16; mov qword ptr [rsp + 8], rcx; call {callback:#x}; "
          "mov rsp, qword ptr [rsp + 8]")
    out += b"\xe9" + _s32(restore - (len(out) + 5), "jmp restore")
    for j in jumps_to_slow:
        out[j + 2:j + 6] = _s32(slow - (j + 6), "je slow")
    for j in jumps_to_restore:
        out[j + 2:j + 6] = _s32(restore - (j + 6), "jne restore")
    return bytes(out), resume
