"""Return sites of a function and their jump-optimized return hooks (x86-64).

The kernel catches a return by swapping the return address for a trampoline
(arch/x86/kernel/rethook.c).  A static rewriter sees every exit of the
function instead: each `ret`, and each tail-call `jmp` to another function.
Each exit gets a return hook placed like an optimized probe: a 5-byte jmp at
the start of a region that ends with the exit (the DCR), to a detour that runs
the relocated DCR up to the exit, calls the hook, then executes the exit
itself.  A region may start at an earlier instruction boundary (`pop %rbx;
pop %rbp; ret`), and may run on into the alignment padding after the
function's end (nops or int3 that nothing executes).  The region's checks are
can_optimize()'s: every instruction relocatable, no jump target inside but at
its start, inside the function (or its padding).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import capstone

from . import insn as x86insn
from .emit import _s32, relocate
from .optprobe import JMP32_INSN_SIZE, DcrInsn, Refusal

_cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)

RET, TAIL = "ret", "tail"
PAD_OK = ("nop", "int3")


@dataclass(frozen=True)
class Exit:
    """One way out of a function: a ret, or a tail-call jmp to `target`."""
    addr: int
    kind: str                 # RET or TAIL
    insn: DcrInsn
    target: int | None = None


@dataclass
class Exits:
    exits: list[Exit]
    refusal: Refusal | None   # an exit that cannot be hooked at all (conditional tail call...)
    parts: list               # the function and its .cold parts


class _Insns:
    """A function's instructions: decoded once (Capstone, lite), classified on
    demand (only exits and the few instructions a return region takes)."""

    def __init__(self, image, func):
        self.code = image.read(func.start, func.end - func.start)
        self.start = func.start
        self.lite = list(_cs.disasm_lite(self.code, func.start))
        self.addrs = [a for a, _s, _m, _o in self.lite]
        self._cls: dict[int, DcrInsn] = {}

    def at(self, k: int) -> DcrInsn:
        got = self._cls.get(k)
        if got is None:
            a, size = self.lite[k][0], self.lite[k][1]
            off = a - self.start
            info = x86insn.classify(self.code[off:off + 16], a)
            got = self._cls[k] = DcrInsn(a, bytes(self.code[off:off + info.length]), info)
        return got


def _insns(image, analysis, func) -> _Insns:
    cache = analysis.__dict__.setdefault("_retprobe_insns", {})
    got = cache.get(func.start)
    if got is None:
        got = cache[func.start] = _Insns(image, func)
    return got


def find_exits(image, analysis, func) -> Exits:
    """Every ret and tail jmp of `func`, following jumps into its `.cold` parts."""
    cache = analysis.__dict__.setdefault("_retprobe_exits", {})
    if func.start not in cache:
        cache[func.start] = _find_exits(image, analysis, func)
    return cache[func.start]


def _find_exits(image, analysis, func) -> Exits:
    parts = [func]
    seen = {func.start}
    exits: list[Exit] = []
    refusal = None
    i = 0
    while i < len(parts):
        part = parts[i]
        i += 1
        d = analysis.decoded(part)
        if d.undecodable is not None:
            return Exits([], Refusal("decode", d.undecodable, f"{part.name} cannot be decoded"), parts)
        if d.indirect_jump is not None:
            return Exits([], Refusal("indirect_jump", d.indirect_jump,
                                     f"{part.name} has an indirect jump: its exits are unknown"), parts)
        insns = _insns(image, analysis, part)
        for k, (_a, _size, mnem, _ops) in enumerate(insns.lite):
            if not (mnem.startswith(("ret", "j", "loop", "repz ret", "bnd ret", "bnd j", "notrack j"))):
                continue
            ins = insns.at(k)
            em, info = ins.info.emulate, ins.info
            if em in ("ret", "ret imm"):
                exits.append(Exit(ins.addr, RET, ins))
            elif em in ("jmp rel", "jcc rel", "loop", "jcxz"):
                t = info.rel_target
                if any(p.start <= t < p.end for p in parts):
                    continue
                tf = image.function_at(t)
                if tf is not None and ".cold" in tf.name and tf.start not in seen:
                    seen.add(tf.start)
                    parts.append(tf)
                    continue
                if tf is not None and tf.start in seen:
                    continue
                if em != "jmp rel":
                    refusal = refusal or Refusal("conditional_tail_call", ins.addr,
                                                 f"conditional jump to {t:#x} leaves {func.name}")
                elif (tf is None or tf.start != t) and not _plt(image, t):
                    refusal = refusal or Refusal("jump_out", ins.addr,
                                                 f"jump to {t:#x} leaves {func.name} but not to a function's start")
                else:
                    exits.append(Exit(ins.addr, TAIL, ins, t))
    exits.sort(key=lambda e: e.addr)
    return Exits(exits, refusal, parts)


def _plt(image, addr: int) -> bool:
    sec = image.section_containing(addr)
    return sec is not None and sec.name in (".plt", ".plt.sec", ".plt.got", ".iplt")


def _padding(image, analysis, part, start: int, need: int) -> bool:
    """May [start, start + need) be overwritten?  It follows an unconditional
    exit, so only a jump could reach it: it must be alignment padding (nop,
    int3) that no known jump lands in, inside this function or between
    functions."""
    if need <= 0:
        return True
    if analysis.targets_in(start, start + need):
        return False
    for a in range(start, start + need):
        f = image.function_at(a)
        if not image.is_code(a) or (f is not None and f.start != part.start):
            return False
    code = image.read(start, need + 15)
    pos = 0
    for _a, size, mnem, _ops in _cs.disasm_lite(code, start):
        if mnem not in PAD_OK:
            return False
        pos += size
        if pos >= need:
            return True
    return False


def exit_region(image, analysis, part, exit: Exit, busy) -> tuple[list[DcrInsn], int] | Refusal:
    """The smallest region ending with `exit` that can take a 5-byte jump:
    (its instructions, region end).  `busy(lo, hi)` says whether another probe's
    region overlaps [lo, hi)."""
    allin = _insns(image, analysis, part)
    k = bisect.bisect_left(allin.addrs, exit.addr)
    end_insn = exit.addr + len(exit.insn.code)
    last = Refusal("ret_region", exit.addr, "no region of 5 bytes ending with this exit")
    dcr: list[DcrInsn] = [exit.insn]
    while True:
        b = dcr[0].addr
        need = JMP32_INSN_SIZE - (end_insn - b)
        if need <= 0 or _padding(image, analysis, part, end_insn, need):
            end = max(end_insn, b + JMP32_INSN_SIZE)
            if busy(b, end):
                last = Refusal("probe_in_region", b, f"another probe overlaps the return region [{b:#x}, {end:#x})")
            else:
                return dcr, end
        if need <= 0:
            return last
        # Grow backwards by one instruction, if the one we add can be relocated
        # and the current start is not a jump target.
        hits = analysis.targets_in(b, b + 1)
        if hits:
            return Refusal("jump_into_region", b, f"{hits[0][1]} lands at {b:#x}, inside the return region")
        k -= 1
        if k < 0 or allin.lite[k][0] + allin.lite[k][1] != b:
            return Refusal("func_size", exit.addr, f"fewer than 5 bytes from the start of {part.name} to this exit")
        prev = allin.at(k)
        if prev.info.probe_refused:
            return Refusal("can_probe", prev.addr, f"{prev.info.probe_refused} before the exit")
        if prev.info.emulate is not None or not prev.info.boostable:
            why = prev.info.emulate or prev.info.boost_reason
            return Refusal("can_boost", prev.addr, f"instruction before the exit cannot be relocated ({why})")
        dcr.insert(0, prev)


def hook_call(at: int, hook: int) -> bytes:
    return b"\xe8" + _s32(hook - (at + 5), "call return hook")


def exit_code(insn: DcrInsn, at: int) -> bytes:
    """The exit itself, in a detour: a ret is copied, a tail jmp re-encoded."""
    return relocate(insn, at)


PLAIN_RETS = (b"\xc3", b"\xf3\xc3", b"\xf2\xc3")


def hook_then_exit(exit: DcrInsn, hook: tuple[int, int | None], at: int) -> bytes:
    """`call hook` then the exit; for a plain ret, `jmp` to the hook's variant
    that returns to the caller itself.  hook = (call target, jmp target or None)."""
    call_hook, jmp_hook = hook
    if jmp_hook is not None and exit.code in PLAIN_RETS:
        return b"\xe9" + _s32(jmp_hook - (at + 5), "jmp return hook")
    return hook_call(at, call_hook) + exit_code(exit, at + 5)


def ret_detour(dcr: list[DcrInsn], hook: tuple[int, int | None], at: int) -> bytes:
    """Detour of a return site: the DCR up to the exit, the hook, the exit."""
    out = bytearray()
    for insn in dcr[:-1]:
        out += relocate(insn, at + len(out))
    out += hook_then_exit(dcr[-1], hook, at + len(out))
    return bytes(out)


def site_detour(site: int, dcr: list[DcrInsn], with_post: bool, at: int, entry: int, post_entry: int,
                hooks: dict[int, tuple[int, int | None]]) -> tuple[bytes, int, int]:
    """emit.detour() for a kprobe site whose DCR holds exits of a return-probed
    function (a short function: the entry's region reaches its ret): each exit
    in the copy calls its return hook first."""
    from .emit import detour

    def copy(insn, pos):
        if insn.addr in hooks:
            return hook_then_exit(insn, hooks[insn.addr], pos)
        return relocate(insn, pos)
    return detour(site, dcr, with_post, at, entry, post_entry, copy)
