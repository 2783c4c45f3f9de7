/*
 * The generic halves of a breakpoint (INT3) probe hit: kernel/kprobes.c's
 * aggr_pre_handler()/aggr_post_handler() with the same semantics as the
 * optimized path in kp_core.c -- aggregation, nmissed on reentrancy, disabled
 * probes, KPREWRITE_ENABLED=0, per-thread hit counters.  The arch trap code
 * (arch/<arch>/kp_int3.c) builds pt_regs and runs the instruction out of line.
 */
#include "kp_internal.h"

/* Before the probed instruction; regs->ip is the address after the int3. */
int kp_trap_pre(struct kp_site *s, struct pt_regs *regs)
{
	if (unlikely(!s))				/* before the tables are built */
		return KP_TRAP_MISSED;
	struct kp_thread *t = kp_current_thread();	/* NULL: disarmed */
	if (unlikely(!t))
		return KP_TRAP_MISSED;
	if (unlikely(t->active)) {
		kp_count_missed(s);
		return KP_TRAP_MISSED;
	}
	unsigned long ip = regs->ip;
	t->active = 1;
	int stop = kp_run_pre_handlers(t, s, regs);
	t->active = 0;
	/* A path change only when the handler moved regs->ip, as on the
	 * optimized path (kp_pre_dispatch()). */
	return stop && regs->ip != ip ? KP_TRAP_CHANGED : KP_TRAP_RUN;
}

/* After the probed instruction ran out of line; regs->ip is where it resumes.
 * A hit counted as missed is still "active" on this thread, so nothing runs. */
void kp_trap_post(struct kp_site *s, struct pt_regs *regs)
{
	struct kp_thread *t = s ? kp_current_thread() : 0;
	if (unlikely(!t || t->active))
		return;
	t->active = 1;
	kp_run_post_handlers(s, regs);
	t->active = 0;
}
