"""How handlers are compiled for a kernel module (link/runtime.py reads this): as the
module's own code, with the kernel's flags (the kernel code model, no red zone,
return thunks and retpolines through the kernel's exported thunks).  The module's
runtime (runtime/platform/linux_module/kp_module_*.c, runtime/arch/<arch>/linux_module/) is
compiled per module by writer.py, on the probes' facts it generates; for trace events it
compiles the runtime's fetch and trace code on runtime/platform/linux_module
(writer.EVENT_SOURCES), whose CPU half is runtime/arch/<arch>/linux_module/."""
from ..linux_kernel.recipe import CFLAGS  # noqa: F401

SOURCES: list[str] = []
ARCH_FOLDERS = ["uapi", "linux_kernel", "linux_module"]
CODE = "kernel"
PIE = False
