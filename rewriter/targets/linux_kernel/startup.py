"""How a rewritten kernel starts the runtime: no start-up stub (the runtime's tables are
ready statically), but probes the runtime needs on kernel functions, added to the spec
as any probe: the boot hooks (gap.py says why the gap's pages need keeping), the
shutdown hooks and, with kretprobes, the task hook."""
from __future__ import annotations

from ...probes.spec import KprobeSpec

# The boot hooks: (function, runtime pre_handler).
BOOT_HOOKS = (("setup_per_cpu_areas", "kp_kernel_alloc_cpus"),
              # The breakpoints of breakpoint sites from globs, once smp_init() has brought every CPU up
              # (platform.c, writer.py).
              ("sched_init_smp", "kp_kernel_arm_breakpoints"),
              ("set_memory_ro", "kp_kernel_keep_ro"), ("set_memory_nx", "kp_kernel_keep_nx"),
              ("free_kernel_image_pages", "kp_kernel_keep_free"),
              # kprewrite.enabled=0 on the command line, read in setup_arch() (kp_debugfs.c);
              # the debugfs views, once initcalls are done, before /init (kp_debugfs.c).
              ("parse_early_param", "kp_kernel_cmdline"), ("console_on_rootfs", "kp_kernel_debugfs"))

# The shutdown hooks: kprobe_profile (event, hits, nmissed) in the kernel log before power-off,
# restart or halt, the counters' last chance to be read (a kernel has no exit to write them at).
SHUTDOWN_HOOKS = (("kernel_power_off", "kp_kernel_profile"), ("kernel_restart", "kp_kernel_profile"),
                  ("kernel_halt", "kp_kernel_profile"))


# kprobe_flush_task(): with kretprobes, a task_struct being freed gives back the
# instances of frames it never returned from (kp_kretprobe_task.c).
KRET_HOOKS = (("free_task", "kp_kernel_kret_flush_task"),)


def runtime_probes(spec) -> None:
    """The boot and shutdown hooks: probes the runtime needs, added to the spec's kprobes."""
    for what, hooks in (("boot", BOOT_HOOKS), ("shutdown", SHUTDOWN_HOOKS),
                        ("kretprobe", KRET_HOOKS if spec.kretprobes else ())):
        for fn, handler in hooks:
            spec.kprobes.append(KprobeSpec(f"[kprewrite {what} hook {fn}]", fn, None, 0, handler, None, False,
                                           f"kprewrite_{fn}"))


RUNTIME_HANDLERS = frozenset(h for _, h in BOOT_HOOKS + SHUTDOWN_HOOKS + KRET_HOOKS)


def reserve_stubs(image, pos: int) -> tuple[dict[str, int], int]:
    """No start-up stub: the runtime's tables are ready statically, the boot hooks are probes."""
    return {}, pos
