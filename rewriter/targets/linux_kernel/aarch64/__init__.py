"""Linux on arm64: what the kernel target (..) asks of the architecture (archbase.KernelArch),
as arch/arm64 answers it in the kernel.

- image.py: the boot Image (Debian's vmlinuz), read and seen as an ELF vmlinux (unwrap());
- sites.py: the tables and ranges the rules read (the ftrace NOPs, NOKPROBE_SYMBOL, the
  blacklisted sections, and the tables of relative entries tables.py finds in an Image);
- target.py: the kernel target's variant for arm64 (linux_kernel.for_arch()), whose answers
  to the back half's steps build.py gives: the handlers and the detours in the Image's own
  room, until the generic back half (the runtime, its boot hooks and tables) knows arm64;
- runtime.py: the part of the generic runtime an arm64 Image has (the debugfs views, the trace
  events), linked
  as one blob kept in the boot-only data and placed in module memory at boot.  The members below that
  only the generic back half asks (the per-CPU key, the boot container) answer what arm64
  has, or say it is not written yet.
"""
from __future__ import annotations

from . import sites  # noqa: F401

# arm64's registration refusals (check_kprobe_address_safe(), arch_prepare_kprobe()), by table.
REGISTER_REASONS = {
    ".entry.text": "in .entry.text (entry code, arch_populate_kprobe_blacklist)",
    ".irqentry.text": "in .irqentry.text (arch_populate_kprobe_blacklist)",
    ".idmap.text": "in .idmap.text (runs on the identity map, arch_populate_kprobe_blacklist)",
    ".hyp.text": "in .hyp.text (runs at EL2, arch_populate_kprobe_blacklist)",
    ".hyp.idmap.text": "in .hyp.idmap.text (runs at EL2 on the identity map, arch_populate_kprobe_blacklist)",
    ".head.text": "in .head.text (before _stext: not kernel text)",
    "ftrace_location": "ftrace site (ftrace_location(); arm64 has no KPROBES_ON_FTRACE)",
    ".altinstructions": "alternatives site (patched at boot)",
    "__ex_table": "exception table entry (search_exception_tables() in arch_prepare_kprobe)",
}
FUNCTION_RANGES = ()
# A probe on a function's entry goes past its two ftrace NOPs (-fpatchable-function-entry=2):
# ftrace_init_nop() rewrites the first at boot whatever it holds, so the site is never taken
# (Rules.share_ftrace, take_ftrace).
SHARE_FTRACE = 8
TAKE_FTRACE = False
# A kretprobe swaps x30 at the entry for the trampoline (arch_prepare_kretprobe()), before the
# function's paciasp signs it: its exits are not hooked (build.py's kretprobe_c()).
KRETPROBE_EXITS = False
# A glob's probes (symbol_name = "*": 37,763 ftrace sites) go through one ftrace_ops registered at
# boot (build.py: ftrace_ops_c()); ~54 KiB of text padding holds no detour per function.
FTRACE_OPS_GLOBS = True
RETURN_SITES = ""                       # no table of returns patched at boot on arm64


def function_refusal(image, k, arch, returns):
    return lambda analysis, func: None


def breakpoint_hook(image):
    return None                         # no BRK probes yet


def breakpoint_hook_patches(image, blob):
    return [], []


def return_site_patches(image, layout, rx, plan):
    return []


def diff_expected(image, meta: dict) -> list:
    return []


PREEMPT_H = ""


def thread_key(image):
    from ....errors import KprewriteError
    raise KprewriteError(f"{image.path}: the runtime's per-CPU data is not written for arm64 kernels yet")


def resched(image) -> str | None:
    return "preempt_schedule"           # what preempt_enable() calls (CONFIG_PREEMPTION's)


def current_tasks(symbols) -> list:
    """arm64 keeps the current task in sp_el0 (get_current()), not in per-CPU data: a name
    for it, which current_c() does not need."""
    return [("sp_el0", None)]


def current_c(decl: str, ctype: str, current: str) -> str:
    return f"{decl}\n{{\n\t{ctype} *t;\n\tasm(\"mrs %0, sp_el0\" : \"=r\"(t));\n\treturn t;\n}}\n"


def tail_call_c(name: str, target: str) -> str:
    return f"__attribute__((naked)) void {name}(void)\n{{\n\tasm volatile(\"b {target}\");\n}}\n"


def write_container(image, arch, layout, rx, patches, blob, plan, zeroed: list, vmlinux: bytes) -> bytes:
    from ....errors import KprewriteError
    raise KprewriteError(f"{image.path}: an arm64 Image is written by aarch64/build.py's write() step")


def unwrap(data: bytes, path: str):
    """(the Image's ELF view, the Image) when data is an arm64 Image, or an ELF vmlinux (read
    as the Image objcopy makes of it, and written back into it: image.ElfVmlinux), else None."""
    from . import image as arm_image
    if arm_image.is_image(data):
        img = arm_image.parse(data, path)
        return img.vmlinux, img
    elf = arm_image.elf_vmlinux(data, path)
    if elf is not None:
        img = arm_image.parse(elf.image(), path)
        img.elf = elf
        return img.vmlinux, img
    return None
