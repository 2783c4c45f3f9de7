"""The module target's arm64 rules (linux_module.rules() has the kernel's, read from the module's own
tables by linux_kernel/aarch64/sites.py, and the init sections'): jump-optimized probes only, each
displaced instruction's copy carrying the .ko's relocations (writer.py's copy())."""
from __future__ import annotations


def adjust(image, arch, r) -> None:
    """The arm64 module's part of its rules, set on r."""
    r.region_refusal = carried(image, r.region_refusal)
    # No breakpoint probes: the kernel's arm64 kprobes are BRKs taken by its break hooks, and
    # register_kernel_break_hook() is not exported to modules (an unclaimed BRK at EL1 reaches die
    # notifiers only as an oops, DIE_OOPS, not as x86's DIE_INT3): a site no jump fits is refused, naming
    # the check.
    r.breakpoints = False


def carried(image, inner):
    """Rules.region_refusal() for an arm64 module: the kernel's checks (inner), then whether the
    displaced instruction's copy can be written (writer.copy(); `module_relocation`), so that
    `check` names what `instrument` would refuse."""
    from ....arch.base import DcrInsn
    from ....arch.aarch64 import insn as I
    from ..ko import relocations
    from . import writer

    def refusal(arch, analysis, func, lo, hi):
        why = inner(arch, analysis, func, lo, hi) if inner is not None else None
        if why is not None:
            return why
        mod = image.container
        relocs = relocations(mod)
        for pos in range(lo, hi, 4):
            code = image.read(pos, 4)
            try:
                writer.copy(mod, relocs, DcrInsn(pos, code, I.classify(code, pos)))
            except writer.CopyRefused as e:
                return arch.Refusal(*e.args)
        return None
    return refusal
