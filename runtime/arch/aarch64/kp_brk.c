/*
 * AArch64 breakpoint probes: the kernel's kprobe_breakpoint_handler() and
 * kprobe_breakpoint_ss_handler() (arch/arm64/kernel/probes/kprobes.c) and the
 * simulation of PC-relative instructions (simulate-insn.c), on struct pt_regs;
 * in a Linux user process made from the SIGTRAP's machine context
 * (linux_user/kp_brk_signal.c, which includes this file).  The arch-neutral half
 * (the descriptors' lookups, a hit, a single-step's end) is kp_breakpoint.h.
 */
#include "kp_internal.h"
#include "kp_brk.h"
#include "kp_breakpoint.h"

extern char kp_optprobe_resume_brk[];	/* optprobe_entry.S */

#define PSR_N 0x80000000UL
#define PSR_Z 0x40000000UL
#define PSR_C 0x20000000UL
#define PSR_V 0x10000000UL
#define PSR_BTYPE_MASK 0xC00UL

/* aarch32_opcode_cond_checks[] of the kernel (arch/arm64/kernel/insn.c), on NZCV. */
static int kp_cond(unsigned long p, unsigned int cond)
{
	int n = !!(p & PSR_N), z = !!(p & PSR_Z), c = !!(p & PSR_C), v = !!(p & PSR_V), r;
	switch (cond >> 1) {
	case 0: r = z; break;			/* eq */
	case 1: r = c; break;			/* hs */
	case 2: r = n; break;			/* mi */
	case 3: r = v; break;			/* vs */
	case 4: r = c && !z; break;		/* hi */
	case 5: r = n == v; break;		/* ge */
	case 6: r = n == v && !z; break;	/* gt */
	default: return 1;			/* al, nv */
	}
	return (cond & 1) ? !r : r;
}

/* Register n of pt_regs, 31 being xzr for the simulated instructions that name one. */
static inline unsigned long kp_reg(const struct pt_regs *regs, unsigned int n)
{
	return n == 31 ? 0 : regs->regs[n];
}

static inline void kp_set_reg(struct pt_regs *regs, unsigned int n, unsigned long v)
{
	if (n != 31)
		regs->regs[n] = v;
}

/* simulate_b_bl(), simulate_b_cond(), simulate_cbz_cbnz(), simulate_tbz_tbnz(),
 * simulate_adr_adrp(), simulate_ldr_literal(), simulate_ldrsw_literal(),
 * simulate_br_blr_ret(). */
static void kp_simulate(const struct kp_breakpoint_site *d, struct pt_regs *regs, unsigned long bias)
{
	unsigned long next = d->addr + bias + 4, target = d->target + bias, v;
	int taken;
	switch (d->kind) {
	case KP_SIM_BL:
		regs->regs[30] = next;
		/* fall through */
	case KP_SIM_B:
		regs->pc = target;
		return;
	case KP_SIM_BCOND:
		regs->pc = kp_cond(regs->pstate, d->cc) ? target : next;
		return;
	case KP_SIM_CBZ:
		v = kp_reg(regs, d->reg);
		if (!d->sf)
			v = (unsigned int)v;
		taken = (v == 0) != d->cc;
		regs->pc = taken ? target : next;
		return;
	case KP_SIM_TBZ:
		taken = ((kp_reg(regs, d->reg) >> d->bit) & 1) == d->cc;
		regs->pc = taken ? target : next;
		return;
	case KP_SIM_ADR:
		kp_set_reg(regs, d->reg, target);
		break;
	case KP_SIM_LDR_LIT:
		kp_set_reg(regs, d->reg, d->sf ? *(unsigned long *)target : *(unsigned int *)target);
		break;
	case KP_SIM_LDRSW_LIT:
		kp_set_reg(regs, d->reg, (unsigned long)(long)*(int *)target);
		break;
	case KP_SIM_BLR:
		v = kp_reg(regs, d->reg);
		regs->regs[30] = next;
		regs->pc = v;
		return;
	case KP_SIM_BR:
	case KP_SIM_RET:
		regs->pc = kp_reg(regs, d->reg);
		return;
	}
	regs->pc = next;
}

/* The arch's hooks (kp_breakpoint.h). */

/* The brk's own address: the kernel reports the pc at it. */
KP_ARCH_BREAKPOINT_HOOK unsigned long kp_arch_breakpoint_addr(const struct pt_regs *regs)
{
	return regs->pc;
}

/* A detour's slow resume (optprobe_entry.S's brk, no probe's): all of the pt_regs at sp,
 * the arithmetic flags of pstate. */
KP_ARCH_BREAKPOINT_HOOK int kp_arch_breakpoint_own(struct pt_regs *regs)
{
	if (likely(regs->pc != (unsigned long)kp_optprobe_resume_brk))
		return 0;
	const struct pt_regs *saved = (const struct pt_regs *)regs->sp;
	for (int i = 0; i < 31; i++)
		regs->regs[i] = saved->regs[i];
	regs->sp = saved->sp;
	regs->pc = saved->pc;
	regs->pstate = (regs->pstate & ~KP_ARITH_FLAGS) | (saved->pstate & KP_ARITH_FLAGS);
	return 1;
}

/* A single-stepped copy ends with brk #0x006, at its own address. */
KP_ARCH_BREAKPOINT_HOOK unsigned long kp_arch_breakpoint_ss_end(const struct pt_regs *regs, int ss_trap)
{
	(void)ss_trap;
	return regs->pc;
}

/* simulate-insn.c's instructions (PC-relative and branches). */
KP_ARCH_BREAKPOINT_HOOK int kp_arch_breakpoint_emulate(const struct kp_breakpoint_site *d, struct pt_regs *regs,
							  unsigned long bias)
{
	if (d->mode != KP_XOL_SIMULATE)
		return 0;
	kp_simulate(d, regs, bias);
	return 1;
}

/* setup_singlestep(): the copy, then brk #0x006. */
KP_ARCH_BREAKPOINT_HOOK void kp_arch_breakpoint_resume(const struct kp_breakpoint_site *d, struct pt_regs *regs,
							 unsigned long bias, int ss_trap)
{
	(void)ss_trap;
	regs->pc = d->slot + bias;
}

/* kprobes_post_process_ss(): the copy was no branch, so the original next instruction
 * follows. */
KP_ARCH_BREAKPOINT_HOOK void kp_arch_breakpoint_ss_resume(const struct kp_breakpoint_site *d, struct pt_regs *regs,
							    unsigned long bias)
{
	regs->pc = d->addr + bias + 4;
}
