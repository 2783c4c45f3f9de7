"""Linux on x86-64: what the kernel target (..) asks of the architecture, as
arch/x86/boot and arch/x86/kernel answer it in the kernel.  Selected by the image's
arch name (symbols.arch_of()); an arm64 kernel is a folder beside this one with the
same members:

- sites: the tables (a KernelImage subclass naming x86's, kernel_sites(), ...);
- REGISTER_REASONS, FUNCTION_RANGES, RETURN_SITES, function_refusal(): the rules' part;
- breakpoint_hook(), breakpoint_hook_patches(), return_site_patches(), diff_expected(): the patches
  the write adds (traps.py, returns.py);
- thread_key(), resched(), current_tasks(), current_c(), tail_call_c(), PREEMPT_H: the per-CPU data
  the generated code reads (percpu.py);
- unwrap(), write_container(): the boot image around the vmlinux (bzImage: bzimage.py,
  bzimage_write.py, and its KASLR table, kaslr.py)."""
from __future__ import annotations

from . import sites  # noqa: F401
from .percpu import PREEMPT_H, current_c, current_tasks, resched, tail_call_c, thread_key  # noqa: F401
from .returns import RETURN_SITES, return_jumps, return_site_diff, return_site_patches  # noqa: F401
from .traps import breakpoint_hook_patches, int3_diff, int3_hook as breakpoint_hook  # noqa: F401

# x86's registration refusals (check_kprobe_address_safe(), arch_prepare_kprobe()), by table.
REGISTER_REASONS = {
    ".entry.text": "in .entry.text (entry code)",
    ".static_call.text": "static call trampoline (static_call_text_reserved)",
    ".head.text": "in .head.text (runs before per-CPU setup, on the early identity mapping)",
    ".static_call_sites": "static call site (static_call_text_reserved)",
    ".altinstructions": "alternatives site (alternatives_text_reserved)",
    "__x86_thunks": "retpoline/return thunk (every return and indirect branch runs it, the probe's own)",
    "__x86_no_percpu_base": "runs with GS base 0 (load_percpu_segment()): a probe reads per-CPU data",
}
# A probe on a function's ftrace site (the 5-byte `call __fentry__`) leaves the site to ftrace
# and jumps after it, so the kernel's own function tracer, kprobes and BPF keep working on the
# function (Rules.share_ftrace); where it cannot, the jump takes the site, the nop it is untraced.
SHARE_FTRACE = 5
TAKE_FTRACE = True
FTRACE_OPS_GLOBS = False                # a glob takes each site (the gaps hold it)
KRETPROBE_EXITS = True                  # every exit hooked (the user-space design)
# Refused function by function, with the function's name (never patched at boot).
FUNCTION_RANGES = (".head.text", "__x86_thunks", "__x86_no_percpu_base")


def function_refusal(image, k, arch, returns):
    """x86's refusal of a jump-optimized function (can_optimize()): a jump through a
    retpoline thunk is an indirect jump (insn_is_indirect_jump()); a `jmp
    __x86_return_thunk` at a .return_sites entry (`returns`) is a return, a call is a call."""
    thunks = sites.indirect_thunk_range(k)

    def refusal(analysis, func):
        if thunks is not None:
            for target, src in analysis.decoded(func).branches:
                if thunks[0] <= target < thunks[1] and src not in returns and image.read(src, 1) != b"\xe8":
                    return arch.Refusal("indirect_jump", src, f"{func.name} jumps through a retpoline thunk "
                                        "(an indirect jump)")
        return None
    return refusal


def diff_expected(image, meta: dict) -> list[tuple[int, int, str]]:
    """What `kprewrite diff` may find x86's patches changed: the .return_sites entries
    pointed at their copies, and, with breakpoint sites, the int3 hooks."""
    out = return_site_diff(image, meta)
    if any(p.get("int3") for p in meta["probes"]):
        out += int3_diff(image)
    return out


def unwrap(data: bytes, path: str):
    """(vmlinux, bzImage) when data is a bzImage, else None."""
    from . import bzimage
    if bzimage.is_bzimage(data):
        b = bzimage.parse(data, path)
        return b.vmlinux, b
    return None


def write_container(image, arch, layout, rx, patches, blob, plan, zeroed: list[int], vmlinux: bytes) -> bytes:
    """A bzImage: the vmlinux back in its decompressor, with its KASLR table (kaslr.py)."""
    from . import bzimage_write, kaslr
    table = None if image.container.relocs is None else \
        kaslr.relocation_table(image, arch, layout, rx, patches, blob, plan, zeroed)
    return bzimage_write.build(image.container, vmlinux, table, image.path)
