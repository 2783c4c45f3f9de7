/*
 * arm64: handlers run as the detour enters them, with interrupts masked (the detour masks them around
 * the dispatch, as the kernel's arm64 kprobes run their handlers from a debug exception), so not
 * preempted, and with or without the kernel's CRCs a hit while a handler of this module runs in the
 * same task (a handler that reaches a probed function of the module: kprobe_running()) is missed,
 * counted in nmissed.  The running handlers' tasks (`current`, sp_el0) are kept in a small table, one
 * entry per CPU running one (interrupts masked: one at most per CPU); past its size, hits are not
 * checked.  Included by kp_module_runtime.c.
 */

#define KP_NR_ACTIVE 64
static void *kp_active[KP_NR_ACTIVE];

static inline int kp_enter(void)
{
	void *t = kp_arch_module_current();
	unsigned int i;
	for (i = 0; i < KP_NR_ACTIVE; i++)
		if (__atomic_load_n(&kp_active[i], __ATOMIC_RELAXED) == t)
			return 0;
	for (i = 0; i < KP_NR_ACTIVE; i++) {
		void *none = 0;
		if (__atomic_compare_exchange_n(&kp_active[i], &none, t, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
			break;
	}
	return 1;
}

static inline void kp_leave(void)
{
	void *t = kp_arch_module_current();
	unsigned int i;
	for (i = 0; i < KP_NR_ACTIVE; i++)
		if (__atomic_load_n(&kp_active[i], __ATOMIC_RELAXED) == t) {
			__atomic_store_n(&kp_active[i], 0, __ATOMIC_RELEASE);
			break;
		}
}
