/*
 * kretprobes in a kernel image: the user-space design (every exit hooked, the return
 * address never replaced), with instances per task as the kernel's own.
 *
 * - entry (the kretprobe's kp.pre_handler, at the function's entry): claim an
 *   instance from the kretprobe's pool of maxactive (none free: nmissed), run the
 *   entry_handler (non-zero: no return handler for this call), record the return
 *   address and its slot (ri->ret_addr, ri->fp) and file the instance under the
 *   current task in a hash table of tasks (kernel/kprobes.c before 5.11:
 *   pre_handler_kretprobe(), kretprobe_inst_table[] with its per-bucket locks);
 * - each exit (on x86-64 a `jmp __x86_return_thunk`, whose .return_sites entry the
 *   rewriter points at the jump's copy in the detour, so apply_returns() patches the
 *   copy) calls a return hook first, with the stack pointer at the slot: the current
 *   task's instances recorded at that slot fire, newest first (several kretprobes on one
 *   function, or a tail call into another return-probed function, share the slot), with
 *   regs_return_value() the return value, regs->ip the return address and regs->sp the
 *   stack pointer after the return (kp_kretprobe_return(), kp_kretprobe_return_clean());
 * - a tail call to a function whose returns are hooked leaves the instances for that
 *   function's exits (the same slot); a tail call to any other function swaps the
 *   slot for kp_kretprobe_trampoline (kp_kretprobe_tail_swap()), for that path only;
 * - a function whose exits cannot all be hooked (an exception-table entry, a jump
 *   through a retpoline thunk or a static call, an exit region the rules refuse: the
 *   rewriter says which) takes the kernel's way: its entry swaps the return address
 *   for the trampoline (arch_prepare_kretprobe(), rp->kp_mode), which calls
 *   kp_kretprobe_trampoline_handler() and returns to the real address.
 *
 * Either way the instances of a slot are taken off the table together (kp_take_at()),
 * and instances of the task filed after them (frames entered inside that never
 * returned) are freed without a handler.  An exit hook leaves a slot that holds the
 * trampoline to the trampoline.
 *
 * The table holds only tasks inside a return-probed function, newest instance first
 * in each bucket, so that a task's exit usually finds its instance first; a task is
 * found by `current` wherever it runs, so a task switched out inside the function returns on
 * another CPU with its instances.  Interrupt handlers run with the interrupted
 * task's `current`: their frames nest inside the task's, LIFO.  Nothing is allocated
 * in probe context: the pools come from memblock at the setup_per_cpu_areas() boot
 * hook (kp_kernel_kretprobes_init(), called by platform.c); a hit before it misses.
 * The table's locks are taken with the CPU's `active` flag set, so nothing on the
 * same CPU (an interrupt, an NMI: their hits count as missed, their exit hooks do
 * nothing) can wait for a lock it holds; handlers run outside the locks, with
 * preemption disabled, as the kernel runs them.
 *
 * A task that ends inside a return-probed function (do_exit() never returns) has its
 * instances freed when its task_struct is (kp_kernel_kret_flush_task(), a runtime
 * probe on free_task(): the kernel's kprobe_flush_task()).
 */
#include "kp_internal.h"

extern char kp_kretprobe_trampoline[];
#define TRAMP ((unsigned long)kp_kretprobe_trampoline)
#define KP_KRET_TRAMPOLINE 1	/* rp->kp_mode: the entry swaps the return address */

/* An instance with the fields the per-task table needs before the kernel's
 * struct kretprobe_instance (whose layout the handler API fixes). */
struct kp_kri {
	struct kp_kri *next;		/* in its bucket, newest first */
	unsigned long task;		/* ri->task */
	struct kretprobe_instance ri;
};
#define KRI(ri) ((struct kp_kri *)((char *)(ri) - __builtin_offsetof(struct kp_kri, ri)))

/* kretprobe_inst_table[]: KPROBE_HASH_BITS 6, a lock per bucket. */
#define KP_KRET_BUCKETS 64
static struct kp_kret_bucket {
	struct kp_kri *head;
	unsigned int lock;
} kp_kret_table[KP_KRET_BUCKETS];

static inline struct kp_kret_bucket *kp_bucket(unsigned long task)
{
	return &kp_kret_table[((task >> 6) * 0x9e3779b97f4a7c15UL) >> 58];	/* hash_ptr(tsk, 6) */
}

/*
 * A bucket's lock.  Interrupts stay on: every holder runs with this CPU's `active`
 * set (the dispatch sets it before a pre_handler, the trampoline handler before its
 * walk), so an interrupt or NMI arriving meanwhile counts its probe hits as missed
 * and swaps no return address, and no return of its own can come through the
 * trampoline: nothing on this CPU waits for the lock it holds.  A CPU without its
 * block (no `active` flag) takes it with interrupts off (irqsave).
 */
static inline unsigned long kp_bucket_lock(struct kp_kret_bucket *b, int irqsave)
{
	unsigned long flags = 0;
	if (irqsave)
		flags = kp_arch_local_irq_save();
	while (__atomic_exchange_n(&b->lock, 1, __ATOMIC_ACQUIRE))
		while (__atomic_load_n(&b->lock, __ATOMIC_RELAXED))
			kp_arch_spin_relax();
	return flags;
}

static inline void kp_bucket_unlock(struct kp_kret_bucket *b, unsigned long flags)
{
	__atomic_store_n(&b->lock, 0, __ATOMIC_RELEASE);
	kp_arch_local_irq_restore(flags);	/* 0 (no irqsave): nothing to do */
}

static inline unsigned long kp_task(void)
{
	return (unsigned long)kp_kernel_current();
}

/* The pools, from memblock at the setup_per_cpu_areas() hook, once the tables are built
 * (maxactive <= 0: the kernel's default, max(10, 2 * num_possible_cpus())): one block
 * for all (a kretprobe on every function: some 42,000 pools), each pool 64-byte aligned. */
static unsigned long kp_kret_pool_size(const struct kretprobe *rp)
{
	return ((unsigned long)rp->kp_stride * rp->maxactive + 63) & ~63UL;
}

void kp_kernel_kretprobes_init(void)
{
	unsigned long total = 0;
	if (!kp_kretprobes)		/* the tables could not be built: every call misses */
		return;
	for (unsigned int i = 0; i < kp_nkretprobes; i++) {
		struct kretprobe *rp = &kp_kretprobes[i];
		if (rp->maxactive <= 0)
			rp->maxactive = 2 * (int)nr_cpu_ids > 10 ? 2 * (int)nr_cpu_ids : 10;
		rp->kp_stride = (sizeof(struct kp_kri) + rp->data_size + 7) & ~7UL;
		total += kp_kret_pool_size(rp);
	}
	char *pool = total ? memblock_alloc_try_nid(total, 64, 0, 0, -1) : 0;
	if (!pool) {
		if (total)
			_printk(KP_KERN_ERR "kprewrite: no memory for the instances of %u kretprobes (%lu KiB): "
				"every call misses\n", kp_nkretprobes, total >> 10);
		return;
	}
	for (unsigned int i = 0; i < kp_nkretprobes; i++) {
		struct kretprobe *rp = &kp_kretprobes[i];
		__atomic_store_n(&rp->kp_pool, pool, __ATOMIC_RELEASE);
		pool += kp_kret_pool_size(rp);
	}
	_printk(KP_KERN_INFO "kprewrite: instances of %u kretprobes: %lu KiB\n", kp_nkretprobes, total >> 10);
}

/* Not called in a kernel (the runtime is never relocated); the pools come from the
 * boot hook above. */
void kp_kretprobe_relocate(unsigned long bias)
{
	(void)bias;
}

static inline struct kp_kri *kp_kri_at(struct kretprobe *rp, unsigned int i)
{
	return (struct kp_kri *)(rp->kp_pool + (unsigned long)i * rp->kp_stride);
}

/* Claim a free instance of rp (lock-free, as the kernel's freelist); inlined in the
 * entry's dispatch (a kretprobe hit's hot path). */
static inline __attribute__((always_inline)) struct kp_kri *kp_kri_claim(struct kretprobe *rp)
{
	unsigned int n = rp->maxactive, i = rp->kp_hint;
	if (!__atomic_load_n(&rp->kp_pool, __ATOMIC_ACQUIRE))
		return 0;
	for (unsigned int k = 0; k < n; k++, i++) {
		if (i >= n)
			i = 0;
		struct kp_kri *kri = kp_kri_at(rp, i);
		unsigned int free = 0;
		if (__atomic_load_n(&kri->ri.kp_state, __ATOMIC_RELAXED) == 0 &&
		    __atomic_compare_exchange_n(&kri->ri.kp_state, &free, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
			rp->kp_hint = i + 1 < n ? i + 1 : 0;
			return kri;
		}
	}
	return 0;
}

static inline void kp_kri_free(struct kp_kri *kri)
{
	__atomic_store_n(&kri->ri.kp_state, 0, __ATOMIC_RELEASE);
}

/* The real return address of the task's slot S, which holds the trampoline
 * already (a tail call from another return-probed function): its instance's. */
static unsigned long kp_real_ret_locked(struct kp_kret_bucket *b, unsigned long task, unsigned long S)
{
	for (struct kp_kri *k = b->head; k; k = k->next)
		if (k->task == task && (unsigned long)k->ri.fp == S)
			return (unsigned long)k->ri.ret_addr;
	return 0;
}

/*
 * File kri under the task at slot S, with ri->ret_addr the real return address (the
 * slot's, or when a tail call left the trampoline there, the one its instances hold).
 * swap: the function's exits are not hooked, so the slot is swapped for the trampoline
 * (arch_prepare_kretprobe()).  Returns the return address; 0 (not filed): the slot holds
 * a trampoline the task has no instance for.  With this CPU's `active` set.
 */
static inline unsigned long kp_file_at(struct kp_kri *kri, unsigned long task, unsigned long S, int swap)
{
	struct kp_kret_bucket *b = kp_bucket(task);
	unsigned long flags = kp_bucket_lock(b, 0);
	unsigned long ret = *(unsigned long *)S;
	if (ret == TRAMP)
		ret = kp_real_ret_locked(b, task, S);
	kri->ri.ret_addr = (kprobe_opcode_t *)ret;
	if (ret) {
		kri->next = b->head;
		b->head = kri;
		if (swap)
			*(unsigned long *)S = TRAMP;
	}
	kp_bucket_unlock(b, flags);
	return ret;
}

/* pre_handler_kretprobe() for rp, with S the return-address slot; regs NULL on the
 * clean path (the entry_handler never reads them).  The dispatch runs it with
 * preemption off and this CPU's `active` set. */
static inline __attribute__((always_inline)) void kp_kret_enter(struct kretprobe *rp, unsigned long S,
								  struct pt_regs *regs)
{
	unsigned long task = kp_task();
	struct kp_kri *kri = task ? kp_kri_claim(rp) : 0;
	if (!kri) {
		__atomic_fetch_add(&rp->nmissed, 1, __ATOMIC_RELAXED);
		return;
	}
	struct kretprobe_instance *ri = &kri->ri;
	ri->rp = rp;
	ri->fp = (void *)S;
	ri->kp_flags = 0;
	kri->task = task;
	if (KP_KRET_ENTRY_HANDLER(rp) && KP_KRET_ENTRY_HANDLER(rp)(ri, regs)) {
		kp_kri_free(kri);
		return;
	}
	if (!kp_file_at(kri, task, S, rp->kp_mode == KP_KRET_TRAMPOLINE)) {
		kp_kri_free(kri);	/* a trampoline we have no instance for: leave it alone */
		__atomic_fetch_add(&rp->nmissed, 1, __ATOMIC_RELAXED);
	}
}

/* The kretprobe's kp.pre_handler, from a detour that builds struct pt_regs. */
int kp_pre_handler_kretprobe(struct kprobe *p, struct pt_regs *regs)
{
	kp_kret_enter((struct kretprobe *)((char *)p - __builtin_offsetof(struct kretprobe, kp)), kp_arch_ret_slot_at_entry(regs), regs);
	return 0;
}

/*
 * A site with a kretprobe whose handlers (entry_handler, and the pre_handlers of
 * kprobes at the same address) never read regs: the clean call of
 * kp_kretprobe_clean_entry (optprobe_entry.S), which saves only the call-clobbered
 * registers and passes the slot S instead of struct pt_regs.  The dispatch is
 * kp_optimized_clean_callback()'s, aggr_pre_handler() with the kretprobes' entry
 * half called directly.
 */
void kp_kretprobe_clean_callback(unsigned long site_index, unsigned long S)
{
	kp_platform_dispatch_begin();
	struct kp_site *s = kp_site(site_index);
	struct kp_thread *t = s ? kp_current_thread() : 0;
	if (t && t->active) {
		kp_count_missed(s);
	} else if (t) {
		struct kprobe *const *pp = &kp_site_probes[s->first];
		t->active = 1;
		for (unsigned int i = 0; i < s->count; i++) {
			struct kprobe *p = pp[i];
			if (kprobe_disabled(p))
				continue;
			t->hits[p->index]++;
			kprobe_pre_handler_t pre = KP_PRE_HANDLER(s, pp, i);
			if (pre == kp_pre_handler_kretprobe)
				kp_kret_enter((struct kretprobe *)((char *)p - __builtin_offsetof(struct kretprobe, kp)), S, 0);
			else if (pre && pre(p, 0))
				break;
		}
		t->active = 0;
	}
	kp_platform_dispatch_end();
}

/*
 * Take the task's instances recorded at slot S off the table, newest first, and
 * return them as a list (NULL: none).  Instances of the task filed after the first
 * one of S belong to frames entered inside that frame which never returned: freed
 * without a handler, once an instance of S proves it.  need_clean: leave everything
 * and return KP_NEED_REGS when one of S's kretprobes has a handler that reads regs
 * (the clean exit hook then hands over to the full one).
 */
#define KP_NEED_REGS ((struct kp_kri *)1)

static inline __attribute__((always_inline)) struct kp_kri *kp_take_at(unsigned long task, unsigned long S,
									  int irqsave, int need_clean)
{
	struct kp_kret_bucket *b = kp_bucket(task);
	struct kp_kri *fire = 0, **tail = &fire, *stale = 0;
	unsigned long flags = kp_bucket_lock(b, irqsave);
	struct kp_kri **pp = &b->head, *k = b->head;
	int any = 0, found = 0;
	/* The common case: the bucket's newest instance is the task's at S, and the next
	 * one none or the task's own older frame's (what the walks below find then: it
	 * fires alone, nothing is stale), taken without walking.  An entry files its
	 * instance first in the bucket, so a task's nested return-probed calls take this
	 * way, unless another task's instance lies between two of its own. */
	struct kp_kri *n = k ? k->next : 0;
	if (k && k->task == task && (unsigned long)k->ri.fp == S &&
	    (!n || (n->task == task && (unsigned long)n->ri.fp != S))) {
		if (need_clean && !k->ri.rp->kp_ret_clean) {
			kp_bucket_unlock(b, flags);
			return KP_NEED_REGS;
		}
		b->head = n;
		k->next = 0;
		kp_bucket_unlock(b, flags);
		return k;
	}
	for (k = b->head; k; k = k->next)	/* any instance of S at all? */
		if (k->task == task && (unsigned long)k->ri.fp == S) {
			any = 1;
			if (!need_clean)
				break;
			if (!k->ri.rp->kp_ret_clean) {
				kp_bucket_unlock(b, flags);
				return KP_NEED_REGS;
			}
		}
	if (!any) {
		kp_bucket_unlock(b, flags);
		return 0;
	}
	while (*pp) {
		k = *pp;
		if (k->task != task) {
			pp = &k->next;
			continue;
		}
		if ((unsigned long)k->ri.fp == S) {
			found = 1;
			*pp = k->next;
			k->next = 0;
			*tail = k;
			tail = &k->next;
			continue;
		}
		if (found)
			break;		/* an older frame of the task */
		*pp = k->next;		/* entered inside this frame, never returned */
		k->next = stale;
		stale = k;
	}
	kp_bucket_unlock(b, flags);
	while (stale) {
		k = stale;
		stale = k->next;
		kp_kri_free(k);
	}
	return fire;
}

/* Fire a list kp_take_at() returned, newest first (regs NULL: the clean hook, whose
 * handlers never read them; run = 0: free only, a handler is running on this CPU). */
static inline __attribute__((always_inline)) void kp_fire(struct kp_kri *fire, struct pt_regs *regs, int run)
{
	while (fire) {
		struct kp_kri *k = fire;
		fire = k->next;
		struct kretprobe *rp = k->ri.rp;
		if (run && KP_KRET_HANDLER(rp))
			KP_KRET_HANDLER(rp)(&k->ri, regs);
		kp_kri_free(k);
	}
}

static void kp_kret_fatal(unsigned long task, unsigned long S)
{
	_printk(KP_KERN_ERR "kprewrite: kretprobe trampoline: no instance of task %lx at slot %lx\n", task, S);
	BUG();
}

/*
 * kretprobe_trampoline_handler(): the function returned into the trampoline with
 * regs->sp just above the slot.  Take the task's instances of that slot off the
 * table, fire them newest first, and return the real return address.
 */
unsigned long kp_kretprobe_trampoline_handler(struct pt_regs *regs)
{
	unsigned long task = kp_task(), S = kp_arch_ret_slot_after_return(regs);
	kp_platform_dispatch_begin();
	struct kp_thread *t = kp_current_thread();
	unsigned int active = t ? t->active : 1;
	if (t)
		t->active = 1;
	struct kp_kri *fire = kp_take_at(task, S, !t, 0);
	if (!fire)
		kp_kret_fatal(task, S);
	unsigned long ret = (unsigned long)fire->ri.ret_addr;
	instruction_pointer_set(regs, ret);
	kp_arch_unwind_trampoline_ip(S, ret);	/* the frame record's return address (kp_unwind.c) */
	kp_fire(fire, active ? 0 : regs, !active);
	if (t)
		t->active = active;
	kp_platform_dispatch_end();
	return ret;
}

/*
 * kprobe_flush_task(): a task_struct being freed (free_task(tsk), a runtime probe
 * added for specs with kretprobes) may still hold instances of frames that never
 * returned (a task that ended inside a return-probed function): free them, with no
 * handler, as the kernel recycles them.
 */
int kp_kernel_kret_flush_task(struct kprobe *p, struct pt_regs *regs)
{
	(void)p;
	unsigned long task = regs_get_kernel_argument(regs, 0);	/* free_task(tsk) */
	struct kp_kret_bucket *b = kp_bucket(task);
	struct kp_kri *dead = 0;
	unsigned long flags = kp_bucket_lock(b, 0);	/* in a dispatch: `active` is set */
	for (struct kp_kri **pp = &b->head; *pp;) {
		struct kp_kri *k = *pp;
		if (k->task == task) {
			*pp = k->next;
			k->next = dead;
			dead = k;
		} else {
			pp = &k->next;
		}
	}
	kp_bucket_unlock(b, flags);
	while (dead) {
		struct kp_kri *k = dead;
		dead = k->next;
		kp_kri_free(k);
	}
	return 0;
}

/*
 * The exit hooks (the user-space design, kretprobe_entry.S): a function whose exits are
 * all hooked runs one before each return (x86-64: `jmp __x86_return_thunk`) with the return
 * address left in place.  The current task's instances recorded at that slot fire,
 * newest first, wherever the task runs now.  A slot that holds the trampoline (a tail
 * call from a function whose returns it catches) is left to the trampoline, which
 * fires every instance of the slot.  On a CPU already running a handler (an interrupt
 * in one) nothing fires: that frame's entry was missed, and the CPU may hold a lock.
 */
static int kp_exit_at(unsigned long S, struct pt_regs *regs, int clean)
{
	if (*(unsigned long *)S == TRAMP)
		return 0;
	int need = 0;
	kp_platform_dispatch_begin();
	struct kp_thread *t = kp_current_thread();
	if (!t || !t->active) {
		if (t)
			t->active = 1;
		struct kp_kri *fire = kp_take_at(kp_task(), S, !t, clean);
		if (fire == KP_NEED_REGS) {
			need = 1;
		} else {
			/* The hook's frame record (kp_unwind.c): the function at its exit has
			 * the frame it had at its entry, the return address alone. */
			if (fire)
				kp_arch_unwind_exit_ip(S, kp_arch_trap_ip((unsigned long)fire->ri.rp->kp.addr));
			kp_fire(fire, regs, 1);
		}
		if (t)
			t->active = 0;
	}
	kp_platform_dispatch_end();
	return need;
}

/* Before a return, from kp_kretprobe_ret_entry: regs->sp is the stack pointer after
 * the return, regs->ip the return address, as the kernel's trampoline reports them. */
void kp_kretprobe_return(struct pt_regs *regs)
{
	kp_exit_at(kp_arch_ret_slot_after_return(regs), regs, 0);
}

/* The same from the clean hook (no handler of the function's kretprobes reads regs):
 * 1 when an instance at S needs struct pt_regs after all (a tail-calling caller's
 * kretprobe), for the full hook to take over. */
int kp_kretprobe_return_clean(unsigned long S)
{
	return kp_exit_at(S, 0, 1);
}

/* A tail call to a function whose returns are hooked: nothing to do in a kernel (an
 * entry never reclaims here); that function's exit hook fires this frame's instances
 * through the same slot, newest first. */
void kp_kretprobe_tail_pending(struct pt_regs *regs)
{
	(void)regs;
}

/* A tail call to a function whose returns are not hooked: the slot is swapped for the
 * trampoline (the kernel's way, for this path only) when the task has instances there;
 * each holds the real return address already. */
void kp_kretprobe_tail_swap(struct pt_regs *regs)
{
	unsigned long S = kp_arch_ret_slot_after_return(regs), task = kp_task();
	if (*(unsigned long *)S == TRAMP)
		return;
	kp_platform_dispatch_begin();
	struct kp_thread *t = kp_current_thread();
	if (!t || !t->active) {
		if (t)
			t->active = 1;
		struct kp_kret_bucket *b = kp_bucket(task);
		unsigned long flags = kp_bucket_lock(b, !t);
		if (kp_real_ret_locked(b, task, S))
			*(unsigned long *)S = TRAMP;
		kp_bucket_unlock(b, flags);
		if (t)
			t->active = 0;
	}
	kp_platform_dispatch_end();
}

/* Breakpoint return hooks are not placed in a kernel (Rules.kretprobe_breakpoint_exits is
 * off: such a function keeps the trampoline). */
void kp_kretprobe_breakpoint_hook(unsigned int kind, struct pt_regs *regs)
{
	(void)kind;
	(void)regs;
	_printk(KP_KERN_ERR "kprewrite: a kretprobe breakpoint exit hook in a kernel\n");
	BUG();
}
