"""Stacks that unwind through probes in a kernel: the target's part of the generated C
for it (docs/kernel.md, "Stacks through probes").

The kernel's ORC unwinder has no entry for our code in the text/rodata gap and takes it,
as it takes BPF's, as code that keeps a frame pointer (orc_fp_entry).  So the runtime and
handlers keep %rbp chains (recipe.py: -fno-omit-frame-pointer), the asm entries point %rbp
at a frame record whose return address is the probed instruction + 1 (the arch's
linux_kernel/kp_platform_asm.h, KP_UNWIND_FRAME), and the runtime registers the code as a
BPF image is registered (runtime/platform/linux_kernel/kp_unwind.c: bpf_ksym_add()), so
that the stack printer and stack_trace_save() take its addresses as kernel text.  What this
module gives the runtime is struct bpf_ksym's layout, from the image's BTF."""
from __future__ import annotations

from ... import cache
from . import btf
from .symbols import link_symbols

LAYOUT = b"kprewrite-bpf-ksym-1"


def bpf_ksym_layout(image) -> tuple[int, int]:
    """(offsetof(struct bpf_ksym, lnode), sizeof(struct bpf_ksym)) from the image's BTF,
    cached by its contents; (-1, -1) without BTF or the type (no registration: the
    stack printer then stops at our first frame, as it did)."""
    sec = image.section_named(".BTF")
    if sec is None:
        return -1, -1
    data = image.data[sec.offset:sec.offset + sec.size]
    k = cache.key(LAYOUT, data)
    hit = cache.get("btf-bpf-ksym", k)
    if hit is not None:
        lnode, size = map(int, hit.decode().split())
        return lnode, size
    types = btf.parse(data, image.path)
    lnode, size = btf.member_offset(types, "bpf_ksym", "lnode"), btf._sizeof(types, "bpf_ksym")
    if lnode is None or size is None or btf.member_offset(types, "bpf_ksym", "name") != 16:
        lnode, size = -1, -1
    cache.put("btf-bpf-ksym", k, f"{lnode} {size}".encode())
    return lnode, size


def unwind_c(image) -> str:
    """C for runtime/platform/linux_kernel/kp_unwind.c: struct bpf_ksym's layout and
    bpf_ksym_add(), or none (a kernel built without BPF: its stacks stop at our first
    frame, as they did, and the image still links)."""
    lnode, size = bpf_ksym_layout(image)
    if lnode < 0 or link_symbols(image).get("bpf_ksym_add") is None:
        return ("const long kp_kernel_bpf_ksym[2] = { -1, -1 };\n"
                "void (*const kp_kernel_bpf_ksym_add)(void *) = 0;\n")
    return (f"const long kp_kernel_bpf_ksym[2] = {{ {lnode}, {size} }};\n"
            "void bpf_ksym_add(void *);\nvoid (*const kp_kernel_bpf_ksym_add)(void *) = bpf_ksym_add;\n")
