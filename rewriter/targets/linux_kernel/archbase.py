"""What the kernel target asks of an architecture (a folder here named as the arch's
back end in rewriter/arch/, e.g. x86_64/; symbols.arch_of() picks it by the image's
arch name), as targets.base.Target is for targets.  An arm64 kernel is an arm64/ folder
beside x86_64/ with these members; the generic modules here name no instruction,
register, relocation or boot protocol of any architecture."""
from __future__ import annotations

from typing import Any, Callable, Protocol


class KernelArch(Protocol):
    # --- reading the image (reserved.py) ---
    sites: Any                         # its tables: a KernelImage subclass naming the
                                       # architecture's tables and ranges, kernel_sites()
    REGISTER_REASONS: dict             # table -> why registration refuses its sites
    FUNCTION_RANGES: tuple             # tables refused function by function, never patched
    RETURN_SITES: str                  # the table of returns patched at boot (rules.return_jumps)
    SHARE_FTRACE: int                  # the ftrace site's bytes a probe's jump goes past (rules.share_ftrace)
    TAKE_FTRACE: bool                  # where it cannot, the jump may take the site (rules.take_ftrace)
    FTRACE_OPS_GLOBS: bool             # globs reach ftrace's functions through an ftrace_ops (rules)
    KRETPROBE_EXITS: bool              # kretprobes hook every exit (rules.kretprobe_exits), or swap
                                       # the return address at entry for the trampoline, as the kernel's

    def function_refusal(self, image, k, arch, returns) -> Callable:
        """(analysis, func) -> arch.Refusal or None: a function not jump-optimized."""

    def breakpoint_hook(self, image) -> Any:
        """Where the runtime hooks the kernel's breakpoint path, or None (no breakpoint probes)."""

    # --- the generated C (generated_c.py, btf.py) ---
    PREEMPT_H: str                     # linux/preempt.h for handlers

    def thread_key(self, image) -> Any:
        """arch.base.ThreadKey: how detours find the running CPU."""

    def resched(self, image) -> str | None:
        """What preempt_enable() calls on a pending reschedule, or None."""

    def current_tasks(self, symbols) -> list:
        """Where the current task pointer is: (per-CPU variable, member or None), first choice first."""

    def current_c(self, decl: str, ctype: str, current: str) -> str:
        """C: the function `decl` returning the current task as a `ctype *`."""

    def tail_call_c(self, name: str, target: str) -> str:
        """C: `void name(void)`, a jump to the kernel's `target`."""

    # --- the output (writer.py) ---
    def breakpoint_hook_patches(self, image, blob) -> tuple[list, list]:
        """(patches, McountLoc of the ftrace sites they take) hooking the breakpoint path."""

    def return_site_patches(self, image, layout, rx, plan) -> list:
        """Patches pointing the boot-patched returns' table entries at their copies."""

    def diff_expected(self, image, meta: dict) -> list:
        """What `kprewrite diff` may find the architecture's patches changed."""

    def unwrap(self, data: bytes, path: str) -> Any:
        """(vmlinux bytes, container) when data is the architecture's boot image, else None."""

    def write_container(self, image, arch, layout, rx, patches, blob, plan, zeroed: list, vmlinux: bytes) -> bytes:
        """The boot image around the rewritten vmlinux (with its KASLR table)."""
