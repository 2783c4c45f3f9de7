"""The reach of the `B` an optimized probe writes (+-128 MiB): whether the new
code, placed after the image's last segment, is within it of an address.

A program whose code lies further than that from its end (a large text, a
function placed far away) keeps its probes there as breakpoints (the brk's
out-of-line slot is reached by the SIGTRAP handler, and leaves by a brk), its
kretprobes' exits on the trampoline (x30, not a `B`, brings the return) or, where
that is unsafe (retprobe.trampoline_refusal()), on brk return hooks, with the
reason in `check` (x86-64's rel32 reaches +-2 GiB, which no ordinary program's
code exceeds)."""
from __future__ import annotations

from ..base import Refusal

PT_LOAD = 1
PAGE = 0x1000
JUMP_REACH = 1 << 27               # B imm26: [-128 MiB, +128 MiB - 4]
# The new code's own room, as the linux_user writer keeps it (an eighth of the
# reach): every detour lies in [new_code_at(image), + NEW_CODE_ROOM).
NEW_CODE_ROOM = JUMP_REACH >> 3


def new_code_at(image) -> int:
    """Where the linux_user writer puts the new code: the page after the last
    PT_LOAD's memory (and the file), and one more (writer.plan_layout())."""
    cached = getattr(image, "_aarch64_new_code", None)
    if cached is not None:
        return cached
    loads = [s for s in image.segments if s.type == PT_LOAD]
    if not loads:
        v = 0
    else:
        first = min(loads, key=lambda s: s.vaddr)
        skew = first.vaddr - first.offset
        end = max(max(s.vaddr + s.memsz for s in loads), len(image.data) + skew)
        v = ((end + PAGE - 1) & ~(PAGE - 1)) + PAGE
    image._aarch64_new_code = v
    return v


def in_reach(image, addr: int) -> bool:
    """Every detour (up to NEW_CODE_ROOM past the new code's start) is within a B of addr, both ways."""
    v = new_code_at(image)
    return v + NEW_CODE_ROOM - addr <= JUMP_REACH - 4 and addr - v < JUMP_REACH


def refusal(image, addr: int, what: str = "a B") -> Refusal | None:
    """The jump_reach refusal at addr, or None."""
    if in_reach(image, addr):
        return None
    v = new_code_at(image)
    return Refusal("jump_reach", addr, f"the new code at {v:#x} is {(v - addr) >> 20} MiB away: "
                                       f"beyond the +-128 MiB of {what}")
