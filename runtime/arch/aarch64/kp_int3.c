/*
 * AArch64 breakpoint probes: the kernel's kprobe_breakpoint_handler() and
 * kprobe_breakpoint_ss_handler() (arch/arm64/kernel/probes/kprobes.c) and the
 * simulation of PC-relative instructions (simulate-insn.c), on struct pt_regs;
 * in a Linux user process made from the SIGTRAP's machine context
 * (linux_user/kp_int3_signal.c, which includes this file).
 *
 * (Named kp_int3.c as the x86-64 file it mirrors.)
 */
#include "kp_internal.h"
#include "kp_brk.h"

extern char kp_optprobe_resume_brk[];	/* optprobe_entry.S */

#define PSR_N 0x80000000UL
#define PSR_Z 0x40000000UL
#define PSR_C 0x20000000UL
#define PSR_V 0x10000000UL
#define PSR_BTYPE_MASK 0xC00UL

/* get_kprobe(): the descriptor of the brk at link-time address `addr`. */
static inline __attribute__((always_inline)) struct kp_int3_site *kp_brk_lookup(unsigned long addr)
{
	unsigned int h = (addr * 0x61C8864680B583EBUL) >> kp_int3_hash_shift;
	for (;;) {
		unsigned int i = kp_int3_hash[h];
		if (i >= kp_nint3)
			return 0;
		if (likely(kp_int3_sites[i].addr == addr))
			return &kp_int3_sites[i];
		h = (h + 1) & kp_int3_hash_mask;
	}
}

/* The single-step site whose slot's brk #0x006 is at `end` (sorted by it). */
static struct kp_int3_site *kp_brk_ss_lookup(unsigned long end)
{
	unsigned int lo = 0, hi = kp_nint3_ss;
	while (lo < hi) {
		unsigned int mid = (lo + hi) / 2;
		struct kp_int3_site *d = &kp_int3_sites[kp_int3_ss[mid]];
		if (d->ss_end == end)
			return d;
		if (d->ss_end < end)
			lo = mid + 1;
		else
			hi = mid;
	}
	return 0;
}

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
static void kp_simulate(const struct kp_int3_site *d, struct pt_regs *regs, unsigned long bias)
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

/*
 * kprobe_breakpoint_handler() / kprobe_breakpoint_ss_handler() on the trap's
 * registers: 1 if the brk was ours (regs updated to resume), 0 otherwise.
 * regs->pc is the brk's address, as the kernel reports it.
 */
int kp_arch_int3_regs(struct pt_regs *regs, int ss_trap)
{
	if (unlikely(kp_rt.state != 2))
		kp_relocate();
	unsigned long bias = kp_rt.bias, pc = regs->pc;
	if (unlikely(pc == (unsigned long)kp_optprobe_resume_brk)) {
		/* A detour's slow resume (optprobe_entry.S): all of the pt_regs at sp. */
		const struct pt_regs *saved = (const struct pt_regs *)regs->sp;
		for (int i = 0; i < 31; i++)
			regs->regs[i] = saved->regs[i];
		regs->sp = saved->sp;
		regs->pc = saved->pc;
		regs->pstate = (regs->pstate & ~KP_ARITH_FLAGS) | (saved->pstate & KP_ARITH_FLAGS);
		return 1;
	}
	struct kp_int3_site *d = kp_brk_lookup(pc - bias);
	if (d) {
		struct kp_site *s = kp_site(d->site);
		int r = kp_trap_pre(s, regs);
		if (d->kret && r != KP_TRAP_CHANGED)	/* at an exit: the return hook, then the exit */
			kp_kretprobe_int3_hook(d->kret, regs);
		if (r != KP_TRAP_CHANGED) {
			if (d->mode == KP_XOL_SIMULATE) {
				kp_simulate(d, regs, bias);
				if (r == KP_TRAP_RUN)
					kp_trap_post(s, regs);
			} else {
				/* setup_singlestep(): the copy, then brk #0x006 */
				regs->pc = d->slot + bias;
			}
		}
		return 1;
	}
	if (kp_nint3_ss && (d = kp_brk_ss_lookup(pc - bias))) {
		/* kprobes_post_process_ss(): the copy was no branch, so the
		 * original next instruction follows. */
		regs->pc = d->addr + bias + 4;
		kp_trap_post(kp_site(d->site), regs);
		return 1;
	}
	return 0;
}
