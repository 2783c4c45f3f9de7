/*
 * A module's runtime: its probes and kretprobes, each site's dispatch, the kretprobes' entry and
 * return, the breakpoint sites' die notifier, init and exit.  Compiled once per module, included
 * by the kp_module.c that rewriter/targets/linux_module/<arch>/writer.py generates (runtime_c()),
 * whose macros give the probes' facts:
 *
 *   KP_MODULE_NAME          the module's name, a string
 *   KP_MODULE_CRCS          defined with the kernel's CRCs (Module.symvers): debugfs counters, and
 *                           on x86-64 preemption disabled in the handlers (KP_RESCHED: how the
 *                           kernel reschedules; arm64's detours mask interrupts either way)
 *   KP_MODULE_EVENT_CALLS   defined when the trace events are the kernel's own event calls
 *   KP_MODULE_INT3          defined when there are breakpoint sites (KP_INT3_*)
 *   KP_NK, KP_NR            the kprobes and kretprobes; KP_NK_SLOTS, KP_NR_SLOTS their arrays' sizes
 *   KP_EXTERNS              the handlers, as KP_EXTERN_PRE/POST/KRET(name)
 *   KP_PROBES, KP_KRETPROBES, KP_POOLS, KP_STRIDES, KP_POOL_NAMES: the tables' rows
 *   KP_KRET_LIST(X)         X(j, entry_handler, handler) of each kretprobe
 *   KP_SITES                each site's KP_DISPATCH(n, missed, body, out)
 */

#include "kp_module_head.c"
#include <kp_arch_module.h>	/* the CPU's pt_regs: KP_REGS_IP, KP_REGS_SP, KP_HIT_ADDR */

#ifdef KP_MODULE_CRCS
#include "kp_module_preempt.c"
#else
#include "kp_module_no_preempt.c"
#endif

/* --- the probes: the tables' rows are the writer's --- */

#define KP_EXTERN_PRE(h) extern int h(struct kprobe *, struct pt_regs *);
#define KP_EXTERN_POST(h) extern void h(struct kprobe *, struct pt_regs *, unsigned long);
#define KP_EXTERN_KRET(h) extern int h(struct kretprobe_instance *, struct pt_regs *);
KP_EXTERNS

#define KP_PROBE(sym, off, flag, event, idx) \
	{ .symbol_name = sym, .offset = off, .flags = flag, .name = event, .index = idx },
static struct kprobe kp_probes[KP_NK_SLOTS] = {
	KP_PROBES
};
static unsigned long kp_hits[KP_NK_SLOTS];
/* kretprobes: a pool of maxactive instances each, claimed atomically; an instance is found
 * again at return by its return-address slot (ri->fp), unique while the call lives. */
#define KP_KRETPROBE(sym, off, flag, event, idx, max, size) \
	{ .kp = { .symbol_name = sym, .offset = off, .flags = flag, .name = event, .index = idx }, \
	  .maxactive = max, .data_size = size },
static struct kretprobe kp_kretprobes[KP_NR_SLOTS] = {
	KP_KRETPROBES
};
static unsigned long kp_kret_hits[KP_NR_SLOTS], kp_kret_returns[KP_NR_SLOTS];
#define KP_POOL(j, size) static char kp_pool_##j[size] __attribute__((aligned(8)));
KP_POOLS
static const unsigned int kp_stride[KP_NR_SLOTS] = { KP_STRIDES };
static char *const kp_pools[KP_NR_SLOTS] = { KP_POOL_NAMES };
/* The instances one return can find: at most one per kretprobe (a recursive call has a slot of its own). */
#define KP_KRET_FRAME KP_NR_SLOTS

#include "kp_module_kretprobe.c"

/* --- each kretprobe's entry, from its site's dispatch, and its handler at return --- */

#define KP_KRET_ENTRY_HANDLER(eh) \
	if (eh(ri, regs)) { __atomic_store_n(&ri->kp_state, 0, __ATOMIC_RELEASE); return; }
#define KP_KRET_HANDLER(h) h(ri, regs);
#define KP_KRET_FUNCS(j, entry_handler, handler)						\
static void kp_kret_entry_##j(struct pt_regs *regs)						\
{												\
	struct kretprobe *rp = &kp_kretprobes[j];						\
	struct kretprobe_instance *ri = kp_claim(j);						\
	unsigned long *slot = KP_KRET_RET_SLOT(regs);						\
	__atomic_fetch_add(&kp_kret_hits[j], 1, __ATOMIC_RELAXED);				\
	if (!ri) {										\
		__atomic_fetch_add(&rp->nmissed, 1, __ATOMIC_RELAXED);				\
		return;										\
	}											\
	if (!rp->kp.addr)									\
		rp->kp.addr = (kprobe_opcode_t *)KP_HIT_ADDR(regs);				\
	ri->fp = KP_KRET_ENTRY_FP(regs, slot);						\
	ri->ret_addr = (kprobe_opcode_t *)*slot;						\
	entry_handler										\
	/* Found at return only once filled: a return elsewhere never meets a stale fp. */	\
	__atomic_store_n(&ri->kp_state, 1, __ATOMIC_RELEASE);					\
	*slot = (unsigned long)kp_kret_trampoline;						\
}												\
												\
static void kp_kret_handler_##j(struct kretprobe_instance *ri, struct pt_regs *regs)		\
{												\
	__atomic_fetch_add(&kp_kret_returns[j], 1, __ATOMIC_RELAXED);				\
	handler											\
}
KP_KRET_LIST(KP_KRET_FUNCS)

#define KP_KRET_CASE(j, entry_handler, handler) case j: kp_kret_handler_##j(found[i], regs); break;

/* At return: every instance of this frame (one per kretprobe on the function, as rethook
 * keeps one per kretprobe), the real return address the one that is not the trampoline
 * (the others were taken after the first swap). */
unsigned long kp_kret_return(struct pt_regs *regs)
{
	void *slot = KP_KRET_RETURN_FP(regs);
	struct kretprobe_instance *found[KP_KRET_FRAME];
	unsigned int kind[KP_KRET_FRAME];
	unsigned int j, i, n = 0;
	unsigned long ret = 0;
	int entered;
	for (j = 0; j < sizeof(kp_kretprobes) / sizeof(kp_kretprobes[0]); j++) {
		struct kretprobe *rp = &kp_kretprobes[j];
		for (i = 0; i < (unsigned int)rp->maxactive && kp_stride[j] && n < KP_KRET_FRAME; i++) {
			struct kretprobe_instance *ri = (void *)(kp_pools[j] + i * kp_stride[j]);
			if (__atomic_load_n(&ri->kp_state, __ATOMIC_ACQUIRE) != 1 || ri->fp != slot)
				continue;
			if ((unsigned long)ri->ret_addr != (unsigned long)kp_kret_trampoline)
				ret = (unsigned long)ri->ret_addr;
			found[n] = ri;
			kind[n++] = j;
		}
	}
	if (!ret) {
		_printk("\0010kprewrite: a return through the trampoline without an instance\n");
		return 0;
	}
	KP_REGS_IP(regs) = ret;
	entered = kp_enter();		/* 0: a handler of ours runs on this CPU: missed */
	for (i = 0; i < n; i++) {
		found[i]->ret_addr = (kprobe_opcode_t *)ret;
		if (!entered)
			__atomic_fetch_add(&kp_kretprobes[kind[i]].nmissed, 1, __ATOMIC_RELAXED);
		else switch (kind[i]) {
		KP_KRET_LIST(KP_KRET_CASE)
		}
		__atomic_store_n(&found[i]->kp_state, 0, __ATOMIC_RELEASE);
	}
	if (entered)
		kp_leave();
	return ret;
}

/* --- each site's dispatch, from its detour or its trap: its kprobes' handlers, called
 * directly, and its kretprobes' entries --- */

/* A hit while a handler of ours runs: each enabled probe's nmissed. */
#define KP_MISSED_K(i)								\
	if (!(kp_probes[i].flags & KPROBE_FLAG_DISABLED))			\
		__atomic_fetch_add(&kp_probes[i].nmissed, 1, __ATOMIC_RELAXED);
#define KP_MISSED_R(j)								\
	if (!(kp_kretprobes[j].kp.flags & KPROBE_FLAG_DISABLED))		\
		__atomic_fetch_add(&kp_kretprobes[j].nmissed, 1, __ATOMIC_RELAXED);
/* A kprobe's hit: counted, its address learnt, then run, by how its site is taken. */
#define KP_KPROBE(i, run)							\
	{									\
		struct kprobe *p = &kp_probes[i];				\
		if (!(p->flags & KPROBE_FLAG_DISABLED)) {			\
			__atomic_fetch_add(&kp_hits[i], 1, __ATOMIC_RELAXED);	\
			if (!p->addr)						\
				p->addr = (kprobe_opcode_t *)KP_HIT_ADDR(regs);	\
			run							\
		}								\
	}
/* opt_pre_handler(): its return value ignored. */
#define KP_RUN_OPTIMIZED(pre) pre(p, regs);
/* A breakpoint's and an ftrace site's (KP_RUN_INT3, KP_RUN_FTRACE): the arch's kp_arch_module.h
 * (x86-64's: the int3's and the call's lengths). */
#define KP_KRET_AT(j)								\
	if (!(kp_kretprobes[j].kp.flags & KPROBE_FLAG_DISABLED))		\
		kp_kret_entry_##j(regs);
#define KP_OUT out:
#define KP_DISPATCH(n, missed, body, out)					\
unsigned long kp_dispatch_##n(struct pt_regs *regs)				\
{										\
	unsigned long r = 0;							\
	if (!kp_armed)								\
		return 0;							\
	if (!kp_enter()) {							\
		missed								\
		return 0;							\
	}									\
	body									\
	out									\
	kp_leave();								\
	return r;								\
}
KP_SITES

#ifdef KP_MODULE_INT3
#include "kp_module_int3.c"
#endif

#include "kp_module_init.c"
