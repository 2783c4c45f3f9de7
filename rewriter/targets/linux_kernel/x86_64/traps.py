"""x86's int3 (#BP) paths hooked for breakpoint probes: the ftrace site of
kprobe_int3_handler() and the direct calls of it in do_int3()/exc_int3(), and the early
IDT's call of do_early_exception() (runtime/arch/x86_64/linux_kernel/kp_int3_hook.c)."""
from __future__ import annotations

import struct

from ..sites import mcount_locs
from ..symbols import kernel, symbol_at


# The int3 hook: a `call kp_kernel_int3_entry` on kprobe_int3_handler()'s ftrace site, which
# do_int3() calls first for every kernel-mode int3 (after text_poke_bp()'s): our breakpoint
# sites are handled there and it returns 1, any other int3 goes on into the kernel's
# kprobes, kgdb and notify_die().  Not a probe (runtime/arch/x86_64/linux_kernel/kp_int3_hook.c
# says why a call on this NOKPROBE function is safe); its __mcount_loc entry is dropped as an
# ftrace-site probe's is.  Only written when the image has breakpoint sites.
INT3_HOOK = ("kprobe_int3_handler", "kp_kernel_int3_entry")


def int3_hook(image):
    """The ftrace site (a __mcount_loc entry) at kprobe_int3_handler()'s entry, or None
    (no such function or no ftrace site: this image gets no breakpoint probes)."""
    if not hasattr(image, "_int3_hook"):
        f = next((f for f in image.functions if f.name == INT3_HOOK[0]), None)
        image._int3_hook = None if f is None else \
            next((m for m in mcount_locs(kernel(image)) if m.site == f.start), None)
    return image._int3_hook


# do_int3()'s own calls of kprobe_int3_handler() (do_int3() and its copies inlined into
# exc_int3()) call the hook's C half instead, which returns to them itself: the ftrace
# site's call and the entry's jump saved at each trap.  The ftrace site stays hooked for
# any other caller; the C half goes on past it for an int3 not ours (kp_int3_hook.c).
INT3_CALLERS = ("do_int3", "exc_int3")
INT3_DIRECT = "kp_arch_int3_bp"


def _direct_calls(image, callers, callee: int | None) -> list[int]:
    """The `call callee` instructions in the functions named in `callers`
    (decoded, not scanned), sorted."""
    if callee is None:
        return []
    from ....arch import get_arch
    arch = get_arch(image.machine)
    out = []
    for g in (g for g in image.functions if g.name in callers):
        d = arch.decode_function(image.read(g.start, g.end - g.start), g.start)
        out += [src for target, src in d.branches if target == callee and image.read(src, 1) == b"\xe8"]
    return sorted(out)


def _call_patch(addr: int, target: int) -> tuple[int, bytes]:
    """A `call rel32` at addr sent to target."""
    return addr, b"\xe8" + struct.pack("<i", target - (addr + 5))


def int3_callers(image) -> list[int]:
    """The `call kprobe_int3_handler` instructions in INT3_CALLERS."""
    if not hasattr(image, "_int3_callers"):
        f = next((f for f in image.functions if f.name == INT3_HOOK[0]), None)
        image._int3_callers = _direct_calls(image, INT3_CALLERS, f.start if f is not None else None)
    return image._int3_callers


# The early #BP: until setup_arch()'s idt_setup_early_traps(), an int3 goes through the early
# IDT (head_64.S early_idt_handler_array -> early_idt_handler_common), whose
# do_early_exception() halts on it: a breakpoint site the kernel runs that early (the first
# printk()'s timestamp: sched_clock_cpu(), local_clock()) hung the boot.  Its `call
# do_early_exception` calls kp_kernel_early_exception(regs, trapnr) instead, which runs the
# probed instruction of an int3 of ours (no handlers: the tables do not exist yet, the hit
# counts in kp_early_hits) and passes every other exception on (kp_int3_hook.c).
EARLY_HOOK = ("early_idt_handler_common", "do_early_exception", "kp_kernel_early_exception")


def early_int3_callers(image) -> list[int]:
    """The `call do_early_exception` in early_idt_handler_common."""
    if not hasattr(image, "_early_int3_callers"):
        target = image.symbols.get(EARLY_HOOK[1])
        image._early_int3_callers = _direct_calls(image, (EARLY_HOOK[0],), target[0] if target else None)
    return image._early_int3_callers


def breakpoint_hook_patches(image, blob):
    """The calls the int3 hooks write (the hook's ftrace site, do_int3()'s and the early
    IDT's calls), and the ftrace sites (McountLoc) they take from ftrace."""
    m = int3_hook(image)
    entry, direct, early = blob.symbols[INT3_HOOK[1]], blob.symbols[INT3_DIRECT], blob.symbols[EARLY_HOOK[2]]
    return [_call_patch(m.site, entry)] + [_call_patch(a, direct) for a in int3_callers(image)] + \
        [_call_patch(a, early) for a in early_int3_callers(image)], [m]


def int3_diff(image) -> list[tuple[int, int, str]]:
    """What `kprewrite diff` finds the int3 hooks changed (an image with breakpoint sites)."""
    hook = int3_hook(image)
    if hook is None:
        return []
    return [(image.offset_of(hook.site), 5, f"{INT3_HOOK[0]}'s ftrace site: call {INT3_HOOK[1]} (the int3 hook)"),
            (hook.entry_offset, 8, f"__mcount_loc entry of the ftrace site {hook.site:#x} dropped (the int3 hook)")] + \
        [(image.offset_of(a), 5, f"{symbol_at(image, a)}: call {INT3_DIRECT}, not {INT3_HOOK[0]} "
          "(the int3 hook)") for a in int3_callers(image)] + \
        [(image.offset_of(a), 5, f"{symbol_at(image, a)}: call {EARLY_HOOK[2]}, not {EARLY_HOOK[1]} "
          "(the early int3 hook)") for a in early_int3_callers(image)]
