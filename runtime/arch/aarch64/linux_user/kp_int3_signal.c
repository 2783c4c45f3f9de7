/*
 * AArch64 breakpoint probes in a Linux user process: struct pt_regs made from the
 * SIGTRAP's machine context (struct sigcontext: regs[31], sp, pc, pstate) for
 * kp_arch_int3_regs() and the handlers, written back afterwards so a handler's
 * changes take effect at rt_sigreturn.
 *
 * A user-process fact: the linux_user recipe compiles this file in place of the
 * arch's kp_int3.c, which it includes first (one unit, as x86-64's).
 */
#include <kp_int3.c>

/* Linux's struct ucontext on arm64 (uapi/kp_uapi.h: KP_UC_REGS, KP_UC_SP...). */
#include <kp_uapi.h>

static void kp_uc_to_regs(const char *uc, struct pt_regs *r)
{
	const unsigned long *g = (const unsigned long *)(uc + KP_UC_REGS);
	for (int i = 0; i < 31; i++)
		r->regs[i] = g[i];
	r->sp = *(const unsigned long *)(uc + KP_UC_SP);
	r->pc = *(const unsigned long *)(uc + KP_UC_PC);
	r->pstate = *(const unsigned long *)(uc + KP_UC_PSTATE);
	r->orig_x0 = 0;
	r->syscallno = -1;
}

static void kp_regs_to_uc(const struct pt_regs *r, char *uc)
{
	unsigned long *g = (unsigned long *)(uc + KP_UC_REGS);
	for (int i = 0; i < 31; i++)
		g[i] = r->regs[i];
	*(unsigned long *)(uc + KP_UC_SP) = r->sp;
	*(unsigned long *)(uc + KP_UC_PC) = kp_region_ip(r->pc);
	/* The kernel keeps only the user-changeable bits (NZCV...). */
	/* The kernel keeps only the user-changeable bits (NZCV...).  BTYPE is
	 * cleared: the brk took the landing-pad check (BRK is compatible with
	 * every BTYPE) and the probed instruction runs elsewhere (simulated or in
	 * its slot), so the branch that set BTYPE is spent, as when the kernel
	 * skips an emulated instruction (arm64_skip_faulting_instruction()). */
	*(unsigned long *)(uc + KP_UC_PSTATE) = r->pstate & ~PSR_BTYPE_MASK;
}

/*
 * A SIGTRAP raised by the CPU (not sent by kill): ours if it is one of our
 * brks; 0 otherwise (the platform layer passes it on).
 */
int kp_arch_int3_trap(void *uc)
{
	struct pt_regs regs;
	kp_uc_to_regs(uc, &regs);
	if (!kp_arch_int3_regs(&regs, 1))
		return 0;
	kp_regs_to_uc(&regs, uc);
	return 1;
}
