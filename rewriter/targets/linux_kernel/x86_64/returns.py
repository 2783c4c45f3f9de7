"""x86's return thunks: a .return_sites entry (a `jmp __x86_return_thunk` apply_returns()
patches at boot) in a return region's detour."""
from __future__ import annotations

import struct

from ....errors import KprewriteError
from ..gap import plan_layout
from ..symbols import kernel, symbol
from . import sites as ks

RETURN_SITES = ".return_sites"      # the table of returns patched at boot


# apply_returns() (arch/x86/kernel/alternative.c) decodes the instruction each .return_sites
# entry points at, WARNs "missing return thunk" unless it is `jmp __x86_return_thunk`, and
# rewrites it with text_poke_early() (a memcpy: the kernel image is still writable then,
# before mark_rodata_ro()) to the chosen return (`ret; int3...` when X86_FEATURE_RETHUNK is
# off, a jmp to the chosen thunk when on).  A return region replaces that jump with ours,
# so its entry is pointed at the jump's copy in the detour: apply_returns() patches the copy
# the detour runs and never sees our jump.
JMP32 = 0xE9
STATIC_CALL_UD = b"\x0f\xb9\xcc"    # __static_call_fixup()'s tramp_ud: after it, a static-call trampoline


def return_site_patches(image, layout, rx, plan) -> list[tuple[int, bytes]]:
    """For each return region over a .return_sites site: (the entry's address, its new s32
    value, relative to itself, pointing at the `jmp __x86_return_thunk` copied at the end of
    the region's detour).  The copy lies in the text/rodata gap, mapped with .text's
    permissions until mark_rodata_ro() (writable when apply_returns() runs at boot); entries
    and copies are in the image, so KASLR moves both by the same offset and the relative
    entry needs no relocation."""
    rets = [rs for rs in plan.ret_sites if rs.exit.addr in return_jumps(image)]
    if not rets:
        return []
    entries = ks.return_site_entries(kernel(image))
    thunk = symbol(image, "__x86_return_thunk")
    gap = plan_layout(image)
    out = []
    for rs in rets:
        size = layout.sizes[("ret", rs.addr)]
        copy = layout.detour(rs) + size - 5
        off = copy - layout.rx_vaddr
        code = bytes(rx[off:off + 8])
        entry = entries[rs.exit.addr]
        if code[0] != JMP32 or copy + 5 + struct.unpack_from("<i", code, 1)[0] != thunk or code[5:8] == STATIC_CALL_UD:
            raise KprewriteError(f"{image.path}: internal error: the detour of the return site {rs.exit.addr:#x} "
                                 f"does not end with its `jmp __x86_return_thunk` at {copy:#x}")
        if not gap.rx_vaddr <= copy < gap.end:
            raise KprewriteError(f"{image.path}: internal error: the copy of the return site {rs.exit.addr:#x} at "
                                 f"{copy:#x} is outside the text/rodata gap (not writable by apply_returns())")
        d = copy - entry
        if not -(1 << 31) <= d < 1 << 31:
            raise KprewriteError(f"{image.path}: the .return_sites entry at {entry:#x} cannot reach the copy of "
                                 f"{rs.exit.addr:#x} at {copy:#x} (s32)")
        out.append((entry, struct.pack("<i", d)))
    return out


def return_jumps(image) -> set[int]:
    if not hasattr(image, "_return_jumps"):
        image._return_jumps = {r.start for r in ks.return_sites(kernel(image))}
    return image._return_jumps


def return_site_diff(image, meta: dict) -> list[tuple[int, int, str]]:
    """The .return_sites entries return_site_patches() pointed at their copies."""
    out, entries = [], None
    for p in meta["probes"]:
        for _, _, exit_addr in p.get("return_sites") or ():
            if exit_addr in return_jumps(image):
                entries = entries or ks.return_site_entries(kernel(image))
                out.append((image.offset_of(entries[exit_addr]), 4, f".return_sites entry of {exit_addr:#x} "
                            "pointed at its copy in the return site's detour"))
    return out
