"""The kernel target's part of the generated C: the tables' kernel facts (BTF offsets,
the current task, the gap's bounds, the per-CPU pool) and the headers handlers include
(the image's own types).  The architecture's part of it (how `current` and the preempt
count are read, how a reschedule is called) is its folder's percpu.py."""
from __future__ import annotations

from . import btf, unwind
from .gap import plan_layout
from .symbols import address_c, arch_of, link_symbols

# Per-CPU blocks (struct kp_thread and its hit counters) are taken on each CPU's first
# hit, never allocated in probe context: the boot CPU's first from a static block, every
# possible CPU's from memory the setup_per_cpu_areas() boot hook allocates (platform.c).
POOL_CPUS = 1

# The probe tables are built at boot (runtime/platform/linux_kernel/platform.c, at the
# setup_per_cpu_areas() hook, in memblock memory) from compact records: a probe on every
# function entry needs some 4 MiB of struct kprobe and struct kp_site, more than either gap.
TABLES_AT_BOOT = True
# symbol/symstr and return addresses in trace lines: the running kernel's sprint_symbol()
# (runtime/platform/linux_kernel/kp_trace_buffer.c); a table of every function would not
# fit the gap, and kallsyms knows the KASLR base.
RUNTIME_KALLSYMS = True


def thread_key(image):
    """The runtime's "thread" in a kernel is the CPU (preemption off while handlers
    run, as the kernel's current_kprobe is per-CPU): how the architecture finds it."""
    return arch_of(image).thread_key(image)


def tables_c(image, arch, any_breakpoint: bool) -> str:
    """struct task_struct's comm and pid (BTF) and the current task, for trace lines; the
    tracing structures (BTF) our events' output types need; the
    gap's bounds (the boot hooks); the per-CPU blocks' pool, sized from the probe tables
    generated before this part."""
    kern = arch_of(image)
    lay = plan_layout(image)
    kt = _types(image)
    task = ("const long kp_kernel_task_comm = -1, kp_kernel_task_pid = -1;\n"
            "char *kp_kernel_current(void) { return 0; }\n") if kt is None else (
        f"const long kp_kernel_task_comm = {kt.comm if kt.comm is not None else -1}, "
        f"kp_kernel_task_pid = {kt.pid if kt.pid is not None else -1};\n"
        + kern.current_c("char *kp_kernel_current(void)", "char", kt.current))
    resched = kern.resched(image)
    task += (kern.tail_call_c("kp_kernel_resched", resched) if resched else
             "void kp_kernel_resched(void) {}\n")
    # struct file_operations' size and its llseek, read and write offsets (BTF), for the debugfs files.
    fops = kt.fops if kt is not None and kt.fops else [-1] * 4
    task += f"const long kp_kernel_fops[4] = {{ {', '.join(map(str, fops))} }};\n"
    # struct trace_event, trace_iterator and trace_array (BTF), for our events' output types,
    # then their trace_event_call's structures (btf._CALL_LAYOUT).
    trace = kt.trace if kt is not None and kt.trace else [-1] * btf.TRACE_LAYOUT_LEN
    task += f"const long kp_kernel_trace[{len(trace)}] = {{ {', '.join(map(str, trace))} }};\n"
    task += unwind.unwind_c(image)      # stacks through probes (unwind.py)
    return task + (f"const unsigned long kp_kernel_gap_start = {address_c(image, lay.rx_vaddr)}, "
                   f"kp_kernel_gap_end = {address_c(image, lay.end)};\n"
            "#define KP_KERNEL_BLOCK ((sizeof(struct kp_thread) + KP_NHITS * sizeof(unsigned long) + 63) & ~63UL)\n"
            f"unsigned long kp_kernel_pool[{POOL_CPUS} * KP_KERNEL_BLOCK / sizeof(unsigned long)];\n"
            "const unsigned long kp_kernel_block = KP_KERNEL_BLOCK;\n"
            "const unsigned long kp_kernel_pool_size = sizeof(kp_kernel_pool);\n")


def handler_headers(image) -> dict[str, str]:
    """linux/sched.h from the image's own BTF (btf.py): the kernel's types and `current`,
    so that handlers read current->comm or a struct file as module code does; and
    linux/preempt.h (handlers run with preemption disabled, as the kernel's do), the
    architecture's."""
    kt = _types(image)
    out = {"linux/preempt.h": arch_of(image).PREEMPT_H}
    if kt is not None:              # no BTF: the handler API's own linux/sched.h
        out["linux/sched.h"] = kt.sched_h
    return out


def _types(image) -> btf.KernelTypes | None:
    if not hasattr(image, "_kernel_types"):
        sec = image.section_named(".BTF")
        image._kernel_types = None if sec is None else btf.kernel_types(
            image.data[sec.offset:sec.offset + sec.size], link_symbols(image), image.path, arch_of(image))
    return image._kernel_types
