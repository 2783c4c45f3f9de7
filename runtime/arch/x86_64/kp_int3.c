/*
 * x86-64 breakpoint probes: kprobe_int3_handler(), the emulation of
 * prepare_emulation()'s branches, and resume_singlestep() of
 * arch/x86/kernel/kprobes/core.c, on struct pt_regs: the kernel's own trap frame
 * (linux_kernel/kp_int3_hook.c) or a Linux user signal context converted to one
 * (linux_user/kp_int3_signal.c).
 */
#include "kp_internal.h"
#include "kp_breakpoint.h"

#define X86_EFLAGS_CF 0x0001UL
#define X86_EFLAGS_PF 0x0004UL
#define X86_EFLAGS_ZF 0x0040UL
#define X86_EFLAGS_SF 0x0080UL
#define X86_EFLAGS_TF 0x0100UL
#define X86_EFLAGS_OF 0x0800UL

/* Emulated kinds (rewriter/arch/x86_64/kprobe_xol.py). */
enum { KP_EMU_JMP = 1, KP_EMU_CALL, KP_EMU_JCC, KP_EMU_LOOP, KP_EMU_JCXZ, KP_EMU_RET,
       KP_EMU_JMP_REG, KP_EMU_CALL_REG, KP_EMU_XBEGIN, KP_EMU_JMP_MEM, KP_EMU_CALL_MEM };

_Static_assert(sizeof(struct kp_breakpoint_site) == 64, "kp_breakpoint_site: 64 bytes, indexed by a shift");

/* The condition codes of jcc (and cmovcc, setcc): cc>>1 picks the test, bit 0 negates. */
static int kp_cond(unsigned long f, unsigned int cc)
{
	int r;
	switch (cc >> 1) {
	case 0: r = !!(f & X86_EFLAGS_OF); break;
	case 1: r = !!(f & X86_EFLAGS_CF); break;
	case 2: r = !!(f & X86_EFLAGS_ZF); break;
	case 3: r = !!(f & (X86_EFLAGS_CF | X86_EFLAGS_ZF)); break;
	case 4: r = !!(f & X86_EFLAGS_SF); break;
	case 5: r = !!(f & X86_EFLAGS_PF); break;
	case 6: r = !(f & X86_EFLAGS_SF) != !(f & X86_EFLAGS_OF); break;
	default: r = (f & X86_EFLAGS_ZF) || (!(f & X86_EFLAGS_SF) != !(f & X86_EFLAGS_OF)); break;
	}
	return (cc & 1) ? !r : r;
}

/* kprobe_emulate_{call,jmp,jcc,loop,ret,call_indirect,jmp_indirect}(). */
static void kp_emulate(const struct kp_breakpoint_site *d, struct pt_regs *regs, unsigned long bias)
{
	unsigned long next = d->addr + bias + d->size, target = d->target + bias, v;
	int taken;
	switch (d->kind) {
	case KP_EMU_JMP:
		regs->ip = target;
		return;
	case KP_EMU_CALL:
		regs->sp -= 8;
		*(unsigned long *)regs->sp = next;
		regs->ip = target;
		return;
	case KP_EMU_JCC:
		regs->ip = kp_cond(regs->flags, d->cc) ? target : next;
		return;
	case KP_EMU_LOOP:	/* e0 loopne, e1 loope, e2 loop */
		regs->cx = d->addr32 ? (unsigned int)(regs->cx - 1) : regs->cx - 1;
		taken = regs->cx != 0;
		if (d->cc == 0)
			taken &= !(regs->flags & X86_EFLAGS_ZF);
		else if (d->cc == 1)
			taken &= !!(regs->flags & X86_EFLAGS_ZF);
		regs->ip = taken ? target : next;
		return;
	case KP_EMU_JCXZ:
		regs->ip = (d->addr32 ? (unsigned int)regs->cx : regs->cx) == 0 ? target : next;
		return;
	case KP_EMU_RET:
		regs->ip = *(unsigned long *)regs->sp;
		regs->sp += 8 + d->imm;
		return;
	case KP_EMU_JMP_REG:
		regs->ip = ((unsigned long *)regs)[d->reg];
		return;
	case KP_EMU_JMP_MEM:	/* beyond the kernel, which refuses memory operands */
	case KP_EMU_CALL_MEM:
		if (d->rip) {
			v = target;
		} else {
			v = d->target;
			if (d->reg != 0xff)
				v += ((unsigned long *)regs)[d->reg];
			if (d->index != 0xff)
				v += ((unsigned long *)regs)[d->index] * d->scale;
		}
		v = *(unsigned long *)v;
		if (d->kind == KP_EMU_CALL_MEM) {
			regs->sp -= 8;
			*(unsigned long *)regs->sp = next;
		}
		regs->ip = v;
		return;
	case KP_EMU_XBEGIN:	/* the transaction aborts at once: EAX = 0, fallback path */
		regs->ax = 0;
		regs->ip = target;
		return;
	case KP_EMU_CALL_REG:
		v = ((unsigned long *)regs)[d->reg];
		regs->sp -= 8;
		*(unsigned long *)regs->sp = next;
		regs->ip = v;
		return;
	}
}

/* The arch's hooks (kp_breakpoint.h). */

/* kprobe_int3_handler(): the int3 is the byte before the trap's ip. */
KP_ARCH_BREAKPOINT_HOOK unsigned long kp_arch_breakpoint_addr(const struct pt_regs *regs)
{
	return regs->ip - 1;
}

/* No trap of its own: every int3 of the runtime is a probe's or a copy's end. */
KP_ARCH_BREAKPOINT_HOOK int kp_arch_breakpoint_own(struct pt_regs *regs)
{
	(void)regs;
	return 0;
}

/* A single-stepped copy ends under the trap flag (the trap's ip is the copy's end) or,
 * with ss_trap, at the int3 after it (as the kernel's own kprobes since 5.14: one byte
 * past the end); no other trap can be a copy's end. */
KP_ARCH_BREAKPOINT_HOOK unsigned long kp_arch_breakpoint_ss_end(const struct pt_regs *regs, int ss_trap)
{
	return ss_trap || (regs->flags & X86_EFLAGS_TF) ? regs->ip - ss_trap : 0;
}

/* prepare_emulation()'s branches. */
KP_ARCH_BREAKPOINT_HOOK int kp_arch_breakpoint_emulate(const struct kp_breakpoint_site *d, struct pt_regs *regs,
							  unsigned long bias)
{
	if (d->mode != KP_XOL_EMULATE)
		return 0;
	kp_emulate(d, regs, bias);
	return 1;
}

/* A boosted copy (the slot runs the post stub itself and jumps back), or a copy
 * single-stepped: the trap flag, or the int3 after it. */
KP_ARCH_BREAKPOINT_HOOK void kp_arch_breakpoint_resume(const struct kp_breakpoint_site *d, struct pt_regs *regs,
							 unsigned long bias, int ss_trap)
{
	regs->ip = d->slot + bias;
	if (d->mode != KP_XOL_BOOST && !ss_trap)
		regs->flags |= X86_EFLAGS_TF;
}

/* resume_singlestep(): RIP-relative operands were relocated in the copy, so only the ip
 * moves back, after the original; the trap flag ends. */
KP_ARCH_BREAKPOINT_HOOK void kp_arch_breakpoint_ss_resume(const struct kp_breakpoint_site *d, struct pt_regs *regs,
							    unsigned long bias)
{
	regs->flags &= ~X86_EFLAGS_TF;
	regs->ip = d->addr + bias + d->size;
}

/*
 * The trap at the int3 that ends a single-stepped copy (Rules.singlestep_breakpoint): the
 * kernel's kprobe_is_ss() without a per-CPU record.  The slot carries its descriptor's
 * index after its jmp back (kprobe_xol.slot_code()), read only once the trap's address
 * is within the span of such ends; the descriptor confirms it.
 */
static inline __attribute__((always_inline)) struct kp_breakpoint_site *
kp_int3_ss_end(unsigned long ip, unsigned long bias)
{
	unsigned long at = ip - 1 - bias;
	if (at < kp_breakpoint_ss_first || at > kp_breakpoint_ss_last)
		return 0;
	unsigned int i = *(const unsigned int *)(ip + 5);
	if (i >= kp_nbreakpoints || kp_breakpoints[i].ss_end != at)
		return 0;
	return &kp_breakpoints[i];
}

#ifdef KP_PLATFORM_BREAKPOINT_HOOK	/* a kernel: its tables are built at boot too */
/*
 * kp_arch_breakpoint_regs(regs, 1) for a kernel's #BP, the common cases first, as
 * kprobe_int3_handler() has them: a site whose instruction is boosted or
 * single-stepped, with one probe and its pre_handler, once kp_site_fast[] is
 * published, and the trap at the end of a single-stepped copy.  Everything else
 * (emulated branches, kretprobe exits, aggregated probes, a probe without a
 * pre_handler, a nested hit counted as missed, tables not yet built, probes
 * disarmed) takes the general path.  Kept to the few values the
 * pre_handler's call must preserve: its cost is the trap's, twice per hit.  Entered in
 * kprobe_int3_handler()'s place (the platform's hook): 1 when the int3 was ours (regs
 * updated), else what the platform's kp_platform_breakpoint_not_ours() says (the kernel's own
 * kprobe_int3_handler(), tail-called).
 */
/* kprobe_post_process() at a site with a post_handler: out of line, so the common
 * path saves no registers for it. */
static __attribute__((noinline)) int kp_int3_bp_post(const struct kp_breakpoint_site *d, struct pt_regs *regs)
{
	kp_trap_post(kp_site(d->site), regs);
	return 1;
}

/* A hit at one of our int3s (kprobe_int3_handler()'s get_kprobe() found it): out of
 * line, so the single-step's end saves no registers for the pre_handler's call.  The
 * site's probe and pre_handler from its kp_site_fast[] entry, the CPU's block by its
 * number, as the clean hit has them (kp_optimized_clean_callback()); NULL until every
 * CPU's block is in its slot. */
static __attribute__((noinline)) int kp_int3_bp_hit(struct kp_breakpoint_site *d, struct pt_regs *regs)
{
	const struct kp_site_fast *f = kp_site_fast;
	if (likely(d->plain && f)) {
		f += d->site;
		struct kprobe *p = f->p;
		struct kp_thread *t = kp_thread_table[kp_platform_cpu_slot()];
		/* t->active and p->flags read once each, as plain loads
		 * (kprobe_disabled()'s test). */
		if (likely(p && !*(const unsigned int *)&t->active)) {
			if (likely(!(*(const unsigned int *)&p->flags & (KPROBE_FLAG_DISABLED | KPROBE_FLAG_GONE)))) {
				t->hits[p->index]++;	/* aggr_pre_handler() */
				t->active = 1;
				int stop = f->pre(p, regs);
				t->active = 0;
				/* A path change only when it moved regs->ip (the
				 * address after the int3), as kp_trap_pre(). */
				if (unlikely(stop) && regs->ip != d->addr + kp_rt.bias + 1)
					return 1;
			}
			/* setup_singlestep(): the copy (an int3 after it, or the jmp back) */
			regs->ip = d->slot + kp_rt.bias;
			return 1;
		}
	}
	return kp_arch_breakpoint_regs(regs, 1);
}

int kp_arch_int3_bp(struct pt_regs *regs)
{
	if (unlikely(regs->cs & 3))	/* from user mode: never ours */
		return kp_platform_breakpoint_not_ours(regs);
	unsigned long bias = kp_rt.bias, ip = regs->ip;
	/* First the single-step's end: a site's address fails its span check at once. */
	struct kp_breakpoint_site *d = kp_int3_ss_end(ip, bias);
	if (d) {
		/* resume_singlestep(), then kprobe_post_process(): the post_handlers */
		regs->ip = d->addr + bias + d->size;
		if (unlikely(d->post))
			return kp_int3_bp_post(d, regs);
		return 1;
	}
	d = kp_breakpoint_lookup(ip - 1 - bias);
	if (d)
		return kp_int3_bp_hit(d, regs);
	return kp_platform_breakpoint_not_ours(regs);	/* the kernel's kprobes, kgdb, ... */
}

/*
 * An int3 taken through the kernel's early IDT, before idt_setup_early_traps()
 * (the platform's early hook): 1 if it was ours (regs updated to run the probed
 * instruction), 0 otherwise (the kernel's do_early_exception() gets it).  The
 * tables are not built yet, so no handler runs: the hit counts in kp_early_hits
 * (kp_site()), as any other before setup_per_cpu_areas(); no per-CPU data is
 * touched.  The single-step's end (the int3 after the copy) resumes after the
 * instruction.  One case stays the kernel's: an emulated call whose push would
 * land inside the early frame's iret words (early_idt_handler_common leaves no
 * gap above the frame, as idtentry's create_gap does for #BP).
 */
int kp_arch_int3_early(struct pt_regs *regs)
{
	if (regs->cs & 3)
		return 0;
	unsigned long bias = kp_rt.bias, ip = regs->ip;
	struct kp_breakpoint_site *d = kp_int3_ss_end(ip, bias);
	if (d) {
		regs->ip = d->addr + bias + d->size;
		if (unlikely(d->post && kp_tables_built))
			kp_int3_bp_post(d, regs);
		return 1;
	}
	d = kp_breakpoint_lookup(ip - 1 - bias);
	if (!d)
		return 0;
	if (d->mode == KP_XOL_EMULATE &&
	    (d->kind == KP_EMU_CALL || d->kind == KP_EMU_CALL_REG || d->kind == KP_EMU_CALL_MEM) &&
	    regs->sp - 8 < (unsigned long)(regs + 1))
		return 0;
	return kp_arch_breakpoint_regs(regs, 1);
}
#endif
