/*
 * The x86-64 half of the handler API (<kprewrite/kprobes.h> includes it when the
 * compiler targets x86-64): struct pt_regs and what the kernel's
 * arch/x86/include/asm/ptrace.h defines on it.
 */
#ifndef _KPREWRITE_ARCH_X86_64_PTRACE_H
#define _KPREWRITE_ARCH_X86_64_PTRACE_H

/* The kernel's Kconfig symbols for this arch, which its samples test
 * (samples/kprobes/kprobe_example.c: #ifdef CONFIG_X86). */
#ifndef CONFIG_X86
#define CONFIG_X86 1
#endif
#ifndef CONFIG_X86_64
#define CONFIG_X86_64 1
#endif

/* arch/x86/include/asm/ptrace.h, x86-64 layout (offsets in 8-byte words). */
struct pt_regs {
	unsigned long r15, r14, r13, r12, bp, bx;
	unsigned long r11, r10, r9, r8, ax, cx, dx, si, di;
	unsigned long orig_ax;
	unsigned long ip, cs, flags, sp, ss;
};

/* The return value, at a kretprobe's return: in ax. */
static inline unsigned long regs_return_value(struct pt_regs *regs)
{
	return regs->ax;
}

/* The instruction and stack pointers (always inlined: the runtime's core reads
 * and sets them on its probe paths through these). */
static inline __attribute__((__always_inline__)) unsigned long instruction_pointer(struct pt_regs *regs)
{
	return regs->ip;
}

static inline __attribute__((__always_inline__)) void instruction_pointer_set(struct pt_regs *regs, unsigned long val)
{
	regs->ip = val;
}

static inline __attribute__((__always_inline__)) unsigned long kernel_stack_pointer(struct pt_regs *regs)
{
	return regs->sp;
}

/* The x86-64 function-call ABI: di, si, dx, cx, r8, r9, then the stack. */
static inline unsigned long regs_get_kernel_argument(struct pt_regs *regs, unsigned int n)
{
	switch (n) {
	case 0: return regs->di;
	case 1: return regs->si;
	case 2: return regs->dx;
	case 3: return regs->cx;
	case 4: return regs->r8;
	case 5: return regs->r9;
	default:
		/* At a function entry, sp points at the return address. */
		return ((unsigned long *)regs->sp)[n - 5];
	}
}

#endif
