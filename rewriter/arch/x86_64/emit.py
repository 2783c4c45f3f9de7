"""Code emission for x86-64: detour buffers, the jump at the probe, start-up stubs.

The per-probe stub and start-up stubs are assembled with Keystone; copied
instructions are relocated byte-wise as the kernel's __copy_instruction() does
(RIP-relative displacement adjusted; relative branches re-encoded with rel32)."""
from __future__ import annotations

import functools
import struct

from ...errors import KprewriteError
from ..base import DcrInsn, LinkSym
from . import cs
from . import offsets as O
from .insn import LEGACY_PREFIXES

_ks = None          # Keystone, made when first used (imported only by a run that assembles)
_cs = cs.DETAIL

RED_ZONE = 128


class EmitError(Exception):
    pass


def _link(target: int, field: int):
    """Log the rel32 at address `field` as reaching `target`, if target is a runtime
    symbol's placeholder (base.LinkSym: the layout's sizing build).  Every reference
    to a runtime symbol is such a rel32 (a call, a jmp, a RIP-relative operand)."""
    if type(target) is LinkSym:
        target.links.extend((field, target.name))


_I32 = struct.Struct("<i")                  # a rel32 or disp32
_unpack_i32, _pack_i32_into, _pack_i32 = _I32.unpack_from, _I32.pack_into, _I32.pack


def relink(buf: bytearray, base: int, links, sym, placeholder: int):
    """The code in buf (address a at buf[base + a]), built with every runtime symbol
    at `placeholder`, each logged rel32 (links: address, symbol, address, symbol...)
    moved to the symbol's address in sym (an R_X86_64_PC32 applied again): the bytes
    a build with sym gives."""
    it = iter(links)
    for field, name in zip(it, it):
        v = _unpack_i32(buf, base + field)[0] + sym[name] - placeholder
        if not -0x80000000 <= v < 0x80000000:
            raise KprewriteError(f"internal error: the rel32 at {field:#x} cannot reach {name}")
        _pack_i32_into(buf, base + field, v)


def _keystone():
    """A Keystone engine that reads decimal immediates as decimal.  Keystone 0.9.2 never
    initialises its MCAsmInfo::Radix (keystone-engine/keystone#528, #608): an engine made where
    freed heap memory held 16 lexes every decimal immediate as hex (`sub rsp, 16` as 0x16, the
    templates' 0x12345678 marker written in decimal as 0x305419896), so the same text assembled
    differently from one process to the next.  Each engine is asked once; one that reads "10"
    as 0x10 is kept (its memory not reused) while another is made."""
    from keystone import KS_ARCH_X86, KS_MODE_64, Ks
    wrong = []
    for _ in range(64):
        ks = Ks(KS_ARCH_X86, KS_MODE_64)
        if bytes(ks.asm("mov eax, 10", 0)[0]) == b"\xb8\x0a\x00\x00\x00":
            return ks
        wrong.append(ks)
    raise KprewriteError("internal error: every Keystone engine made reads decimal immediates as hex")


def asm(text: str, addr: int) -> bytes:
    global _ks
    if _ks is None:
        _ks = _keystone()
    enc, _ = _ks.asm(text, addr)
    return bytes(enc or b"")


def _s32(v: int, what: str) -> bytes:
    if not -(1 << 31) <= v < (1 << 31):
        raise EmitError(f"{what}: displacement {v:#x} does not fit in 32 bits")
    return _pack_i32(v)


def jcc_cc(code: bytes) -> int:
    """A jcc's condition (the low nibble of 70-7F, 0F 80-8F), past its prefixes (a branch
    hint 2E/3E, bnd F2: `3e 74 05` is a je, not the jle its first byte's nibble says)."""
    i = 0
    while code[i] in LEGACY_PREFIXES or 0x40 <= code[i] <= 0x4F:
        i += 1
    return (code[i + 1] if code[i] == 0x0F else code[i]) & 0x0F


def relocate(insn: DcrInsn, new: int) -> bytes:
    """One DCR instruction copied to `new`."""
    info = insn.info
    if info.emulate == "jmp rel":
        return b"\xe9" + _s32(info.rel_target - (new + 5), "jmp")
    if info.emulate == "jcc rel":
        return bytes([0x0F, 0x80 | jcc_cc(insn.code)]) + _s32(info.rel_target - (new + 6), "jcc")
    if info.emulate == "call rel":
        # A call pushes the original return address, so returns, unwinding and
        # __builtin_return_address() see the program's own code, not the detour.
        ret = insn.addr + len(insn.code)
        head = _asm_pi("lea rsp, [rsp-8]; push rax")
        lea_at = new + len(head)
        lea = b"\x48\x8d\x05" + _s32(ret - (lea_at + 7), "call")
        tail = _asm_pi("mov [rsp+8], rax; pop rax")
        jmp_at = lea_at + 7 + len(tail)
        return head + lea + tail + b"\xe9" + _s32(info.rel_target - (jmp_at + 5), "call")
    if info.emulate in ("call mem", "call reg"):
        # As a call rel: the original return address, then the same operand as a jmp
        # (ff /2 -> ff /4: ModRM reg field 010 -> 100; optprobe refused %rsp in it).
        ret = insn.addr + len(insn.code)
        head = _asm_pi("lea rsp, [rsp-8]; push rax")
        lea_at = new + len(head)
        lea = b"\x48\x8d\x05" + _s32(ret - (lea_at + 7), "call")
        tail = _asm_pi("mov [rsp+8], rax; pop rax")
        jmp_at = lea_at + 7 + len(tail)
        code = bytearray(insn.code)
        i = 0
        while code[i] != 0xFF:      # legacy prefixes and REX come first
            i += 1
        code[i + 1] ^= 0x30
        jmp = DcrInsn(insn.addr, bytes(code), info)
        return head + lea + tail + (_rip_moved(jmp, jmp_at) if info.rip_relative else jmp.code)
    if info.rip_relative:
        return _rip_moved(insn, new)
    return insn.code


@functools.lru_cache(maxsize=1 << 16)
def _disp_offset(code: bytes, addr: int) -> int:
    """Where an instruction's displacement lies in its bytes (Capstone's detail: each
    copy is laid out, then emitted, with the same bytes)."""
    return next(_cs.disasm(code, addr, 1)).disp_offset


def _rip_moved(insn: DcrInsn, new: int) -> bytes:
    """The instruction with its RIP-relative displacement re-encoded for `new`."""
    off = _disp_offset(insn.code, insn.addr)
    disp = struct.unpack_from("<i", insn.code, off)[0]
    new_disp = disp + insn.addr - new
    return insn.code[:off] + _s32(new_disp, f"RIP-relative operand at {insn.addr:#x}") + insn.code[off + 4:]


def probe_stub(site: int, entry: int, at: int) -> bytes:
    """lea -128(%rsp),%rsp; push $site; call entry; lea 136(%rsp),%rsp
    (kp_kretprobe_clean_entry, optprobe_entry.S, finds the stack pointer at the hit
    above SITE and these RED_ZONE bytes: keep the two in step)."""
    if 0 <= site < 0x80000000:      # Keystone's own bytes, but the push and the call: one per site
        down, up = _stub_leas()
        head = down + (bytes([0x6A, site]) if site < 0x80 else b"\x68" + struct.pack("<I", site))   # push imm8 / imm32
        rel = entry - (at + len(head) + 5)
        if -(1 << 31) <= rel < (1 << 31):
            _link(entry, at + len(head) + 1)
            return head + b"\xe8" + _pack_i32(rel) + up
    code = asm(f"lea rsp, [rsp-{RED_ZONE:#x}]; push {site:#x}; call {entry:#x}; "
               f"lea rsp, [rsp+{RED_ZONE + 8:#x}]", at)
    _link(entry, at + len(code) - len(_stub_leas()[1]) - 4)   # the call's rel32, before the last lea
    return code


@functools.lru_cache(maxsize=None)
def _stub_leas() -> tuple[bytes, bytes]:
    """probe_stub()'s lea over the red zone, and back over it and SITE."""
    return _asm_pi(f"lea rsp, [rsp-{RED_ZONE:#x}]"), _asm_pi(f"lea rsp, [rsp+{RED_ZONE + 8:#x}]")


def short_stub(site: int, entry: int, at: int) -> bytes:
    """push $site; call entry: a probe stub where nothing lives below %rsp (a kernel,
    built with -mno-red-zone), for the runtime's short entries (optprobe_entry.S,
    KP_SHORT_STUBS), which find the stack pointer at the hit right above SITE and
    return over it.  10 bytes (7 for a site below 128) against probe_stub()'s 23."""
    push = bytes([0x6A, site]) if site < 0x80 else b"\x68" + struct.pack("<I", site)   # push imm8 / imm32
    _link(entry, at + len(push) + 1)
    return push + b"\xe8" + _s32(entry - (at + len(push) + 5), "call")


def detour(site: int, dcr: list[DcrInsn], with_post: bool, at: int,
           entry: int, post_entry: int, copy=None, back: int | None = None,
           short: bool = False) -> tuple[bytes, int, int]:
    """The detour buffer of one site.  Returns (code, resume, resume_post): where
    the DCR copy starts and where the part after the post_handler starts.
    copy(insn, at): how to copy one DCR instruction (default: relocate).
    back: where the copy jumps (default: the end of dcr in the original code;
    in a shared region, the next probe's detour).
    short: short_stub()s to the runtime's short entries (a kernel); an ftrace site's
    nop is then not copied (the copy is the jump back, or the instructions after a
    shared site), so a taken site's detour is 15 bytes and fills one 16-byte slot."""
    from ..base import FtraceSiteInsn        # an ftrace site's DCR (ftrace_site_insn())
    copy = copy or relocate
    stub = short_stub if short else probe_stub
    if short and isinstance(dcr[0], FtraceSiteInsn):
        site_nop, each = dcr[0], copy
        copy = lambda insn, at: b"" if insn is site_nop else each(insn, at)  # noqa: E731
    out = bytearray(stub(site, entry, at))
    resume = at + len(out)
    resume_post = resume
    for i, insn in enumerate(dcr):
        out += copy(insn, at + len(out))
        if i == 0 and with_post:
            out += stub(site, post_entry, at + len(out))
            resume_post = at + len(out)
    back = back or dcr[-1].addr + len(dcr[-1].code)
    pos = at + len(out)
    out += b"\xe9" + _s32(back - (pos + 5), "jmp back")
    return bytes(out), resume, resume_post


def evicted_detour(dcr: list[DcrInsn], at: int) -> bytes:
    """An evicted region's detour (planner.EvictedRegion): its copy, as any
    detour's (relocate(): a call pushes the original return address, so
    returns and unwinding see the program's own code), and the jump back to its
    end.  No probe stub: it carries no kprobe."""
    c = _Code(at)
    _dcr_and_back(c, dcr)
    return bytes(c.out)


def evict_patch(addr: int, region_len: int, detour: int, probe_detour: int) -> bytes:
    """The evicted region's bytes: a jmp rel32 to its own detour, then the
    short-jump probe's jmp rel32 to the probe's detour in the dead bytes after
    it; the rest int3, as jump_patch()."""
    return jump_patch(addr, 5, detour) + jump_patch(addr + 5, region_len - 5, probe_detour)


def jump_patch(addr: int, region_len: int, target: int) -> bytes:
    """The optimized probe itself: jmp rel32 to the detour; the rest of the DCR
    becomes int3 so a stray jump into it traps loudly."""
    return b"\xe9" + _s32(target - (addr + 5), "jmp to detour") + b"\xcc" * (region_len - 5)


def short_jump_patch(addr: int, region_len: int, slot: int) -> bytes:
    """A region too short for jmp rel32: jmp rel8 to the slot holding it
    (optprobe.short_jump_slot()); the rest of the region becomes int3."""
    rel = slot - (addr + 2)
    if not -128 <= rel <= 127:
        raise KprewriteError(f"internal error: short jump at {addr:#x} cannot reach {slot:#x}")
    return b"\xeb" + (rel & 0xFF).to_bytes(1, "little") + b"\xcc" * (region_len - 2)


def branch_disp(code: bytes) -> int | None:
    """Where the rel32 of a direct jmp, call or jcc at the start of `code` lies (its
    offset; the instruction ends 4 bytes later), or None for any other instruction.
    Only the plain encodings (E9, E8, 0F 80-8F) a compiler emits; a prefixed one is
    left alone."""
    if code[:1] in (b"\xe8", b"\xe9"):
        return 1
    if len(code) >= 2 and code[0] == 0x0F and 0x80 <= code[1] <= 0x8F:
        return 2
    return None


def retarget_patch(addr: int, code: bytes, target: int) -> tuple[int, bytes]:
    """A direct branch at `addr` (its bytes `code`, as long as branch_disp() says:
    the rel32 is their last 4) sent to `target` instead: the (address, bytes) of its
    new rel32."""
    end = addr + len(code)
    return end - 4, _s32(target - end, "branch to detour")


def entry_stub(at: int, start_fn: int, orig_entry: int) -> bytes:
    """New e_entry of an executable: call kp_user_start(sp, rdx) before the
    program's entry, pass its result on in %rdx (the ELF ABI's exit function)."""
    return asm(f"mov rbx, rsp; mov rdi, rsp; mov rsi, rdx; and rsp, -16; call {start_fn:#x}; "
               f"mov rsp, rbx; mov rdx, rax; xor ebx, ebx; jmp {orig_entry:#x}", at)


def chain_stub(at: int, fn: int, then: int) -> bytes:
    """An init/fini function for a shared object: call fn(argc, argv, envp) and
    go on to the function the slot held before."""
    return asm(f"push rdi; push rsi; push rdx; call {fn:#x}; pop rdx; pop rsi; pop rdi; jmp {then:#x}", at)


def call_stub(at: int, fn: int) -> bytes:
    """A fini function of our own for a shared object that had none: call fn, return."""
    return asm(f"push rdi; push rsi; push rdx; call {fn:#x}; pop rdx; pop rsi; pop rdi; ret", at)


def signal_syscall_stub(at: int, sc, hook: int) -> bytes:
    """Where a base.SignalSyscall's jump goes: its instructions up to the system call
    (the arguments set as the program sets them), then, instead of the system call,
    hook(a0, a1, a2, a3, nr) (kp_signal_syscall) with every register but %rax (the
    result) and the flags kept, over the red zone; then a jmp back after it.  With
    sc.nr 0 (syscall(2)), the number is tested first: any other system call is made
    right here (clone's child goes on from it as from the original)."""
    insns, back = sc.insns, sc.end
    out = b""
    for insn in insns[:-1]:
        out += relocate(insn, at + len(out))
    if not sc.nr:
        # cmp eax,13; je H; cmp eax,14; je H; syscall; jmp back; H:
        out += b"\x83\xf8\x0d\x74\x0c\x83\xf8\x0e\x74\x07\x0f\x05"
        out += b"\xe9" + _s32(back - (at + len(out) + 5), "jmp back from the signal system call stub")
    out += _asm_pi("lea rsp, [rsp-128]; pushfq; push rdi; push rsi; push rdx; push r10; push r8; push r9; "
                   "push rcx; push r11; push rbp; mov rbp, rsp; and rsp, -16; mov rcx, r10; mov r8, rax")
    out += b"\xe8" + _s32(hook - (at + len(out) + 5), "call of the signal system call hook")
    out += _asm_pi("mov rsp, rbp; pop rbp; pop r11; pop rcx; pop r9; pop r8; pop r10; pop rdx; pop rsi; pop rdi; "
                   "popfq; lea rsp, [rsp+128]")
    return out + b"\xe9" + _s32(back - (at + len(out) + 5), "jmp back from the signal system call stub")


# -- The clean-call optprobe template -------------------------------------------
#
# Layouts the template reads directly, from the runtime's C headers (offsets.py:
# read at first use).  As emit.NAME too (retprobe.py, emit/tables.py, emit/emission.py):
# KPROBE_SIZE sizeof(struct kprobe), KPROBE_FLAGS offsetof(struct kprobe, flags),
# KRETPROBE_SIZE sizeof(struct kretprobe) (whose kprobe comes first), THREAD_ACTIVE,
# THREAD_HITS, THREAD_KRET offsetof(struct kp_thread, ...), THREAD_TABLE_MASK
# (KP_TABLE_SIZE - 1; KP_HASH(key) = key >> 12 & mask); for the kretprobe templates
# KRET_DEPTH, KRET_TAIL_SLOT, KRET_STACK, RP_MAXACTIVE, RP_STRIDE, RP_POOL, RP_HINT,
# RI_RP, RI_RET_ADDR, RI_FP, RI_STATE, RI_FLAGS, RI_TRAMP (KP_RI_TRAMP); PT_REGS,
# PT_ORIG_AX, PT_IP, PT_CS, PT_FLAGS, PT_SP, PT_SS, PT_SIZE, ARITH_FLAGS, LIGHT_SHARDS.


def __getattr__(name: str):
    """emit.KPROBE_SIZE & co.: offsets.py's, at first use; FULL_FRAME from them."""
    if name == "FULL_FRAME":
        return _full_frame()
    return getattr(O, name)


CLEAN_FRAME = RED_ZONE + 88  # red zone + rax rcx rdx rsi rdi r8-r11, flags, the thread block
_SCRATCH = ("rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11")


@functools.lru_cache(maxsize=None)
def _asm_pi(text: str) -> bytes:
    """Position-independent instructions (no relative branch): assembled once."""
    return asm(text, 0)


_DISP_MARK = _pack_i32(0x12345678)


@functools.lru_cache(maxsize=None)
def _rip_template(text: str) -> tuple[bytes, int]:
    code = _asm_pi(text.format(d=0x12345678))
    return code, code.index(_DISP_MARK)


def _asm_disp(text: str, v: int) -> bytes:
    """Position-independent instructions with one displacement {d} = v, assembled once
    per text: a disp32 (v beyond a signed byte) is patched into the template's."""
    if -0x80 <= v < 0x80 or not -(1 << 31) <= v < (1 << 31):
        return _asm_pi(text.format(d=f"{v:#x}"))
    code, off = _rip_template(text)
    return code[:off] + _pack_i32(v) + code[off + 4:]


def _rip(text: str, at: int, target: int) -> bytes:
    """One instruction with a [rip + X] operand reaching `target` (text holds {d})."""
    code, off = _rip_template(text)
    _link(target, at + off)
    return code[:off] + _s32(target - (at + len(code)), "RIP-relative operand") + code[off + 4:]


class _Code:
    """Code being assembled at a known address, with rel32 forward jumps."""

    def __init__(self, at: int):
        self.at, self.out = at, bytearray()

    @property
    def pc(self) -> int:
        return self.at + len(self.out)

    def a(self, text: str):
        """Instructions without relative branches (those go through call/jcc)."""
        self.out += _asm_pi(text)

    def call(self, target: int):
        _link(target, self.pc + 1)
        self.out += b"\xe8" + _s32(target - (self.pc + 5), "call")

    def rip(self, text: str, target: int):
        self.out += _rip(text, self.pc, target)

    def jcc(self, cc: int) -> int:
        """A rel32 jcc (0x0f 0x80|cc) or, with cc = -1, jmp, to be fixed up."""
        self.out += b"\xe9\0\0\0\0" if cc < 0 else bytes([0x0F, 0x80 | cc]) + b"\0\0\0\0"
        return len(self.out)

    def fix(self, ends: list[int], target: int):
        for end in ends:
            _link(target, self.at + end - 4)
            self.out[end - 4:end] = _s32(target - (self.at + end), "jump in a detour")

    def call_aligned(self, target: int, aligned: bool, scratch: str = "rax"):
        """call target, realigning the stack first unless the ABI already did
        (scratch: a register free to hold the old %rsp)."""
        if not aligned:
            self.a(f"mov {scratch}, rsp; and rsp, -16; sub rsp, 16; mov qword ptr [rsp + 8], {scratch}")
        self.call(target)
        if not aligned:
            self.a("mov rsp, qword ptr [rsp + 8]")

    def jmp_abs(self, target: int, what: str):
        _link(target, self.pc + 1)
        self.out += b"\xe9" + _s32(target - (self.pc + 5), what)


JB, JAE, JE, JNE, JBE, JA = 0x2, 0x3, 0x4, 0x5, 0x6, 0x7


# The base a platform's thread key is read from (arch.base.ThreadKey.base): the
# thread pointer (%fs) or the CPU's per-CPU base (%gs).
_KEY_SEGMENT = {"thread": b"\x64", "cpu": b"\x65"}


def preempt_disable(c: _Code, key):
    """preempt_disable() where the thread key is the CPU: incl %gs:__preempt_count,
    before the key is read, so the dispatch stays on this CPU.  Clobbers the flags."""
    if key.preempt is not None:
        c.out += _KEY_SEGMENT[key.base] + b"\xff\x04\x25" + _pack_i32(key.preempt)


def preempt_enable(c: _Code, key):
    """preempt_enable(): decl %gs:__preempt_count; on zero (x86 folds an inverted
    PREEMPT_NEED_RESCHED into the count: zero means a reschedule is pending) call the
    image's preempt_schedule thunk, which keeps every register.  Clobbers the flags."""
    if key.preempt is None:
        return
    c.out += _KEY_SEGMENT[key.base] + b"\xff\x0c\x25" + _pack_i32(key.preempt)
    if key.resched is not None:
        c.out += b"\x75\x05"                                  # jnz over the call
        c.call(key.resched)


def find_thread(c: _Code, fast: int, table: int, key) -> list[int]:
    """kp_current_thread() inlined: kprobes armed, and the thread's block
    (found by the platform's thread key, arch.base.ThreadKey) in rdx.  Clobbers
    rax rdx rdi.  Returns the jumps to the slow path (disarmed, a thread seen
    for the first time)."""
    c.rip("cmp dword ptr [rip + {d}], 0", fast)
    slow = [c.jcc(JE)]
    c.out += _KEY_SEGMENT[key.base] + b"\x48\x8b\x3c\x25" + _pack_i32(key.disp)   # mov %seg:disp,%rdi
    c.a(f"mov rax, rdi; shr rax, 12; and eax, {O.THREAD_TABLE_MASK:#x}")
    c.rip("lea rdx, [rip + {d}]", table)
    c.a("mov rdx, qword ptr [rdx + rax*8]; cmp rdi, qword ptr [rdx]")
    slow.append(c.jcc(JNE))
    return slow


def scratch_plan(used: set[str], clobbers: set[str] | None) -> tuple[list[str], list[str], dict[str, int]]:
    """Which call-clobbered registers a clean template saves on its fast path
    (those it uses and the handler writes; all when unknown), which only
    before calling C, and each one's slot in the frame."""
    fast_saves = [r for r in _SCRATCH if r in used or clobbers is None or r in clobbers]
    return fast_saves, [r for r in _SCRATCH if r not in fast_saves], {r: 8 * i for i, r in enumerate(_SCRATCH)}


def save_pt_regs(c: _Code):
    """struct pt_regs at %rsp as the kernel's optprobe template builds it:
    every register, the flags (arithmetic ones by seto/lahf, IF set), orig_ax,
    cs, ss; the flags word is left in rcx.  ip and sp are the caller's."""
    c.a(f"mov qword ptr [rsp + {O.PT_REGS['rax']}], rax; mov qword ptr [rsp + {O.PT_REGS['rcx']}], rcx")
    c.a("seto al; lahf; movzx ecx, ah; movzx eax, al; shl eax, 11; or ecx, eax; or ecx, 0x200")
    c.a(f"mov qword ptr [rsp + {O.PT_FLAGS}], rcx")
    for reg, off in O.PT_REGS.items():
        if reg not in ("rax", "rcx"):
            c.a(f"mov qword ptr [rsp + {off}], {reg}")
    c.a(f"mov qword ptr [rsp + {O.PT_ORIG_AX}], -1; mov qword ptr [rsp + {O.PT_CS}], 0x33; "
        f"mov qword ptr [rsp + {O.PT_SS}], 0x2b")


def restore_pt_regs(c: _Code):
    """Every register and the arithmetic flags back from pt_regs at %rsp."""
    F = O.PT_FLAGS
    c.a(f"movzx eax, byte ptr [rsp + {F}]; shl eax, 8; movzx ecx, byte ptr [rsp + {F + 1}]; shr ecx, 3; "
        "and ecx, 1; or eax, ecx; add al, 0x7f; sahf")
    for reg, off in O.PT_REGS.items():
        c.a(f"mov {reg}, qword ptr [rsp + {off}]")


def _dispatch_fast_path(c: _Code, fast: int, table: int, key, probe: int, probe_index: int,
                        thread_slot: str | None) -> tuple[list[int], list[int]]:
    """The inlined part of the dispatch (kp_pre_dispatch() in kp_core.c for a
    site with one probe): kprobes armed, the thread's block found, no handler
    running on this thread, the probe enabled.  Counts the hit and, if a
    handler is to run (thread_slot), marks the thread active and leaves its
    block at `thread_slot` for after the handler.
    Clobbers rax rdx rdi.  Returns (jumps to the slow path, jumps to the
    restore: a disabled probe stays silent)."""
    slow = find_thread(c, fast, table, key)
    c.a(f"cmp dword ptr [rdx + {O.THREAD_ACTIVE}], 0")
    slow.append(c.jcc(JNE))                                    # reentered: nmissed
    c.rip("test byte ptr [rip + {d}], 3", probe + O.KPROBE_FLAGS)   # KPROBE_FLAG_GONE|DISABLED
    restore = [c.jcc(JNE)]
    c.a(f"inc qword ptr [rdx + {O.THREAD_HITS + 8 * probe_index}]")
    if thread_slot:
        c.a(f"mov dword ptr [rdx + {O.THREAD_ACTIVE}], 1; mov qword ptr {thread_slot}, rdx")
    return slow, restore


def _dcr_and_back(c: _Code, dcr: list[DcrInsn], copy=None, back: int | None = None) -> int:
    copy = copy or relocate
    resume = c.pc
    for insn in dcr:
        c.out += copy(insn, c.pc)
    c.jmp_abs(back or dcr[-1].addr + len(dcr[-1].code), "jmp back")
    return resume


def clean_detour(site: int, dcr: list[DcrInsn], at: int, *, fast: int, table: int, key, probe: int,
                 probe_index: int, handler: int | None, callback: int,
                 flags_live: bool, aligned: bool, handler_clobbers: set[str] | None = None,
                 copy=None, body=None, back: int | None = None,
                 regs_fields: frozenset[int] | None = None, red_zone: bool = False) -> tuple[bytes, int]:
    """The detour of a site with one probe whose handler never reads pt_regs:
    arch/x86/kernel/kprobes/opt.c's optprobe_template with the dispatch of the
    common case inlined (_dispatch_fast_path); anything else calls the generic
    clean callback.  Only call-clobbered registers are saved: on the fast path
    those the template and the handler write (handler_clobbers, None: unknown,
    so all of them), on the slow path the rest before calling into C.  The
    arithmetic flags are saved only where they are live, and the stack is
    realigned only where its alignment is not fixed by the ABI.
    body(c, slow_saves, slot): emits what runs instead of the handler call,
    with the thread block in rdx and at [rsp + 80] (a kretprobe's entry,
    retprobe.kret_entry_body); the callback is then callback(site, sp at the
    hit), the return-address slot.
    copy(insn, at): how to copy a DCR instruction (default: relocate).
    regs_fields: a pre_handler that only loads from regs, at these pt_regs byte
    offsets (handler_abi.regs_loads()): a partial pt_regs in the frame
    (PARTIAL_REGS), only those fields stored, passed in %rsi; nothing is restored
    from it (the handler cannot write it).  The callback is then
    callback(site, regs) (kp_optimized_callback), whose return is not read: with
    regs unchanged it is always KP_RESUME_DETOUR.  red_zone (a function's entry):
    unused here, the template steps over the red zone wherever it is.
    Returns (code, resume): where the relocated DCR starts."""
    partial = regs_fields is not None
    used = {"rax", "rdx", "rdi"} | (set() if aligned else {"rcx"})
    if partial:
        used |= {"rsi"} | ({"rcx"} if O.PT_FLAGS in regs_fields else set())
    frame = CLEAN_FRAME + (_partial_area() if partial else 0)
    fast_saves, slow_saves, slot = scratch_plan(used, handler_clobbers)
    c = _Code(at)
    c.a(f"lea rsp, [rsp - {frame:#x}]")
    c.a("mov qword ptr [rsp], rax")
    if partial:
        _partial_pt_regs(c, regs_fields, frame, dcr[0].addr + 1)
    if flags_live or (partial and O.PT_FLAGS in regs_fields):
        c.a("seto al; lahf; mov word ptr [rsp + 72], ax")
    for reg in fast_saves[1:]:
        c.a(f"mov qword ptr [rsp + {slot[reg]}], {reg}")
    if partial and O.PT_FLAGS in regs_fields:           # as save_pt_regs(): IF set
        c.a("movzx ecx, ah; movzx eax, al; shl eax, 11; or ecx, eax; or ecx, 0x200")
        c.a(f"mov qword ptr [rsp + {PARTIAL_REGS + O.PT_FLAGS}], rcx")
    preempt_disable(c, key)
    to_slow, to_restore = _dispatch_fast_path(c, fast, table, key, probe, probe_index,
                                              "[rsp + 80]" if handler is not None or body else None)
    if body is not None:
        body(c, slow_saves, slot)
    elif handler is not None:
        c.rip("lea rdi, [rip + {d}]", probe)        # the handler never reads regs (%rsi)
        if partial:                                 # ... or only the fields stored
            c.a(f"lea rsi, [rsp + {PARTIAL_REGS}]")
        c.call_aligned(handler, aligned, "rcx")
        c.a(f"mov rdx, qword ptr [rsp + 80]; mov dword ptr [rdx + {O.THREAD_ACTIVE}], 0")
    restore = c.pc
    preempt_enable(c, key)
    if flags_live:
        c.a("movzx eax, word ptr [rsp + 72]; add al, 0x7f; sahf")
    for reg in fast_saves:
        c.a(f"mov {reg}, qword ptr [rsp + {slot[reg]}]")
    c.a(f"lea rsp, [rsp + {frame:#x}]")
    resume = _dcr_and_back(c, dcr, copy, back)
    slow = c.pc
    for reg in slow_saves:
        c.a(f"mov qword ptr [rsp + {slot[reg]}], {reg}")
    c.a(f"mov edi, {site:#x}")
    if body is not None:                                       # kp_kretprobe_enter_clean_slow(site, S)
        c.a(f"lea rsi, [rsp + {CLEAN_FRAME:#x}]")
    elif partial:                                              # kp_optimized_callback(site, regs)
        c.a(f"lea rsi, [rsp + {PARTIAL_REGS}]")
    c.call_aligned(callback, aligned, "rcx")
    for reg in slow_saves:
        c.a(f"mov {reg}, qword ptr [rsp + {slot[reg]}]")
    c.fix([c.jcc(-1)], restore)
    c.fix(to_slow, slow)
    c.fix(to_restore, restore)
    return bytes(c.out), resume


# A clean template's partial pt_regs (clean_detour's regs_fields): in the frame after
# the clean part (the nine registers, the flags word, the thread block), before the
# red zone, as long as pt_regs rounded up to 16 bytes (the frame keeps its alignment).
PARTIAL_REGS = CLEAN_FRAME - RED_ZONE


def _partial_area() -> int:
    """The partial pt_regs' room in the frame: pt_regs rounded up to 16 bytes."""
    return (O.PT_SIZE + 15) & ~15


def _partial_pt_regs(c: _Code, fields: frozenset[int], frame: int, hit_ip: int):
    """The pt_regs fields a pre_handler reads, at [rsp + PARTIAL_REGS], as
    save_pt_regs() and full_detour() store them: each register as at the hit, ip the
    hit + 1, sp the stack pointer at the hit, orig_ax, cs, ss; the flags are the
    caller's (they need rax and rcx).  Only %rax is saved when this runs: it is
    written last, for ip and sp."""
    base = PARTIAL_REGS
    regs = {off: reg for reg, off in O.PT_REGS.items()}
    for off in sorted(fields):
        if off in regs:
            c.a(f"mov qword ptr [rsp + {base + off}], {regs[off]}")
    consts = {O.PT_ORIG_AX: -1, O.PT_CS: 0x33, O.PT_SS: 0x2b}
    for off in sorted(fields):
        if off in consts:
            c.a(f"mov qword ptr [rsp + {base + off}], {consts[off]}")
    if O.PT_SP in fields:
        c.a(f"lea rax, [rsp + {frame:#x}]; mov qword ptr [rsp + {base + O.PT_SP}], rax")
    if O.PT_IP in fields:
        c.rip("lea rax, [rip + {d}]", hit_ip)
        c.a(f"mov qword ptr [rsp + {base + O.PT_IP}], rax")
    known = set(regs) | set(consts) | {O.PT_SP, O.PT_IP, O.PT_FLAGS}
    if not fields <= known:
        raise EmitError(f"pt_regs fields {sorted(fields - known)} have no value")


# struct pt_regs (arch/x86/include/asm/ptrace.h): O.PT_REGS, byte offsets in save
# order, O.PT_IP & co.; O.ARITH_FLAGS: OF SF ZF AF PF CF, restored without popfq
# (KP_ARITH_FLAGS).


def _full_frame() -> int:
    """The full template's frame: red zone, pt_regs, the thread block, the flags at the hit."""
    return RED_ZONE + O.PT_SIZE + 16


def full_detour(site: int, dcr: list[DcrInsn], at: int, *, fast: int, table: int, key, probe: int,
                probe_index: int, handler: int, callback: int, resume_regs: int,
                aligned: bool, copy=None, body=None, back: int | None = None,
                red_zone: bool = False) -> tuple[bytes, int]:
    """The detour of a site with one probe whose pre_handler may read or write
    pt_regs: optprobe_template building struct pt_regs inline (as
    kp_optprobe_entry does), with the dispatch of the common case inlined.  A
    handler that changed the path (non-zero return and a new regs->ip),
    regs->sp or a non-arithmetic flag resumes through kp_optprobe_resume_regs;
    anything else restores every register from pt_regs.
    body(c): emits what runs instead of the handler call (pt_regs at rbx, the
    thread block in rdx and after pt_regs; leaves the pre_handler's return in
    eax: retprobe.kret_entry_body).  red_zone: unused (as clean_detour's).
    Returns (code, resume): where the relocated DCR starts."""
    c = _Code(at)
    F = O.PT_FLAGS
    full_frame = _full_frame()
    c.a(f"lea rsp, [rsp - {full_frame:#x}]")
    save_pt_regs(c)
    c.a(f"mov qword ptr [rsp + {O.PT_SIZE + 8}], rcx")           # the flags at the hit
    c.a(f"lea rax, [rsp + {full_frame:#x}]; mov qword ptr [rsp + {O.PT_SP}], rax")
    hit_ip = dcr[0].addr + 1                                    # as if the int3 had trapped
    c.rip("lea rax, [rip + {d}]", hit_ip)
    c.a(f"mov qword ptr [rsp + {O.PT_IP}], rax")
    preempt_disable(c, key)
    to_slow, to_restore = _dispatch_fast_path(c, fast, table, key, probe, probe_index, f"[rsp + {O.PT_SIZE}]")
    c.a("mov rbx, rsp")                                         # saved in pt_regs; the callee keeps it
    if not aligned:
        c.a("and rsp, -16")
    if body is not None:
        body(c)
    else:
        c.rip("lea rdi, [rip + {d}]", probe)
        c.a("mov rsi, rbx")
        c.call(handler)
    c.a("mov rsp, rbx")
    c.a(f"mov rdx, qword ptr [rsp + {O.PT_SIZE}]; mov dword ptr [rdx + {O.THREAD_ACTIVE}], 0")
    # What the handler changed: the path, the stack pointer, non-arithmetic flags.
    c.rip("lea rcx, [rip + {d}]", hit_ip)
    c.a("test eax, eax")
    same_path = c.jcc(JE)
    c.a(f"cmp qword ptr [rsp + {O.PT_IP}], rcx")
    to_resume_regs = [c.jcc(JNE)]
    c.fix([same_path], c.pc)
    c.a(f"lea rax, [rsp + {full_frame:#x}]; cmp qword ptr [rsp + {O.PT_SP}], rax")
    to_changed = [c.jcc(JNE)]
    c.a(f"mov rax, qword ptr [rsp + {F}]; xor rax, qword ptr [rsp + {O.PT_SIZE + 8}]; test rax, {~O.ARITH_FLAGS}")
    to_changed.append(c.jcc(JNE))
    restore = c.pc
    preempt_enable(c, key)
    restore_pt_regs(c)
    c.a(f"lea rsp, [rsp + {full_frame:#x}]")
    resume = _dcr_and_back(c, dcr, copy, back)
    changed = c.pc                                              # go on with the DCR, on regs->sp
    c.rip("lea rax, [rip + {d}]", resume)
    c.a(f"mov qword ptr [rsp + {O.PT_IP}], rax")
    leave = c.pc                                                # every way to resume_regs
    preempt_enable(c, key)
    c.fix([c.jcc(-1)], resume_regs)
    slow = c.pc
    c.a(f"mov edi, {site:#x}; mov rsi, rsp; mov rbx, rsp")
    if not aligned:
        c.a("and rsp, -16")
    c.call(callback)
    c.a("mov rsp, rbx; test eax, eax")
    c.fix([c.jcc(JNE)], leave)
    c.fix([c.jcc(-1)], restore)
    c.fix(to_slow, slow)
    c.fix(to_restore, restore)
    c.fix(to_resume_regs, leave)
    c.fix(to_changed, changed)
    return bytes(c.out), resume


# O.LIGHT_SHARDS (KP_LIGHT_SHARDS): counter shards, by the thread pointer's page.
LIGHT_PAGE = 4096 // 8                   # KP_LIGHT_PAGE: counters of one shard in a page


def light_counter(slot: int) -> int:
    """Where hit slot `slot`'s counter of shard 0 lies in kp_light_hits[], in bytes
    (the runtime's KP_LIGHT_INDEX): shards interleave page by page, so shard s's
    is 4096 * s further, and the thread pointer's page bits are the shard offset."""
    return (slot // LIGHT_PAGE * O.LIGHT_SHARDS * LIGHT_PAGE + slot % LIGHT_PAGE) * 8


@functools.lru_cache(maxsize=None)
def _key_load(seg: str, disp: int) -> bytes:
    """mov %seg:disp, %rax: the thread pointer, from the thread key's segment."""
    return _KEY_SEGMENT[seg] + b"\x48\x8b\x04\x25" + _pack_i32(disp)


@functools.lru_cache(maxsize=None)
def _light_parts(red_zone: bool, flags_live: bool) -> tuple[bytes, bytes, bytes]:
    """light_detour()'s fixed parts: (saving rax and the live flags, restoring them,
    the shard's page bits of the thread pointer in eax).
    One register, rax, is used, saved where the ABI leaves room: at a function entry
    (red_zone) in the 128 bytes below %rsp, elsewhere below the red zone."""
    if red_zone:
        rax, fl = "[rsp - 8]", "[rsp - 16]"
    else:
        rax, fl = "[rsp]", "[rsp + 8]"
    head = b"" if red_zone else _asm_pi(f"lea rsp, [rsp - {RED_ZONE + 16:#x}]")
    head += _asm_pi(f"mov qword ptr {rax}, rax")
    if flags_live:
        head += _asm_pi(f"seto al; lahf; mov word ptr {fl}, ax")
    undo = _asm_pi(f"movzx eax, word ptr {fl}; add al, 0x7f; sahf") if flags_live else b""
    undo += _asm_pi(f"mov rax, qword ptr {rax}")
    if not red_zone:
        undo += _asm_pi(f"lea rsp, [rsp + {RED_ZONE + 16:#x}]")
    return head, undo, _asm_pi(f"and eax, {(O.LIGHT_SHARDS - 1) << 12:#x}")


def light_detour(site: int, dcr: list[DcrInsn], at: int, *, fast: int, base: int, key, counter: int,
                 slow_entry: int, flags_live: bool, red_zone: bool,
                 copy=None, back: int | None = None, hits: int | None = None) -> tuple[bytes, int]:
    """The detour of a probe that runs nothing, in an image where no handler can
    run at all (planner.choose_forms(): Site.light).  What is left of the
    dispatch (kp_pre_dispatch()) is the kprobes/enabled test and the hit count:
    with no handler, no hit can find one running (no nmissed) and nothing can
    disable a probe, so neither is tested, and the thread's block is not looked
    up.  The count is a locked increment of the probe's counter in one of
    O.LIGHT_SHARDS shards, chosen by the thread pointer's page bits 12-15 (the
    kernel's per-CPU nhit, per thread-ish: glibc's threads' pointers lie a stack
    apart, so concurrent threads rarely share a shard's line, and the lock keeps
    the sums exact when they do).  Shard s of the counter is at
    *kp_light_base + counter + 4096 * s (light_counter()).  One register, rax, is used,
    saved where the ABI leaves room: at a function entry (red_zone) in the 128
    bytes below %rsp, which the callee owns and a signal frame skips, so %rsp
    never moves; elsewhere below the red zone.  The flags are saved only where
    they are live.  The slow path (disarmed, before start-up, before a static
    program has its thread pointer) puts everything back and calls the runtime's
    shared clean entry (probe_stub()), which counts in C, in the thread's block.
    hits (kp_light_hits itself): unused, `add rax, [rip + base]` adds the base in one.
    Returns (code, resume): where the relocated DCR starts."""
    if key.preempt is not None:
        raise EmitError("light detours are for a thread key that needs no preempt_disable()")
    head, undo, shard = _light_parts(red_zone, flags_live)
    key_load = _key_load(key.base, key.disp)
    inc = _asm_disp("lock inc qword ptr [rax + {d}]", counter)
    copy = copy or relocate
    back = back or dcr[-1].addr + len(dcr[-1].code)

    def build(short: bool) -> tuple[bytearray, int, int]:
        """The detour, its resume address and how far its je to the slow path jumps.
        (_Code's steps written out: a rewrite builds 12,000 of these.)"""
        out = bytearray(head)
        out += _rip("cmp dword ptr [rip + {d}], 0", at + len(out), fast)
        out += b"\x74\x00" if short else b"\x0f\x84\x00\x00\x00\x00"       # je slow
        je = len(out)
        out += key_load + shard                                    # the shard's page bits of the thread pointer
        out += _rip("add rax, qword ptr [rip + {d}]", at + len(out), base)    # the shard's counters
        out += inc + undo
        resume = at + len(out)                                     # the relocated DCR, then the jump back
        for insn in dcr:
            out += copy(insn, at + len(out))
        out += b"\xe9" + _s32(back - (at + len(out) + 5), "jmp back")
        rel = len(out) - je
        if short:
            if rel >= 128:
                return out, resume, rel     # too far for a rel8 je: built again with a rel32 one
            out[je - 1] = rel
        else:
            out[je - 4:je] = _s32(rel, "jump in a detour")
        out += undo                                                # slow: the probe stub, then the copy
        out += probe_stub(site, slow_entry, at + len(out))
        out += b"\xe9" + _s32(resume - (at + len(out) + 5), "jmp to the copy")
        return out, resume, rel

    # The code the je jumps over is as long with either je (copies are as long
    # wherever they go), so the rel8 form is tried first: one build for most sites.
    logged = len(fast.links) if type(fast) is LinkSym else 0
    out, resume, rel = build(True)
    if rel >= 128:
        if type(fast) is LinkSym:       # the first build's links are not the code's
            del fast.links[logged:]
        out, resume, _ = build(False)
    return bytes(out), resume
