/*
 * A Linux user process on AArch64, for the linux_user platform (its
 * kp_platform.h includes this): raw system calls (`svc #0`, the number in x8),
 * the thread pointer (tpidr_el0), the C library's struct sigaction.  The
 * numbers and layouts are Linux's (uapi/kp_uapi.h).
 */
#ifndef _KP_ARCH_PLATFORM_H
#define _KP_ARCH_PLATFORM_H
#include <kp_uapi.h>

/* Arguments in x0..x5, the result in x0 (a negative errno on failure); the
 * kernel preserves every other register. */
static inline long kp_syscall6(long n, long a, long b, long c, long d, long e, long f)
{
	register long x8 __asm__("x8") = n;
	register long x0 __asm__("x0") = a;
	register long x1 __asm__("x1") = b;
	register long x2 __asm__("x2") = c;
	register long x3 __asm__("x3") = d;
	register long x4 __asm__("x4") = e;
	register long x5 __asm__("x5") = f;
	__asm__ volatile("svc #0"
			 : "+r"(x0)
			 : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5)
			 : "memory");
	return x0;
}
#define kp_syscall3(n, a, b, c) kp_syscall6(n, (long)(a), (long)(b), (long)(c), 0, 0, 0)

/* open(2): the generic table has only openat(2). */
#define kp_sys_open(path, flags, mode) \
	kp_syscall6(__NR_openat, KP_AT_FDCWD, (long)(path), (long)(flags), (long)(mode), 0, 0)

/* On entry to a signal handler: nothing to set up (no direction flag; the
 * kernel and qemu-user deliver signals with PSTATE as the ABI wants it). */
#define kp_arch_signal_entry() do { } while (0)

/* The thread pointer: tpidr_el0, the TCB glibc and musl point it at. */
static inline unsigned long kp_arch_thread_pointer(void)
{
	unsigned long tp;
	__asm__("mrs %0, tpidr_el0" : "=r"(tp));
	return tp;
}

/* The thread pointer as the kernel knows it, 0 before the C library set one
 * up: on AArch64 the register itself, which reading never faults (x86-64 asks
 * arch_prctl(2) there, as %fs:0 would fault). */
#define kp_arch_thread_pointer_sys(tp) (*(tp) = kp_arch_thread_pointer(), 0L)

/* No per-CPU value the vDSO reads at EL0 (arm64's vDSO has no getcpu): 0, and
 * the platform asks getcpu(2). */
static inline int kp_arch_vgetcpu(unsigned int *limit)
{
	*limit = 0;
	return 0;
}

/* A free-running counter for trace time stamps between clock_gettime(2) readings
 * (kp_trace.c scales it): the generic timer's virtual count, readable at EL0 (the
 * vDSO's own clock source). */
static inline unsigned long kp_arch_counter(void)
{
	unsigned long v;
	__asm__ volatile("isb; mrs %0, cntvct_el0" : "=r"(v) :: "memory");
	return v;
}

/* glibc's (and musl's) struct sigaction on AArch64: the generic layout, as on x86-64. */
struct kp_libc_sigaction {
	void *handler;
	unsigned long mask[16];
	int flags;
	void (*restorer)(void);
};

/* A call through a lazily bound GOT slot's initial value, which on AArch64 is
 * PLT0 itself: the PLT entry would have set x16 to the slot's address (which
 * _dl_runtime_resolve reads to find the relocation) and x17 to PLT0.  So
 * x16 and x17 are set as the entry sets them; the callee is an ordinary
 * AAPCS64 function once resolved (x0-x18, x30 and the flags clobbered; the
 * runtime uses no SIMD registers: -mgeneral-regs-only). */
static inline long kp_arch_call_lazy_slot(unsigned long fn, unsigned long *slot, long a, long b, long c)
{
	register long x0 __asm__("x0") = a;
	register long x1 __asm__("x1") = b;
	register long x2 __asm__("x2") = c;
	register unsigned long x16 __asm__("x16") = (unsigned long)slot;
	register unsigned long x17 __asm__("x17") = fn;
	__asm__ volatile("blr x17"
			 : "+r"(x0), "+r"(x1), "+r"(x2), "+r"(x16), "+r"(x17)
			 :
			 : "x3", "x4", "x5", "x6", "x7", "x8", "x9", "x10", "x11", "x12", "x13", "x14",
			   "x15", "x18", "x30", "memory", "cc");
	return x0;
}

/*
 * An entry of the runtime's that other kprewrite runtimes recognise (kp_sighook.c's GOT
 * hooks, kp_signal.c's SIGTRAP handler): bti c (a PLT stub's `br x17` and the kernel's
 * handler call are indirect branches, BTI pages), a `b` over an 8-byte tag, then a `b` to
 * the function; a runtime that finds another's entry where it would put its own leaves it
 * (a hook) or chains to it (a handler).  `name` and `tag`: strings.
 */
#define KP_ARCH_TAGGED_ENTRY_ASM(name, tag) \
	".text\n\t.p2align 4\n\t.hidden " name "_entry\n\t.type " name "_entry, @function\n" \
	name "_entry:\n\thint 34\n\tb 1f\n\t.ascii \"" tag "\"\n1:\tb " name "\n\t.size " name "_entry, .-" name "_entry\n"

/* Whether the code at v is such an entry with `tag` (8 characters). */
static inline int kp_arch_is_tagged_entry(unsigned long v, const char *tag)
{
	const unsigned char *p = (const unsigned char *)v;
	static const unsigned char head[8] = { 0x5f, 0x24, 0x03, 0xd5, 0x03, 0x00, 0x00, 0x14 };	/* bti c; b .+12 */
	if (v < 4096 || (v & 3))	/* SIG_DFL, SIG_IGN */
		return 0;
	for (int i = 0; i < 8; i++)
		if (p[i] != head[i] || p[8 + i] != (unsigned char)tag[i])
			return 0;
	return 1;
}

/* The light detours' increment chosen at start-up, LSE atomics where the CPU has them
 * (kp_alternatives.c): kp_relocate() calls this before kprobes are armed. */
#define KP_ARCH_TEXT_ALTERNATIVES 1
void kp_arch_text_alternatives(unsigned long bias);

/* The relocation types of GOT slots (R_AARCH64_GLOB_DAT, R_AARCH64_JUMP_SLOT). */
#define KP_ARCH_R_GLOB_DAT 1025
#define KP_ARCH_R_JUMP_SLOT 1026
/* A lazy slot holds PLT0 itself, which needs the slot's address in x16: a hook there is set
 * by resolving the slot first (kp_sighook.c). */
#define KP_ARCH_LAZY_SLOTS_HOLD_PLT0 1

#endif
