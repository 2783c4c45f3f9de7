/*
 * Linux's user ABI on x86-64, for the linux_user platform: raw system calls
 * (the runtime calls nothing in the probed program), their numbers, the
 * thread pointer, the signal frame and the CPU number the vDSO reads.
 */
#ifndef _KP_UAPI_H
#define _KP_UAPI_H

static inline long kp_syscall6(long n, long a, long b, long c, long d, long e, long f)
{
	long ret;
	register long r10 __asm__("r10") = d;
	register long r8 __asm__("r8") = e;
	register long r9 __asm__("r9") = f;
	__asm__ volatile("syscall"
			 : "=a"(ret)
			 : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
			 : "rcx", "r11", "memory");
	return ret;
}
#define kp_syscall3(n, a, b, c) kp_syscall6(n, (long)(a), (long)(b), (long)(c), 0, 0, 0)

/* The system call numbers the runtime uses. */
#define __NR_read 0
#define __NR_write 1
#define __NR_open 2
#define __NR_close 3
#define __NR_mmap 9
#define __NR_mprotect 10
#define __NR_rt_sigaction 13
#define __NR_rt_sigprocmask 14
#define __NR_getpid 39
#define __NR_prctl 157
#define __NR_arch_prctl 158
#define __NR_gettid 186
#define __NR_sched_getaffinity 204
#define __NR_clock_gettime 228
#define __NR_tgkill 234
#define __NR_pipe2 293
#define __NR_getcpu 309
#define __NR_process_vm_readv 310
#define ARCH_GET_FS 0x1003

/* The thread pointer: %fs:0 is the TCB's self pointer in glibc and musl. */
static inline unsigned long kp_arch_thread_pointer(void)
{
	unsigned long tp;
	__asm__("mov %%fs:0, %0" : "=r"(tp));
	return tp;
}

/* offsetof(ucontext_t, uc_sigmask) */
#define KP_UC_SIGMASK 296

/*
 * What the vDSO's vgetcpu reads: the limit of the per-CPU GDT segment Linux
 * sets up (selector 0x7b, cpu | node << 12).  0 where that segment does not
 * exist (QEMU's user-mode GDT): LSL clears ZF.
 */
static inline int kp_arch_vgetcpu(unsigned int *limit)
{
	unsigned char ok;
	__asm__ volatile("lsl %2, %0; setz %1" : "=r"(*limit), "=qm"(ok) : "r"(0x7bU) : "cc");
	return ok;
}
#endif
