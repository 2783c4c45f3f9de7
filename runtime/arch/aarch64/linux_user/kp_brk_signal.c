/*
 * AArch64 breakpoint probes in a Linux user process: the hooks of the platform's
 * SIGTRAP glue (kp_breakpoint_signal.h, included last) on the SIGTRAP's machine
 * context (struct sigcontext: regs[31], sp, pc, pstate), copied into struct pt_regs
 * for kp_arch_breakpoint_regs() and the handlers, and written back afterwards.
 *
 * A user-process fact: the linux_user recipe compiles this file in place of the
 * arch's kp_brk.c, which it includes first (one unit, as x86-64's).
 */
#include <kp_brk.c>

/* Linux's struct ucontext on arm64 (uapi/kp_uapi.h: KP_UC_REGS, KP_UC_SP...). */
#include <kp_uapi.h>

/* A single-stepped copy ends with brk #0x006. */
#define KP_SIGTRAP_SS_TRAP 1

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

#include <kp_breakpoint_signal.h>

/* The light detours' alternatives (LSE atomics where the CPU has them): compiled in this
 * unit, the recipe's one C file of the arch's user-process folder. */
#include "kp_alternatives.c"
