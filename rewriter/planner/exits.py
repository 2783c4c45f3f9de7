"""Every exit of a function with a kretprobe: each return, and each tail-call jump
to another function's start, in the function and the cold parts it jumps to.

The kernel never names a function's exits: rethook swaps the return address
at entry (arch/*/kernel/rethook.c).  A static rewriter can, and hooks each one
instead (returns.py).  The walk is the same on every arch; the arch's
retprobe answers what differs (arch.base.RetProbe):

- exits_refusal(): nothing of the function can take a hook (AArch64: the
  return hooks' `B` is out of reach);
- unknown_exits(): an indirect jump of a part that leaves its exits unknown;
- exit_insn() and exit_kind(): what an exit candidate of Analysis's decoding
  is: a return, a direct jump or a conditional one (and its target), or an
  exit that cannot be hooked (AArch64: a `ret` through another register);
- mid_frame_part(): beyond a `.cold` name, a block of another function (a
  stripped cold part, its FDE starting mid-frame);
- JUMP_WORD: what the arch calls a jump, in the refusals.

The indirect jumps the arch reads (arch.jumptable: a jump table, a tail call
through a pointer) are sorted here too: a jump table whose every entry stays in
the function is no exit, a jump none of whose targets does is a tail call.
"""
from __future__ import annotations

import bisect

from ..arch.base import COND, RET, TAIL, Exit, Exits, Refusal


def find_exits(image, analysis, arch, func) -> Exits:
    """Every ret and tail jump of `func`, following jumps into its cold parts
    (named `.cold`, or in a stripped image blocks that start mid-frame)."""
    return analysis.memo("retprobe.exits", func.start, lambda: _find_exits(image, analysis, arch, func))


def _plt(image, addr: int) -> bool:
    sec = image.section_containing(addr)
    return sec is not None and sec.name in (".plt", ".plt.sec", ".plt.got", ".iplt")


def _mid_frame(image, rp, func) -> bool:
    """A block with an FDE of its own that starts mid-frame: a stripped `.cold`
    part (not a PLT, whose FDE starts after PLT0's push)."""
    return not _plt(image, func.start) and rp.mid_frame_part(image, func)


def _find_exits(image, analysis, arch, func) -> Exits:
    rp = arch.retprobe
    parts = [func]
    seen = {func.start}
    far = rp.exits_refusal(image, func)
    if far is not None:             # the trampoline: the return address brings the return
        return Exits([], far, parts)
    jump = rp.JUMP_WORD
    exits: list[Exit] = []
    refusal = None
    i = 0
    while i < len(parts):
        part = parts[i]
        i += 1
        d = analysis.decoded(part)
        if d.undecodable is not None:
            return Exits([], Refusal("decode", d.undecodable, f"{part.name} cannot be decoded"), parts)
        unknown = rp.unknown_exits(image, analysis, part)
        if unknown is not None:
            return Exits([], unknown, parts)
        for a in d.exits or ():
            ins = rp.exit_insn(image, analysis, part, a)
            kind = rp.exit_kind(ins)
            if kind is None:
                continue
            if isinstance(kind, Refusal):
                refusal = refusal or kind
                continue
            what, t = kind
            if what == RET:
                exits.append(Exit(ins.addr, RET, ins))
                continue
            if any(p.start <= t < p.end for p in parts):
                continue
            tf = image.function_at(t)
            if tf is not None and tf.start not in seen and (".cold" in tf.name or _mid_frame(image, rp, tf)):
                seen.add(tf.start)
                parts.append(tf)
                continue
            if tf is not None and tf.start in seen:
                continue
            if what == COND:
                refusal = refusal or Refusal("conditional_tail_call", ins.addr,
                                             f"conditional {jump} to {t:#x} leaves {func.name}")
            elif (tf is None or tf.start != t) and not _plt(image, t):
                refusal = refusal or Refusal("jump_out", ins.addr,
                                             f"{jump} to {t:#x} leaves {func.name} but not to a function's start")
            else:
                exits.append(Exit(ins.addr, TAIL, ins, t))
    indirect = _indirect_exits(image, analysis, arch, func, parts)
    if isinstance(indirect, Refusal):
        return Exits([], indirect, parts)
    exits += indirect
    exits.sort(key=lambda e: e.addr)
    return Exits(exits, refusal, parts)


def _indirect_exits(image, analysis, arch, func, parts) -> list[Exit] | Refusal:
    """The indirect jumps of `parts` as the arch read them (arch.jumptable; none where
    it reads none).  A jump table whose every entry stays in the function is no exit.
    An indirect jump none of whose targets lies in the function is a tail call
    through a pointer: an exit like a tail jump to a function whose returns are not
    hooked (the return address swapped for the trampoline).  A jump that may land
    both inside and outside leaves for where we cannot hook."""
    jt = arch.jumptable
    if jt is None:
        return []

    def inside(t):
        return any(p.start <= t < p.end for p in parts)
    out = []
    for part in parts:
        for j in analysis.indirect.get(part.start, ()):
            if j.kind == jt.TABLE and all(inside(t) for t in j.targets):
                continue
            stays = [t for t in j.targets if inside(t)]
            if j.kind == jt.POINTER or j.via_pointer:
                code = _stored_code(image, analysis)
                stays += [t for p in parts for t in code[bisect.bisect_left(code, p.start):
                                                         bisect.bisect_left(code, p.end)] if t != func.start]
            elif not j.targets:
                stays = [j.addr]
            if j.kind == jt.UNBOUNDED or stays:
                return Refusal("indirect_jump", j.addr, f"{part.name} has an indirect jump that may leave it ({j.kind})")
            out.append(Exit(j.addr, TAIL, arch.retprobe.exit_insn(image, analysis, part, j.addr), None))
    return out


def _stored_code(image, analysis) -> list[int]:
    """Every code address the image stores or computes, sorted: where a jump
    through a stored pointer may land (the arch's jump-table reading of a stored
    code pointer): relocated addresses, PC-relative address computations, and in
    an image linked at a fixed address its constants that may be code addresses."""
    def compute():
        out = {a for _, _, a in image.relative_relocations() if image.is_code(a)}
        for f in image.functions:
            out.update(t for t, _ in analysis.decoded(f).code_refs or ())
        out.update(getattr(analysis, "fixed_pointers", ()))
        return sorted(out)
    return analysis.memo("stored code", 0, compute)
