/*
 * A module's kretprobe instances: a free one claimed for a hit (kp_module_runtime.c includes it after the
 * pools it names).
 */

extern char kp_kret_trampoline[];

static struct kretprobe_instance *kp_claim(unsigned int j)
{
	unsigned int i;
	for (i = 0; i < (unsigned int)kp_kretprobes[j].maxactive; i++) {
		struct kretprobe_instance *ri = (void *)(kp_pools[j] + i * kp_stride[j]);
		unsigned int free = 0;
		/* 2: claimed, being filled; 1 once its fp and ret_addr are set (kp_kret_entry_N) */
		if (__atomic_compare_exchange_n(&ri->kp_state, &free, 2, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
			ri->rp = &kp_kretprobes[j];
			return ri;
		}
	}
	return 0;
}
