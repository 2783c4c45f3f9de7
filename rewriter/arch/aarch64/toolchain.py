"""How C is compiled for AArch64 (link/runtime.py adds these to a target's
recipe): the toolchain's target triple and the flags only AArch64 has."""

# The GNU toolchain's name prefix: aarch64-linux-gnu-gcc, aarch64-linux-gnu-ld
# (Debian's gcc-aarch64-linux-gnu; plain gcc and ld on an AArch64 host without them).
TRIPLE = "aarch64-linux-gnu"

# By the kind of code a target's recipe builds (its CODE):
CFLAGS = {
    # Handlers and the runtime in a user process: the detours save no FP/SIMD
    # state (q0..q31, FPCR/FPSR), so none is touched (the kernel's own flag);
    # atomics inline (GCC's default -moutline-atomics calls libgcc's
    # __aarch64_* helpers, and nothing links libgcc); `bti c` at every function
    # entry, so that a program whose pages are BTI-guarded may reach runtime
    # and handler functions through a register (a hint, a NOP elsewhere).
    "user": ("-mgeneral-regs-only", "-mno-outline-atomics", "-mbranch-protection=bti"),
    # Handlers in an arm64 kernel image (rewriter/targets/linux_kernel/aarch64/build.py): no FP/SIMD
    # (the kernel's own flag), atomics inline, every address PC-relative (the small code model,
    # no PIC: adrp/add and bl, which KASLR's 64 KiB-aligned displacement leaves right).
    "kernel": ("-mgeneral-regs-only", "-mno-outline-atomics", "-mcmodel=small", "-mbranch-protection=none"),
}

# How `kprewrite boot` runs a kernel of this arch: QEMU's system emulator, its machine
# options, the Debian package that has it, and the kernel's serial console.
QEMU_SYSTEM = ("qemu-system-aarch64", ("-M", "virt", "-cpu", "max"), "qemu-system-arm")
CONSOLE = "ttyAMA0"

# The runtime's breakpoint trap code (runtime/arch/aarch64/), in the arch's word: the files
# a platform's recipe names as {arch}/{breakpoint} and {arch}/{breakpoint_signal} (a user
# process: the SIGTRAP's context, which includes the former as one unit); no kernel hook yet.
RUNTIME_FILES = {"breakpoint": "kp_brk.c", "breakpoint_signal": "linux_user/kp_brk_signal.c"}
