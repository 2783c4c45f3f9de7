/*
 * The AArch64 half of the handler API (<kprewrite/kprobes.h> includes it when the
 * compiler targets AArch64): struct pt_regs and what the kernel's
 * arch/arm64/include/asm/ptrace.h defines on it.
 *
 * The layout is the kernel's up to syscallno (regs[31], sp, pc, pstate: its
 * struct user_pt_regs, then orig_x0 and syscallno); the kernel's later fields
 * (sdei_ttbr1, pmr_save, stackframe[], lockdep_hardirqs, exit_rcu) are its
 * exception entry's own and are left out.  Offsets (bytes): regs[n] at 8 * n,
 * sp 248, pc 256, pstate 264, orig_x0 272, syscallno 280; 288 in all, a
 * multiple of 16 so that a frame of it keeps sp aligned (runtime/arch/aarch64/
 * kp_regs.h documents how the entries fill it).
 */
#ifndef _KPREWRITE_ARCH_AARCH64_PTRACE_H
#define _KPREWRITE_ARCH_AARCH64_PTRACE_H

/* The kernel's Kconfig symbol for this arch, which its samples test
 * (samples/kprobes/kprobe_example.c: #ifdef CONFIG_ARM64). */
#ifndef CONFIG_ARM64
#define CONFIG_ARM64 1
#endif

/* PSTATE bits (arch/arm64/include/uapi/asm/ptrace.h). */
#define PSR_N_BIT	0x80000000
#define PSR_Z_BIT	0x40000000
#define PSR_C_BIT	0x20000000
#define PSR_V_BIT	0x10000000
#define PSR_MODE_EL0t	0x00000000

/* arch/arm64/include/uapi/asm/ptrace.h */
struct user_pt_regs {
	unsigned long regs[31];
	unsigned long sp;
	unsigned long pc;
	unsigned long pstate;
};

struct pt_regs {
	union {
		struct user_pt_regs user_regs;
		struct {
			unsigned long regs[31];	/* x0..x30; x29 the frame pointer, x30 the link register */
			unsigned long sp;
			unsigned long pc;
			unsigned long pstate;	/* NZCV in bits 31..28 */
		};
	};
	unsigned long orig_x0;
	int syscallno;
	unsigned int unused2;
};

/* The return value, at a kretprobe's return: in x0. */
static inline unsigned long regs_return_value(struct pt_regs *regs)
{
	return regs->regs[0];
}

static inline void regs_set_return_value(struct pt_regs *regs, unsigned long rc)
{
	regs->regs[0] = rc;
}

/* The instruction and stack pointers (always inlined: the runtime's core reads
 * and sets them on its probe paths through these). */
static inline __attribute__((__always_inline__)) unsigned long instruction_pointer(struct pt_regs *regs)
{
	return regs->pc;
}

static inline __attribute__((__always_inline__)) void instruction_pointer_set(struct pt_regs *regs, unsigned long val)
{
	regs->pc = val;
}

static inline __attribute__((__always_inline__)) unsigned long kernel_stack_pointer(struct pt_regs *regs)
{
	return regs->sp;
}

/* The frame pointer (x29) and the link register (x30): the kernel's
 * frame_pointer() and procedure_link_pointer(). */
static inline unsigned long frame_pointer(struct pt_regs *regs)
{
	return regs->regs[29];
}

static inline unsigned long procedure_link_pointer(struct pt_regs *regs)
{
	return regs->regs[30];
}

static inline void procedure_link_pointer_set(struct pt_regs *regs, unsigned long val)
{
	regs->regs[30] = val;
}

#define user_mode(regs) (((regs)->pstate & 0xf) == PSR_MODE_EL0t)

/* AAPCS64: x0..x7 (the kernel's NR_REG_ARGUMENTS); like the kernel's, no stack part. */
#define NR_REG_ARGUMENTS 8
static inline unsigned long regs_get_kernel_argument(struct pt_regs *regs, unsigned int n)
{
	if (n < NR_REG_ARGUMENTS)
		return regs->regs[n];
	return 0;
}

/* The register by number (x0..x30, 31: sp), as the kernel's pt_regs_read_reg(). */
static inline unsigned long pt_regs_read_reg(const struct pt_regs *regs, int r)
{
	return r == 31 ? 0 : regs->regs[r];
}

static inline void pt_regs_write_reg(struct pt_regs *regs, int r, unsigned long val)
{
	if (r != 31)
		regs->regs[r] = val;
}

#endif
