"""How C is compiled for x86-64 (link/runtime.py adds these to a target's
recipe): the toolchain's target triple and the flags only x86-64 has."""

# The GNU toolchain's name prefix: x86_64-linux-gnu-gcc, x86_64-linux-gnu-ld
# (plain gcc and ld on an x86-64 host without them).
TRIPLE = "x86_64-linux-gnu"

# By the kind of code a target's recipe builds (its CODE):
CFLAGS = {
    # Handlers and the runtime in a user process: the detours save no SSE/AVX/x87
    # state, so no vector or x87 register is touched; no CET landing pads.
    "user": ("-mgeneral-regs-only", "-fcf-protection=none"),
    # In a kernel image, as the kernel's own code: the kernel code model, no red
    # zone (interrupts push below %rsp), 8-byte stack alignment, and the image's
    # return-thunk and retpoline conventions; no frame pointer in a leaf (the recipe keeps
    # them elsewhere, for the kernel's unwinder).
    "kernel": ("-mgeneral-regs-only", "-fcf-protection=none", "-mcmodel=kernel", "-mno-red-zone",
               "-mpreferred-stack-boundary=3", "-mfunction-return=thunk-extern",
               "-mindirect-branch=thunk-extern", "-mindirect-branch-register", "-momit-leaf-frame-pointer"),
}

# How `kprewrite boot` runs a kernel of this arch: QEMU's system emulator, its machine
# options, the Debian package that has it, and the kernel's serial console.
QEMU_SYSTEM = ("qemu-system-x86_64", (), "qemu-system-x86")
CONSOLE = "ttyS0"

# The runtime's breakpoint trap code (runtime/arch/x86_64/), in the arch's word: the files
# a platform's recipe names as {arch}/{breakpoint}, {arch}/{breakpoint_signal} (a user
# process: the SIGTRAP's context, which includes the former as one unit) and
# {arch}/{breakpoint_hook} (a kernel's way into its #BP path).
RUNTIME_FILES = {"breakpoint": "kp_int3.c", "breakpoint_signal": "linux_user/kp_int3_signal.c",
                 "breakpoint_hook": "linux_kernel/kp_int3_hook.c"}
