/*
 * Linux's ABI on AArch64 (the kernel's arch/arm64/include/uapi and the generic
 * include/uapi/asm-generic it builds on, as far as the runtime uses it): system
 * call numbers, the kernel's struct sigaction and SA_* flags, the signal
 * frame's ucontext layout.  Constants and layouts only; the code that makes
 * system calls is linux_user/kp_arch_platform.h's.
 * tests/test_aarch64_runtime.py checks every value against the cross
 * toolchain's own headers (asm/unistd.h, ucontext.h, signal.h).
 */
#ifndef _KP_UAPI_H
#define _KP_UAPI_H

/* The system call numbers the runtime uses: the generic table
 * (asm-generic/unistd.h), which has no open(2) (openat with AT_FDCWD) and no
 * arch_prctl(2) (the thread pointer is tpidr_el0, readable at EL0). */
#define __NR_getcpu 168
#define __NR_ftruncate 46
#define __NR_fallocate 47
#define __NR_openat 56
#define __NR_close 57
#define __NR_pipe2 59
#define __NR_read 63
#define __NR_sched_yield 124
#define __NR_write 64
#define __NR_lseek 62
#define __NR_pwrite64 68
#define __NR_clock_gettime 113
#define __NR_sched_getaffinity 123
#define __NR_tgkill 131
#define __NR_rt_sigaction 134
#define __NR_rt_sigprocmask 135
#define __NR_rt_sigreturn 139
#define __NR_getresuid 148
#define __NR_getresgid 150
#define __NR_prctl 167
#define __NR_getpid 172
#define __NR_getppid 173
#define __NR_kcmp 272
#define __NR_gettid 178
#define __NR_munmap 215
#define __NR_mremap 216
#define __NR_mmap 222
#define __NR_mprotect 226
#define __NR_madvise 233
#define __NR_process_vm_readv 270
#define KP_AT_FDCWD (-100)

/* sa_flags (arch/arm64/include/uapi/asm/signal.h: SA_RESTORER; the rest asm-generic). */
#define KP_SA_SIGINFO 0x4UL
#define KP_SA_RESTORER 0x04000000UL
#define KP_SA_ONSTACK 0x08000000UL
#define KP_SA_RESTART 0x10000000UL
#define KP_SA_NODEFER 0x40000000UL
#define KP_SA_RESETHAND 0x80000000UL

/*
 * The signal frame's ucontext (arch/arm64/include/uapi/asm/ucontext.h):
 * uc_flags, uc_link, uc_stack (24 bytes), uc_sigmask (8 bytes, padded to the C
 * library's 128), then struct sigcontext, 16-byte aligned:
 * fault_address, regs[31], sp, pc, pstate, __reserved[4096] (the FP/SIMD and
 * other records, 16-byte aligned).
 */
#define KP_UC_SIGMASK 40
#define KP_UC_MCONTEXT 176
#define KP_UC_FAULT_ADDRESS (KP_UC_MCONTEXT + 0)
#define KP_UC_REGS (KP_UC_MCONTEXT + 8)		/* x0..x30, 8 bytes each */
#define KP_UC_SP (KP_UC_MCONTEXT + 256)
#define KP_UC_PC (KP_UC_MCONTEXT + 264)
#define KP_UC_PSTATE (KP_UC_MCONTEXT + 272)
#define KP_UC_RESERVED (KP_UC_MCONTEXT + 288)

/* A breakpoint's siginfo: brk raises SIGTRAP with si_code TRAP_BRKPT (arm64's
 * do_brk() -> arm64_notify_die(); qemu-user likewise), the immediate in
 * ESR_EL1 (not visible to user space: the pc tells which brk it was). */
#define KP_TRAP_BRKPT 1

#ifndef __ASSEMBLER__
/* struct sigcontext (arch/arm64/include/uapi/asm/sigcontext.h). */
struct kp_sigcontext {
	unsigned long fault_address;
	unsigned long regs[31];
	unsigned long sp;
	unsigned long pc;
	unsigned long pstate;
	unsigned char reserved[4096] __attribute__((__aligned__(16)));
};

/* struct ucontext (arch/arm64/include/uapi/asm/ucontext.h). */
struct kp_ucontext {
	unsigned long uc_flags;
	struct kp_ucontext *uc_link;
	struct { void *ss_sp; int ss_flags; unsigned long ss_size; } uc_stack;
	unsigned long uc_sigmask;
	unsigned char unused[1024 / 8 - 8];
	struct kp_sigcontext uc_mcontext;
};

_Static_assert(__builtin_offsetof(struct kp_ucontext, uc_sigmask) == KP_UC_SIGMASK, "uc_sigmask");
_Static_assert(__builtin_offsetof(struct kp_ucontext, uc_mcontext) == KP_UC_MCONTEXT, "uc_mcontext");
_Static_assert(__builtin_offsetof(struct kp_ucontext, uc_mcontext.pc) == KP_UC_PC, "pc");
_Static_assert(__builtin_offsetof(struct kp_ucontext, uc_mcontext.reserved) == KP_UC_RESERVED, "__reserved");

/* The kernel's struct sigaction (rt_sigaction(2); asm-generic/signal.h with
 * SA_RESTORER defined): the same order as x86-64's. */
struct kp_ksigaction {
	void *handler;
	unsigned long flags;
	void (*restorer)(void);
	unsigned long mask;
};
#endif
#endif
