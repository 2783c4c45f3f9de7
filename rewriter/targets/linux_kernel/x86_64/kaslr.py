"""KASLR: the x86 relocation table of a rewritten kernel.

A bzImage's decompressor moves the kernel to a random virtual base and adds the
offset to every absolute address listed in the table that arch/x86/tools/relocs
appended to the vmlinux (handle_relocations() in arch/x86/boot/compressed/misc.c:
32-bit values, then inverse 32-bit values, then 64-bit values, each list read
backwards from the end of the decompressed payload).  The rewritten kernel's
table is the original one

- without the entries of bytes the rewrite replaced (the jump at an optimized
  probe, the int3 filling the rest of its region, a __mcount_loc entry zeroed for
  an ftrace-site probe: 0 must stay 0, ftrace skips it),
- with the entries of the instructions copied into detours and out-of-line slots
  moved to the copies (a copied `mov $sym, %reg` holds the same absolute address),
- plus an entry for every absolute address the linked runtime and handlers hold
  (ld --emit-relocs), by relocs.c's own rules: R_X86_64_64 -> 64-bit list,
  R_X86_64_32/32S -> 32-bit list, a PC-relative reference to a per-CPU symbol ->
  inverse 32-bit list; references to per-CPU symbols (offsets from %gs, linked at
  0) and to plain numbers are not relocated.

Addresses in the generated tables (a struct kprobe's addr) are written as
`_text + offset` (../symbols.address_c()) so that the linker relocates them too: a handler
printing p->addr prints the randomized address.  The runtime's load bias
(kp_rt.bias, 0 as linked) gets a 64-bit entry of its own, so the decompressor
makes it the KASLR offset: what the runtime adds to a fetch arg's @SYM and
subtracts before looking an address up in its symbol table, as for a PIE.
"""
from __future__ import annotations

import bisect
from array import array

from ....emit import emission
from .... import link
from ....arch.base import EMULATE
from ....errors import KprewriteError
from ..symbols import KERNEL_HALF, PT_LOAD, kernel_range
from .bzimage import RelocTable

R_X86_64_64, R_X86_64_PC32, R_X86_64_PLT32, R_X86_64_32, R_X86_64_32S, R_X86_64_PC64 = 1, 2, 4, 10, 11, 24
HIGH = 0xFFFFFFFF00000000           # a table entry is the address's low 32 bits, sign-extended
# Re-encoded in a detour (rewriter/arch/x86_64/emit.relocate): their bytes change shape.
REENCODED = ("jmp rel", "jcc rel", "call rel")


def percpu_range(image) -> tuple[int, int]:
    """The per-CPU segment (linked at 0: its symbols are %gs offsets, never relocated)."""
    loads = [s for s in image.segments if s.type == PT_LOAD and s.vaddr < KERNEL_HALF]
    return (min(s.vaddr for s in loads), max(s.vaddr + s.memsz for s in loads)) if loads else (0, 0)


def _entries(lst: array) -> set[int]:
    return {HIGH | v for v in lst}


def relocation_table(image, arch, layout, rx: bytes, patches, blob, plan, zeroed: list[int]) -> RelocTable:
    """The rewritten kernel's table (see the module's docstring).  zeroed: addresses of
    the 64-bit words the rewrite set to 0 (__mcount_loc entries)."""
    old = image.container.relocs
    path = image.path
    lo, hi = kernel_range(image)
    pc_lo, pc_hi = percpu_range(image)
    r64, r32neg, r32 = _entries(old.relocs64), _entries(old.relocs32neg), _entries(old.relocs32)
    lists = ((r64, 8), (r32neg, 4), (r32, 4))
    gaps = [(layout.rx_vaddr, layout.target.end, "text/rodata")]
    if hasattr(layout.target, "data_vaddr"):
        gaps.append((layout.target.data_vaddr, layout.target.data_end, "rodata/data"))
    for lst, _ in lists:
        for start, end, what in gaps:
            if any(start <= e < end for e in lst):
                raise KprewriteError(f"{path}: the relocation table has entries in the {what} gap "
                                     f"{start:#x}..{end:#x}: it is not free space")

    ordered = [(lst, width, sorted(lst)) for lst, width in lists]

    def overlapping(start: int, end: int):
        """Entries of the original table whose bytes overlap [start, end)."""
        for lst, width, keys in ordered:
            i = bisect.bisect_left(keys, start - width + 1)
            while i < len(keys) and keys[i] < end:
                yield lst, keys[i]
                i += 1

    # Copies of the replaced instructions: where each DCR instruction landed in its detour.
    copies = _copies(image, arch, plan, rx, layout, blob)
    for addr, code in patches:
        for lst, e in list(overlapping(addr, addr + len(code))):
            lst.discard(e)
    for insn, at, copy in copies:
        for lst, e in list(overlapping(insn.addr, insn.addr + len(insn.code))):
            lst.add(_moved(path, insn, at, copy, e, lst is r32neg, 8 if lst is r64 else 4))
    # An emulated breakpoint site reads its operands from a descriptor linked at the image's
    # addresses (the runtime adds the KASLR offset to targets, never to an absolute
    # displacement): an absolute operand KASLR relocates cannot be emulated.
    for site in plan.sites:
        x = site.xol
        if x is not None and x.mode == "emulate" and not x.rip and any(
                lst is not r32neg for lst, _ in overlapping(x.insn.addr + 1, x.insn.addr + len(x.insn.code))):
            raise KprewriteError(f"{path}: the breakpoint probe's instruction at {x.insn.addr:#x} has an absolute operand "
                                 "that KASLR relocates, and is emulated: use a vmlinux, or probe another instruction")
    for z in zeroed:
        r64.discard(z)
    for r in blob.relocations:
        percpu = r.absolute and pc_lo <= r.value < pc_hi and not lo <= r.value < hi
        moves = not percpu and (not r.absolute or lo <= r.value < hi)
        if r.type == R_X86_64_64:
            if moves:
                r64.add(r.offset)
        elif r.type in (R_X86_64_32, R_X86_64_32S):
            if moves:
                r32.add(r.offset)
        elif r.type in (R_X86_64_PC32, R_X86_64_PLT32):
            if percpu:      # the distance from moving code to a per-CPU offset changes
                r32neg.add(r.offset)
        elif r.type == R_X86_64_PC64:
            if percpu:
                raise KprewriteError(f"{path}: R_X86_64_PC64 against the per-CPU symbol {r.symbol} at {r.offset:#x} "
                                     "(relocs.c refuses it too)")
        else:
            raise KprewriteError(f"{path}: the linked runtime and handlers hold relocation type {r.type} against "
                                 f"{r.symbol or 'a section'} at {r.offset:#x}, which KASLR cannot relocate")
    r64.add(blob.symbols["kp_rt"] + link.asm_offsets(arch, "linux_kernel")["RT_BIAS"])
    for lst, _ in lists:
        for e in lst:
            if not lo <= e < hi:
                raise KprewriteError(f"{path}: KASLR relocation at {e:#x} is outside the kernel image")
    return RelocTable(*(array("I", sorted(e & 0xFFFFFFFF for e in lst)) for lst, _ in lists))


def _moved(path: str, insn, at: int, copy: bytes, e: int, inverse: bool, width: int) -> int:
    """Where the relocated field at `e` of DCR instruction `insn` is in its copy (`copy`, at
    `at`).  The copy ends with the instruction re-encoded at the same length (itself, its
    RIP-relative displacement moved, or a call's operand as a jmp's after the pushed return
    address); an absolute field keeps its bytes there, an inverse one is the displacement."""
    pos = at + len(copy) - len(insn.code) + (e - insn.addr)
    k = pos - at
    fail = None
    if insn.info.emulate in REENCODED or len(copy) < len(insn.code):
        fail = "is re-encoded in its detour"
    elif inverse and not insn.info.rip_relative:
        fail = "is not RIP-relative"
    elif not inverse and copy[k:k + width] != insn.code[e - insn.addr:e - insn.addr + width]:
        fail = "does not keep its operand bytes in its detour"
    if fail:
        raise KprewriteError(f"{path}: the instruction at {insn.addr:#x} has a KASLR relocation at {e:#x} and {fail}")
    return pos


def _copies(image, arch, plan, rx: bytes, layout, blob):
    """(DCR instruction, address of its copy, the copy) of every detoured site, found by
    emitting each detour again with a recording copy and checking it is the one written."""
    from ....planner import BREAKPOINT
    from .percpu import thread_key
    em = arch.emit
    # The short stubs (emission.site_detour()), as the thread key says; asked only where a
    # detour exists (an image with none need not have the per-CPU symbols).
    short = any(s.decision != BREAKPOINT for s in plan.sites) and not thread_key(image).red_zone
    out = []
    for site in plan.sites:
        if site.decision == BREAKPOINT:
            # A boosted or single-stepped instruction's copy in its out-of-line slot.
            if site.xol.mode != EMULATE:
                slot = layout.xol[site.index].addr
                copy = em.relocate(site.xol.insn, slot)
                off = slot - layout.rx_vaddr
                if bytes(rx[off:off + len(copy)]) != copy:
                    raise KprewriteError(f"{image.path}: internal error: the out-of-line slot at {slot:#x} "
                                         "is not the one whose copy KASLR relocates")
                out.append((site.xol.insn, slot, copy))
            continue
        if site.template or (site.ret_hooks and any(g.ret_template for g, _ in site.ret_hooks.values())):
            raise KprewriteError(f"{image.path}: internal error: KASLR tables for a templated detour at {site.addr:#x}")
        # Exits of a return-probed function in the region call their return hook first
        # (retprobe.hook_copy()); the hook call and the exit hold no absolute address.
        hooks = {a: emission.hook_targets(g, kind, blob.symbols) for a, (g, kind) in site.ret_hooks.items()}
        entries = emission.detour_entries(site, short)
        seen = []

        def record(insn, at, seen=seen, hooks=hooks):
            if insn.addr in hooks:
                return arch.retprobe.hook_then_exit(insn, hooks[insn.addr], at)
            copy = em.relocate(insn, at)
            seen.append((insn, at, copy))
            return copy
        detour = layout.detour(site)
        code, _, _ = em.detour(site.index, site.dcr, site.with_post, detour, blob.symbols[entries[0]],
                               blob.symbols[entries[1]], record, short=short)
        off = detour - layout.rx_vaddr
        if bytes(rx[off:off + len(code)]) != code:
            raise KprewriteError(f"{image.path}: internal error: the detour at {detour:#x} is not the one "
                                 "whose copies KASLR relocates")
        out += seen
    for rs in plan.ret_sites:
        # A return site's detour: its region's instructions before the exit, copied in
        # order (the hook call and the exit after them hold no absolute address).
        detour = layout.detour(rs)
        pos, seen = detour, []
        for insn in rs.dcr[:-1]:
            copy = em.relocate(insn, pos)
            seen.append((insn, pos, copy))
            pos += len(copy)
        off = detour - layout.rx_vaddr
        if any(bytes(rx[at - layout.rx_vaddr:at - layout.rx_vaddr + len(cp)]) != cp for _, at, cp in seen) \
                or pos - detour > layout.sizes[("ret", rs.addr)] or off < 0:
            raise KprewriteError(f"{image.path}: internal error: the return site's detour at {detour:#x} is not "
                                 "the one whose copies KASLR relocates")
        out += seen
    return out
