"""How a rewritten kernel image is written: the vmlinux in place (the probes' jumps, the
dropped __mcount_loc entries of the ftrace sites we took, our code and data in the gaps,
the metadata section), then, for an image that came in a boot container (x86's
bzImage), the container around it (the architecture's write_container())."""
from __future__ import annotations

import struct

from ...elf.write import NewSection, append_section_headers
from ...errors import KprewriteError
from ...planner import BREAKPOINT
from ...emit.meta import META_SECTION
from . import sites as ks
from .gap import extend_first_load
from .symbols import arch_of, kernel


def before_link(image, arch, layout, plan) -> None:
    """Nothing: what a kernel's write() adds is made from the linked runtime."""
    return None


def write(image, arch, layout, rx: bytearray, patches, blob, metadata: bytes, plan, early=None) -> bytes:
    """The vmlinux with the probes' jumps, the dropped __mcount_loc entries of the ftrace
    sites we took, our code and data in the gap, and the metadata section."""
    kern = arch_of(image)
    k, gap = kernel(image), layout.target
    code_end, data_end = blob.text_addr + len(blob.text), blob.data_addr + blob.data_memsz
    if code_end > gap.end or data_end > gap.data_end:
        raise KprewriteError(f"{image.path}: the probes need {(code_end - gap.rx_vaddr) >> 10} KiB of code and "
                             f"{(data_end - gap.data_vaddr) >> 10} KiB of data; the text/rodata gap has "
                             f"{(gap.end - gap.rx_vaddr) >> 10} KiB and the rodata/data gap {(gap.data_end - gap.data_vaddr) >> 10} KiB")
    out = bytearray(image.data)
    offset_of = extend_first_load(image, out, gap.data_vaddr, data_end)
    hooked = []         # the ftrace sites the breakpoint hooks take, when there are breakpoint sites
    # A breakpoint site whose probes all come from globs keeps its instruction in the image:
    # the runtime writes the breakpoint at the sched_init_smp() boot hook (kp_arch_arm_breakpoints(), as
    # arch_arm_kprobe() at registration), once every CPU is up.  A glob reaches code no one
    # chose, some of it run where a CPU has no IDT yet (Xen PVH's entry, a CPU coming up);
    # a probe named exactly is armed in the image, from the first instruction on.
    unarmed = {site.addr for site in plan.sites
               if site.decision == BREAKPOINT and all(p.from_glob for p in site.probes)}
    patches = [(addr, code) for addr, code in patches if addr not in unarmed]
    if any(site.decision == BREAKPOINT for site in plan.sites):
        hook_patches, hooked = kern.breakpoint_hook_patches(image, blob)
        patches = list(patches) + hook_patches
    patches = list(patches) + kern.return_site_patches(image, layout, rx, plan)
    for addr, code in patches:
        off = image.offset_of(addr)
        out[off:off + len(code)] = code
    mcount = {m.site: m for m in ks.mcount_locs(k)}
    # The ftrace sites a jump took (not those shared with ftrace, Site.jump_at).
    taken = [mcount[site.addr] for site in plan.sites if site.decision == "ftrace" and not site.jump_at]
    for m in taken + hooked:
        out[m.entry_offset:m.entry_offset + 8] = bytes(8)     # ftrace neither patches nor checks it any more
    code = bytes(rx) + blob.text
    off = image.offset_of(layout.rx_vaddr)
    out[off:off + len(code)] = code
    doff = offset_of(blob.data_addr)
    out[doff:doff + len(blob.data)] = blob.data
    zeroed = [m.entry for m in taken + hooked]
    sections = [NewSection(".kprewrite.text", 1, 6, layout.rx_vaddr, code),
                NewSection(".kprewrite.data", 8 if not blob.data else 1, 3, blob.data_addr, blob.data, blob.data_memsz),
                NewSection(META_SECTION, 1, 0, 0, metadata, align=1)]
    shoff, shnum, shstrndx = append_section_headers(out, image, sections, lambda s: offset_of(s.addr))
    struct.pack_into("<Q", out, 40, shoff)
    struct.pack_into("<H", out, 60, shnum)
    struct.pack_into("<H", out, 62, shstrndx)
    if image.container is None:
        return bytes(out)
    return kern.write_container(image, arch, layout, rx, patches, blob, plan, zeroed, bytes(out))


def diff_expected(image, meta: dict) -> list[tuple[int, int, str]]:
    """What `kprewrite diff` may find changed besides the probe sites and the gap
    our code fills: the __mcount_loc entry of each ftrace site a probe took
    (write() zeroes it, so ftrace neither patches nor checks the site), and what the
    architecture's patches changed."""
    taken = {p["addr"]: p["name"] for p in meta["probes"] if p.get("ftrace") and not p.get("jump_at")}
    out = [(m.entry_offset, 8, f"__mcount_loc entry of the ftrace site {m.site:#x} dropped ({taken[m.site]})")
           for m in ks.mcount_locs(kernel(image)) if m.site in taken] if taken else []
    return out + arch_of(image).diff_expected(image, meta)
