"""How C is compiled for AArch64 (link_runtime.py adds these to a target's
recipe): the toolchain's target triple and the flags only AArch64 has."""

# The GNU toolchain's name prefix: aarch64-linux-gnu-gcc, aarch64-linux-gnu-ld.
TRIPLE = "aarch64-linux-gnu"

CFLAGS = {
    # Handlers and the runtime in a user process: the detours save no FP/SIMD
    # state, so no vector register is touched; no outline atomics (they call
    # libgcc, which the freestanding runtime does not link).
    "user": ("-mgeneral-regs-only", "-mno-outline-atomics"),
    # A kernel image: not supported on arm64 yet; the kernel's own flags.
    "kernel": ("-mgeneral-regs-only", "-mno-outline-atomics", "-mcmodel=small"),
}
