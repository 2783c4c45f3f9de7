"""How the runtime is built and linked for a kernel image
(runtime/platform/linux_kernel; link/runtime.py reads this): no signals, no GOT
hooks; kretprobes the kernel's way, instances per task (kp_kretprobe_task.c, for
kp_kretprobe.c); breakpoint sites through a hook on the kernel's kprobe
breakpoint handler (the arch's {breakpoint_hook}: x86-64's linux_kernel/kp_int3_hook.c).  Compiled as kernel
code is (the arch's "kernel" flags), not position-independent: linked where it
runs."""

# C sources in link order ({arch}: runtime/arch/<arch>/, {platform}:
# runtime/platform/<platform>/, {breakpoint...}: the arch's file of that role,
# rewriter/arch/<arch>/toolchain.py's RUNTIME_FILES), then the .S files of the arch's folder and of
# ARCH_FOLDERS.  The order decides where each function lands.  Every arch's
# kernel names a {breakpoint_hook}: its way into the kernel's #BP path.
SOURCES = ["kp_core.c", "kp_lib.c", "kp_printk.c", "{platform}/platform.c",
           "{platform}/kp_kretprobe_task.c", "kp_line.c", "kp_fetch.c", "kp_trace.c",
           "{arch}/{breakpoint}", "{arch}/{breakpoint_hook}", "{platform}/kp_debugfs.c"]
# kprobe_events into the ftrace ring buffer, symbols from kallsyms.
SOURCES += ["{platform}/kp_trace_buffer.c"]
# Stacks through probes (unwind.py): the frame records' return addresses, the code
# registered as kernel text.
SOURCES += ["{platform}/kp_unwind.c"]

# The arch's folders for this platform (runtime/arch/<arch>/<folder>): the arch's
# half of a kernel image (kp_arch_platform.h: per-CPU data, preemption, interrupt
# flags; its segments and return thunk for the .S entries; the #BP hook).  Not uapi/:
# a user process's ABI (its signal frame is linux_user/'s).
ARCH_FOLDERS = ["linux_kernel"]

# Flags for any arch; the arch adds its own for CODE (rewriter/arch/<arch>/toolchain.py).
CFLAGS = ["-O2", "-ffreestanding", "-fno-stack-protector", "-fno-asynchronous-unwind-tables",
          "-fno-unwind-tables", "-fvisibility=hidden", "-fno-common",
          # frame pointer chains: the kernel's unwinder takes our code as frame-pointer
          # code (unwind.py); the arch leaves them out of leaves where it can
          # (toolchain.py: nothing is called from a leaf, so no stack goes through its frame)
          "-fno-omit-frame-pointer",
          "-fno-tree-loop-distribute-patterns",
          "-std=gnu11", "-w", "-fno-ident", "-D__KERNEL__", "-fno-pic", "-fno-pie"]
CODE = "kernel"

PIE = False         # linked where it runs (the image's symbols resolved at link time)

# A kernel whose runtime is placed at boot, not linked into the image (an arch whose image
# has no room for it: runtime.py of the arch's kernel folder links the blob): the debugfs
# views and the trace events (kprobe_events into the ftrace ring buffer, registered when
# the blob is placed: KP_PLACED_AT_BOOT, kp_trace_buffer.c), each function and object in a
# section of its own (the blob's link keeps what its entries reach); kp_debugfs.c's disarm
# flag is the detours' (in the image), through a pointer the blob's glue sets; its kretprobes
# are the detours' array (KP_KRETPROBES_IN_IMAGE), not built at boot from records.
VARIANTS = {"placed_at_boot": {
    "flags": ["-ffunction-sections", "-fdata-sections", "-Dkp_kernel_disarmed=(*kp_kernel_disarmed_at)",
              "-DKP_PLACED_AT_BOOT", "-DKP_KRETPROBES_IN_IMAGE"],
    "SOURCES": ["{platform}/kp_debugfs.c", "kp_lib.c", "kp_line.c", "kp_fetch.c", "kp_trace.c",
                "{platform}/kp_trace_buffer.c"], "ASM_SOURCES": [], "ASM_OFFSETS": False}}
