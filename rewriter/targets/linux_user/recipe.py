"""How the runtime is built and linked for a Linux user process
(runtime/platform/linux_user; link/runtime.py reads this): position-independent
and freestanding, linked -pie where the new segments will be, relocated by the
runtime at start-up."""

# C sources in link order ({arch}: runtime/arch/<arch>/, {platform}:
# runtime/platform/<platform>/, {breakpoint...}: the arch's file of that role), then the .S files of the arch's folder and of
# ARCH_FOLDERS.  The order decides where each function lands: changing it
# changes every output.
SOURCES = ["kp_core.c", "kp_lib.c", "kp_printk.c", "{platform}/platform.c"]
# Breakpoint probes.
# The arch's trap code with the SIGTRAP's context ({breakpoint_signal}, the arch's
# name: x86-64's linux_user/kp_int3_signal.c, AArch64's linux_user/kp_brk_signal.c,
# includes the arch's {breakpoint}: one unit; rewriter/arch/<arch>/toolchain.py's
# RUNTIME_FILES names them).
SOURCES += ["{arch}/{breakpoint_signal}", "{platform}/kp_signal.c", "{platform}/kp_sighook.c"]
# kretprobes.
SOURCES += ["kp_kretprobe.c", "{platform}/clock_cpus.c"]
# kprobe_events, fetch args, trace lines.
SOURCES += ["kp_line.c", "kp_fetch.c", "kp_trace.c", "{platform}/profile_signal.c"]

# The arch's folders for this platform (runtime/arch/<arch>/<folder>, on the
# include path, their .S files linked): Linux's ABI on the arch, and the arch's
# half of a user process (system calls, thread pointer, signal return).
ARCH_FOLDERS = ["uapi", "linux_user"]

# Flags for any arch; the arch adds its own for CODE (rewriter/arch/<arch>/toolchain.py).
CFLAGS = ["-O2", "-fPIC", "-ffreestanding", "-fno-stack-protector",
          # unwind tables, linked into the runtime's .eh_frame: a backtrace in a handler
          # (targets/linux_user/unwind.py); they change no code
          "-fasynchronous-unwind-tables", "-fvisibility=hidden", "-fno-common",
          "-fno-tree-loop-distribute-patterns", "-fno-plt",
          "-std=gnu11", "-w", "-fno-ident"]
CODE = "user"

PIE = True          # linked -pie (relocated at run time)
