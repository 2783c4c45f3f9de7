/*
 * Linux's ABI on x86-64 (the kernel's arch/x86/include/uapi, as far as the
 * runtime uses it): system call numbers, the kernel's struct sigaction, the
 * signal frame's ucontext layout, the user segment selectors.  Constants and
 * layouts only, on the include path of both Linux platforms (a kernel image's
 * runtime compiles the user signal glue of arch/x86_64/kp_int3.c too); the code
 * that makes system calls is linux_user/kp_arch_platform.h's.
 */
#ifndef _KP_UAPI_H
#define _KP_UAPI_H

/* The system call numbers the runtime uses. */
#define __NR_read 0
#define __NR_write 1
#define __NR_open 2
#define __NR_close 3
#define __NR_lseek 8
#define __NR_mmap 9
#define __NR_mprotect 10
#define __NR_munmap 11
#define __NR_rt_sigaction 13
#define __NR_rt_sigprocmask 14
#define __NR_rt_sigreturn 15
#define __NR_pwrite64 18
#define __NR_sched_yield 24
#define __NR_madvise 28
#define __NR_getpid 39
#define __NR_getppid 110
#define __NR_ftruncate 77
#define __NR_getresuid 118
#define __NR_getresgid 120
#define __NR_prctl 157
#define __NR_arch_prctl 158
#define __NR_gettid 186
#define __NR_sched_getaffinity 204
#define __NR_clock_gettime 228
#define __NR_tgkill 234
#define __NR_fallocate 285
#define __NR_pipe2 293
#define __NR_getcpu 309
#define __NR_kcmp 312
#define __NR_process_vm_readv 310
#define ARCH_GET_FS 0x1003

/* sa_flags (arch/x86/include/uapi/asm/signal.h). */
#define KP_SA_SIGINFO 0x4UL
#define KP_SA_RESTORER 0x04000000UL
#define KP_SA_RESTART 0x10000000UL
#define KP_SA_NODEFER 0x40000000UL
#define KP_SA_RESETHAND 0x80000000UL

/* The user segment selectors (arch/x86/include/asm/segment.h). */
#define KP_USER_CS 0x33		/* __USER_CS */
#define KP_USER_DS 0x2b		/* __USER_DS */

/* offsetof(ucontext_t, uc_sigmask) */
#define KP_UC_SIGMASK 296

/* ucontext_t: uc_flags, uc_link, uc_stack (24 bytes), then mcontext_t's gregs[]. */
#define KP_UC_GREGS 40

#ifndef __ASSEMBLER__
enum { G_R8, G_R9, G_R10, G_R11, G_R12, G_R13, G_R14, G_R15, G_RDI, G_RSI, G_RBP,
       G_RBX, G_RDX, G_RAX, G_RCX, G_RSP, G_RIP, G_EFL, G_CSGSFS };

/* The kernel's struct sigaction (rt_sigaction(2)). */
struct kp_ksigaction {
	void *handler;
	unsigned long flags;
	void (*restorer)(void);
	unsigned long mask;
};
#endif
#endif
