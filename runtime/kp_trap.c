/*
 * The generic halves of a breakpoint (INT3) probe hit: kernel/kprobes.c's
 * aggr_pre_handler()/aggr_post_handler() with the same semantics as the
 * optimized path in kp_core.c -- aggregation, nmissed on reentrancy, disabled
 * probes, KPREWRITE_ENABLED=0, per-thread hit counters.  The arch trap code
 * (arch/<arch>/kp_int3.c) builds pt_regs and runs the instruction out of line.
 */
#include "kp_internal.h"

static struct kp_thread *kp_trap_thread(void)
{
	return kp_thread_slow(kp_platform_thread_key());
}

/* Before the probed instruction; regs->ip is the address after the int3. */
int kp_trap_pre(struct kp_site *s, struct pt_regs *regs)
{
	if (unlikely(!kp_rt.armed))
		return KP_TRAP_MISSED;
	struct kp_thread *t = kp_trap_thread();
	struct kprobe *const *pp = &kp_site_probes[s->first];
	unsigned int n = s->count;
	if (unlikely(!t))
		return KP_TRAP_MISSED;
	if (unlikely(t->active)) {
		/* kprobes_inc_nmissed_count(): a hit from inside a handler. */
		for (unsigned int i = 0; i < n; i++)
			if (!kprobe_disabled(pp[i]))
				__atomic_fetch_add(&pp[i]->nmissed, 1, __ATOMIC_RELAXED);
		return KP_TRAP_MISSED;
	}
	t->active = 1;
	for (unsigned int i = 0; i < n; i++) {
		struct kprobe *p = pp[i];
		if (kprobe_disabled(p))
			continue;
		t->hits[p->index]++;
		if (p->pre_handler && p->pre_handler(p, regs)) {
			t->active = 0;
			return KP_TRAP_CHANGED;
		}
	}
	t->active = 0;
	return KP_TRAP_RUN;
}

/* After the probed instruction ran out of line; regs->ip is where it resumes.
 * A hit counted as missed is still "active" on this thread, so nothing runs. */
void kp_trap_post(struct kp_site *s, struct pt_regs *regs)
{
	if (unlikely(!kp_rt.armed))
		return;
	struct kp_thread *t = kp_trap_thread();
	if (unlikely(!t || t->active))
		return;
	t->active = 1;
	kp_run_post_handlers(s, regs);
	t->active = 0;
}
