"""How the runtime is built for a kernel module (link/runtime.py reads this), and how
handlers are compiled for one: as the module's own code, with the kernel's flags (the
kernel code model, no red zone, return thunks and retpolines through the kernel's exported
thunks).

The runtime built and cached here is what every module's trace events link (their fetch
programs and trace lines, kp_fetch.c and kp_trace.c on runtime/platform/linux_module,
whose CPU half is runtime/arch/<arch>/linux_module/), in two variants: trace_printk()
lines, or (event_calls: with the kernel's BTF) the kernel's own event calls.  What depends
on the probes (the dispatch, kretprobes, the breakpoint trap, init and exit:
runtime/platform/linux_module/kp_module_*.c, the detours' templates in
runtime/arch/<arch>/linux_module/) is compiled per module on the facts the module's tables
give it (x86_64/writer.py's tables())."""
from ..linux_kernel.recipe import CFLAGS  # noqa: F401

# C sources in link order ({platform}: runtime/platform/linux_module/).
SOURCES = ["kp_lib.c", "kp_line.c", "kp_fetch.c", "kp_trace.c", "{platform}/platform.c"]
# No .S of the arch's folders (the module's are templates its tables fill in), no asm-offsets.
ASM_SOURCES: list[str] = []
ASM_OFFSETS = False
# The events as the kernel's own event calls (kp_platform.h's KP_PLATFORM_TRACE_RECORD).
VARIANTS = {"event_calls": ["-DKP_MODULE_EVENTS"]}
ARCH_FOLDERS = ["uapi", "linux_kernel", "linux_module"]
CODE = "kernel"
PIE = False
