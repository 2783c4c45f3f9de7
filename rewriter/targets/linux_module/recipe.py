"""How handlers are compiled for a kernel module (link_runtime.py reads this): as the
module's own code, with the kernel's flags (the kernel code model, no red zone,
return thunks and retpolines through the kernel's exported thunks).  The module's
runtime is generated per module (writer.py), not built from runtime/."""
from ..linux_kernel.recipe import CFLAGS  # noqa: F401

SOURCES: list[str] = []
ARCH_FOLDERS = ["uapi", "linux_kernel"]
CODE = "kernel"
PIE = False
