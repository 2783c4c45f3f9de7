/*
 * A Linux user process on x86-64, for the linux_user platform (its
 * kp_platform.h includes this): raw system calls (the runtime calls nothing in
 * the probed program), the thread pointer, the CPU number the vDSO reads, the
 * C library's struct sigaction.  The numbers and layouts are Linux's
 * (uapi/kp_uapi.h).
 */
#ifndef _KP_ARCH_PLATFORM_H
#define _KP_ARCH_PLATFORM_H
#include <kp_uapi.h>

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

/* open(2) (x86-64 has it; newer arches only openat). */
#define kp_sys_open(path, flags, mode) kp_syscall3(__NR_open, path, flags, mode)

/* The thread pointer: %fs:0 is the TCB's self pointer in glibc and musl. */
/* On entry to a signal handler: the state the ABI promises C code.  Linux clears DF
 * when it delivers a signal; qemu-user does not, and a breakpoint probe hit between a
 * program's `std` and `cld` would run the handlers' string instructions backwards. */
#define kp_arch_signal_entry() __asm__ volatile("cld" ::: "memory")

static inline unsigned long kp_arch_thread_pointer(void)
{
	unsigned long tp;
	__asm__("mov %%fs:0, %0" : "=r"(tp));
	return tp;
}

/* The thread pointer as the kernel knows it (the %fs base), 0 before the C
 * library set one up: asking never faults. */
#define kp_arch_thread_pointer_sys(tp) kp_syscall3(__NR_arch_prctl, ARCH_GET_FS, tp, 0)

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

/* A free-running counter for trace time stamps between clock_gettime(2) readings
 * (kp_trace.c scales it): the TSC, invariant and synchronized on the CPUs that
 * Linux runs its own TSC clocksource on. */
static inline unsigned long kp_arch_counter(void)
{
	unsigned int lo, hi;
	__asm__ volatile("rdtsc" : "=a"(lo), "=d"(hi));
	return (unsigned long)hi << 32 | lo;
}

/* kp_kretprobe_clean_callback() is called by kp_kretprobe_clean_entry (kp_platform_asm.h). */
#define KP_KRET_CLEAN_ENTRY 1

/* glibc's (and musl's) struct sigaction on x86-64. */
struct kp_libc_sigaction {
	void *handler;
	unsigned long mask[16];
	int flags;
	void (*restorer)(void);
};

/* A call through a lazily bound GOT slot's initial value: on x86-64 the PLT
 * entry's second half (push the relocation's index; jmp PLT0), callable as is. */
static inline long kp_arch_call_lazy_slot(unsigned long fn, unsigned long *slot, long a, long b, long c)
{
	(void)slot;
	return ((long (*)(long, long, long))fn)(a, b, c);
}
/*
 * An entry of the runtime's that other kprewrite runtimes recognise (kp_sighook.c's GOT
 * hooks, kp_signal.c's SIGTRAP handler): a `jmp` over an 8-byte tag, then a `jmp` to the
 * function; a runtime that finds another's entry where it would put its own leaves it (a
 * hook) or chains to it (a handler).  `name` and `tag`: strings.
 */
#define KP_ARCH_TAGGED_ENTRY_ASM(name, tag) \
	".text\n\t.p2align 4\n\t.hidden " name "_entry\n\t.type " name "_entry, @function\n" \
	name "_entry:\n\tjmp 1f\n\t.ascii \"" tag "\"\n1:\tjmp " name "\n\t.size " name "_entry, .-" name "_entry\n"

/* Whether the code at v is such an entry with `tag` (8 characters). */
static inline int kp_arch_is_tagged_entry(unsigned long v, const char *tag)
{
	const unsigned char *p = (const unsigned char *)v;
	if (v < 4096 || p[0] != 0xeb || p[1] != 0x08)	/* SIG_DFL, SIG_IGN; jmp .+10 */
		return 0;
	for (int i = 0; i < 8; i++)
		if (p[2 + i] != (unsigned char)tag[i])
			return 0;
	return 1;
}

/* The relocation types of GOT slots (R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT). */
#define KP_ARCH_R_GLOB_DAT 6
#define KP_ARCH_R_JUMP_SLOT 7

#endif
