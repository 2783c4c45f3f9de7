/*
 * kretprobes without hijacking the return address (kernel/kprobes.c's
 * pre_handler_kretprobe() and __kretprobe_trampoline_handler(), reorganised for
 * a static rewriter).
 *
 * The kernel replaces the return address with a trampoline.  kprewrite sees
 * every exit of the function ahead of time, so it hooks them instead:
 *
 * - entry: the kretprobe's kp is an ordinary (aggregated) optimized kprobe at
 *   the function's entry whose pre_handler claims an instance from the pool of
 *   maxactive, records the return-address slot (ri->fp, the kernel's "sara")
 *   and the caller's return address, runs entry_handler, and pushes the
 *   instance on the thread's instance stack (the kernel's per-task list);
 * - each `ret`: a return hook runs just before the ret, with rsp at the slot;
 *   the instances recorded at that slot fire their handler, newest first, and
 *   are freed.  The return address stays where the caller put it, so
 *   __builtin_return_address(), backtraces, unwinding and shadow stacks see
 *   the program's own frames;
 * - each tail call to a function whose returns are hooked too: the instances
 *   are marked pending and fire at that function's ret through the same slot;
 * - the kernel's way, kept for what cannot be hooked (a tail call to a function
 *   we do not hook, a return site that cannot be jump-optimized): the slot is
 *   swapped for kp_kretprobe_trampoline, which fires the handlers and returns to
 *   the real return address.
 *
 * Frames left without returning (longjmp, C++ unwinding) leave their instances
 * on the thread's stack: an entry that takes the slot of one again, or the
 * return of a frame older than they are, reclaims them (no handler, no count),
 * so no instance leaks and later calls do not miss.  A slot below the current
 * stack pointer alone proves nothing: a signal handler on a sigaltstack, or a
 * coroutine's caller, runs above frames that are alive on another stack
 * (kp_reclaim()).
 *
 * Fast paths: for a kretprobe whose handlers never read regs (kprewrite reads
 * their code; or with struct pt_regs built in place when they do), kprewrite
 * inlines the common case of both halves in per-site
 * templates (rewriter/arch/x86_64/retprobe.py: the claim at the pool's hint,
 * the push, the pop at the ret, direct calls of the handlers), with only the
 * call-clobbered registers saved.  Everything else comes here:
 * kp_kretprobe_enter(), kp_kretprobe_return_clean(), kp_kretprobe_return().
 */
#include "kp_internal.h"

#define KP_KRET_TRAMPOLINE 1	/* entry swaps the return address (kernel's way) */

extern char kp_kretprobe_trampoline[];
static unsigned long kp_kret_total;

#define TRAMP ((unsigned long)kp_kretprobe_trampoline)

/* Default maxactive (the kernel's max(10, 2 * num_possible_cpus())), the pools. */
void kp_kretprobe_relocate(unsigned long bias)
{
	long def = 0;
	unsigned long total = 0;
	for (unsigned int i = 0; i < kp_nkretprobes; i++) {
		struct kretprobe *rp = &kp_kretprobes[i];
		rp->kp.addr += bias;
		if (rp->maxactive <= 0) {
			if (!def) {
				def = 2 * (long)kp_platform_ncpus();
				if (def < 10)
					def = 10;
			}
			rp->maxactive = def;
		}
		rp->kp_stride = (sizeof(struct kretprobe_instance) + rp->data_size + 7) & ~7UL;
		rp->kp_pool = kp_platform_alloc((unsigned long)rp->kp_stride * rp->maxactive);
		if (!rp->kp_pool)
			rp->maxactive = 0;	/* every call misses, and says so */
		total += rp->maxactive;
	}
	kp_kret_total = total;
}

static inline struct kretprobe_instance *kp_ri_at(struct kretprobe *rp, unsigned int i)
{
	return (struct kretprobe_instance *)(rp->kp_pool + (unsigned long)i * rp->kp_stride);
}

static struct kretprobe_instance *kp_ri_claim(struct kretprobe *rp)
{
	unsigned int n = rp->maxactive, i = rp->kp_hint;
	for (unsigned int k = 0; k < n; k++, i++) {
		if (i >= n)
			i = 0;
		struct kretprobe_instance *ri = kp_ri_at(rp, i);
		unsigned int free = 0;
		if (__atomic_load_n(&ri->kp_state, __ATOMIC_RELAXED) == 0 &&
		    __atomic_compare_exchange_n(&ri->kp_state, &free, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
			rp->kp_hint = i + 1 < n ? i + 1 : 0;
			return ri;
		}
	}
	return 0;
}

static inline void kp_ri_free(struct kretprobe_instance *ri)
{
	__atomic_store_n(&ri->kp_state, 0, __ATOMIC_RELEASE);
}

static struct kp_kret_thread *kp_kret_thread_of(struct kp_thread *t)
{
	if (likely(t->kret))
		return t->kret;
	struct kp_kret_thread *kt = kp_platform_alloc(sizeof(*kt) + kp_kret_total * sizeof(kt->stack[0]));
	t->kret = kt;
	return kt;
}

/* Is the instance at the top, recorded at slot S, still live at an entry at S?
 * Only if a tail call chained this entry to its frame: the pending tail hook
 * said so just before its jmp, or the slot still holds the trampoline. */
/* Whether the slot of the call being entered (S) holds v: where the slot is
 * memory, kp_arch_ret_slot_holds(); an arch whose return address is in a
 * register reads it from the entry's regs (kp_arch_note_entry()). */
#ifndef kp_arch_entry_slot_holds
#define kp_arch_entry_slot_holds(kt, S, v) kp_arch_ret_slot_holds(S, v)
#define kp_arch_note_entry(kt, regs, S) ((void)0)
#endif

#ifndef kp_arch_entry_slot_foreign
#define kp_arch_entry_slot_foreign(kt, S) 0
#define kp_arch_is_a_trampoline(v) 0
#endif

static inline int kp_ri_chained(struct kp_kret_thread *kt, struct kretprobe_instance *ri, unsigned long S)
{
	if (ri->kp_flags & KP_RI_PENDING)
		return kt->tail_slot == S;
	/* The slot still holds our trampoline, or another rewritten object's: its
	 * runtime swapped it on a tail call out of a function ours tail-called. */
	return (ri->kp_flags & KP_RI_TRAMP) && (kp_arch_entry_slot_holds(kt, S, TRAMP) || kp_arch_entry_slot_foreign(kt, S));
}

/* Keep ri, whose frame may be alive on another stack, for the trampoline; the
 * oldest kept one goes when there is no room. */
static void kp_orphan(struct kp_kret_thread *kt, struct kretprobe_instance *ri)
{
	if (kt->norphans == KP_KRET_ORPHANS) {
		kp_ri_free(kt->orphans[0]);
		__builtin_memmove(&kt->orphans[0], &kt->orphans[1], (KP_KRET_ORPHANS - 1) * sizeof(kt->orphans[0]));
		kt->norphans--;
	}
	kt->orphans[kt->norphans++] = ri;
}

/* Drop kept instances: those of rp (NULL: any) or recorded at slot S (0: any). */
static void kp_drop_orphans(struct kp_kret_thread *kt, struct kretprobe *rp, unsigned long S)
{
	unsigned int j = 0;
	for (unsigned int i = 0; i < kt->norphans; i++) {
		struct kretprobe_instance *ri = kt->orphans[i];
		if ((!rp || ri->rp == rp) && (!S || (unsigned long)ri->fp == S))
			kp_ri_free(ri);
		else
			kt->orphans[j++] = ri;
	}
	kt->norphans = j;
}

/*
 * Free the instances of frames that were left without returning (longjmp, C++
 * unwinding), as far as the order of the thread's instances proves it.  The
 * list is the kernel's per-task one, LIFO in time: a frame entered after
 * another returns before it, whichever stack it runs on.  Look at the newest
 * instances recorded at or below S; if one of them was recorded at S itself,
 * that frame is over (at an entry the slot is a new call's, unless a tail call
 * chained the two; at a return it is returning), so every newer instance
 * belongs to a frame entered inside it that never returned: freed, the
 * instances at S too at an entry.  Without one at S nothing is proven: an
 * instance below S may be a live frame on another stack (a sigaltstack
 * handler running above it, a coroutine's caller on the main stack), and is
 * kept; a dead one is freed later, when its slot is taken again or an older
 * frame returns.  A freed one whose slot still holds the trampoline is kept
 * aside for the trampoline (kp_orphan()), in case it lived after all.
 */
static void kp_reclaim(struct kp_kret_thread *kt, unsigned long S, int at_entry)
{
	unsigned int i = kt->depth;
	while (i && (unsigned long)kt->stack[i - 1]->fp < S)
		i--;
	if (i && (unsigned long)kt->stack[i - 1]->fp == S) {
		if (at_entry)
			while (i && (unsigned long)kt->stack[i - 1]->fp == S && !kp_ri_chained(kt, kt->stack[i - 1], S))
				i--;
		while (kt->depth > i) {
			struct kretprobe_instance *ri = kt->stack[--kt->depth];
			unsigned long fp = (unsigned long)ri->fp;
			if (unlikely(ri->kp_flags & KP_RI_SWAPPED) && fp < S && kp_arch_ret_slot_holds(fp, TRAMP))
				kp_orphan(kt, ri);
			else
				kp_ri_free(ri);
		}
	}
	if (unlikely(kt->norphans) && at_entry)
		kp_drop_orphans(kt, 0, S);	/* the slot is a new call's now */
}

/* The real return address of slot S when it holds the trampoline. */
static unsigned long kp_real_ret(struct kp_kret_thread *kt, unsigned long S)
{
	for (unsigned int i = kt->depth; i-- > 0;) {
		struct kretprobe_instance *ri = kt->stack[i];
		if ((unsigned long)ri->fp != S)
			break;
		if (ri->kp_flags & KP_RI_SWAPPED)
			return (unsigned long)ri->ret_addr;
	}
	for (unsigned int i = kt->norphans; i-- > 0;) {
		struct kretprobe_instance *ri = kt->orphans[i];
		if ((unsigned long)ri->fp == S && (ri->kp_flags & KP_RI_SWAPPED))
			return (unsigned long)ri->ret_addr;
	}
	return 0;
}

/* pre_handler_kretprobe(): the entry half, as the kretprobe's kp.pre_handler. */
/*
 * Whether p is the first enabled kretprobe of its (aggregated) site: only that
 * one may free instances recorded at the same return slot, which an earlier
 * call left behind; a later one would free what this very hit just claimed.
 */
int kp_pre_handler_kretprobe(struct kprobe *p, struct pt_regs *regs);

static int kp_first_kretprobe_of_site(struct kprobe *p)
{
	const struct kp_site *s = kp_site(p->site);
	struct kprobe *const *pp = &kp_site_probes[s->first];
	for (unsigned int i = 0; i < s->count && pp[i] != p; i++)
		if (KP_PRE_HANDLER(s, pp, i) == kp_pre_handler_kretprobe && !kprobe_disabled(pp[i]))
			return 0;
	return 1;
}

/*
 * The entry half, for rp on thread t with the return-address slot at S; regs
 * is NULL on the clean path (the entry_handler never reads it).
 */
static inline __attribute__((always_inline)) void
kp_kret_enter(struct kretprobe *rp, unsigned long S, struct kp_thread *t, int aggregated, struct pt_regs *regs)
{
	struct kp_kret_thread *kt = t ? kp_kret_thread_of(t) : 0;
	if (unlikely(!kt)) {
		__atomic_fetch_add(&rp->nmissed, 1, __ATOMIC_RELAXED);
		return;
	}
	/* Whether this is the first kretprobe of an aggregated site is asked
	 * only when there is something to reclaim. */
	if (kt->depth && (unsigned long)kt->stack[kt->depth - 1]->fp <= S) {
		kp_arch_note_entry(kt, regs, S);
		kp_reclaim(kt, S, !aggregated || kp_first_kretprobe_of_site(&rp->kp));
	}
	kt->tail_slot = 0;
	struct kretprobe_instance *ri = kp_ri_claim(rp);
	if (unlikely(!ri) && kt->norphans) {
		kp_drop_orphans(kt, rp, 0);	/* a live call before a frame that may be dead */
		ri = kp_ri_claim(rp);
	}
	if (unlikely(!ri)) {
		__atomic_fetch_add(&rp->nmissed, 1, __ATOMIC_RELAXED);
		return;
	}
	unsigned long ret = kp_arch_ret_addr(regs, S);
	if (unlikely(ret == TRAMP))
		ret = kp_real_ret(kt, S);
	ri->rp = rp;
	ri->fp = (void *)S;
	ri->ret_addr = (kprobe_opcode_t *)ret;
	ri->kp_flags = rp->kp_mode == KP_KRET_TRAMPOLINE ? KP_RI_TRAMP : 0;
	kt->stack[kt->depth++] = ri;
	if (KP_KRET_ENTRY_HANDLER(rp) && KP_KRET_ENTRY_HANDLER(rp)(ri, regs)) {
		kt->depth--;
		kp_ri_free(ri);
		return;
	}
	if (unlikely(ri->kp_flags & KP_RI_TRAMP) && kp_arch_ret_addr(regs, S) != TRAMP) {
		ri->kp_flags |= KP_RI_SWAPPED;
		kp_arch_ret_addr_set(regs, S, TRAMP);
	}
}

int kp_pre_handler_kretprobe(struct kprobe *p, struct pt_regs *regs)
{
	struct kretprobe *rp = (struct kretprobe *)((char *)p - __builtin_offsetof(struct kretprobe, kp));
	kp_kret_enter(rp, kp_arch_ret_slot_at_entry(regs), kp_current_thread(), 1, regs);
	return 0;
}

/*
 * The entry half called from kprewrite's entry templates (a site whose one
 * probe is rp->kp) for what they do not inline: the template has done the
 * dispatch (thread block t found, marked active, hit counted) and passes the
 * slot S, and regs (NULL when the entry_handler never reads it).
 */
void kp_kretprobe_enter(struct kprobe *p, unsigned long S, struct kp_thread *t, struct pt_regs *regs)
{
	struct kretprobe *rp = (struct kretprobe *)((char *)p - __builtin_offsetof(struct kretprobe, kp));
	kp_kret_enter(rp, S, t, 0, regs);
}

/* The same template's slow path (kp_optimized_clean_callback() for it):
 * disarmed, a thread seen for the first time, or a handler running. */
void kp_kretprobe_enter_clean_slow(unsigned long site_index, unsigned long S)
{
	const struct kp_site *s = kp_site(site_index);
	struct kp_thread *t = kp_current_thread();
	struct kprobe *p = kp_site_probes[s->first];
	if (unlikely(!t))
		return;
	if (t->active) {
		kp_count_missed(s);
		return;
	}
	if (kprobe_disabled(p))
		return;
	t->hits[p->index]++;
	t->active = 1;
	kp_kretprobe_enter(p, S, t, 0);
	t->active = 0;
}

#ifdef KP_KRET_CLEAN_ENTRY
/*
 * A site with a kretprobe whose handlers (entry_handler, and the pre_handlers of kprobes
 * at the same address) never read regs, such as a [[function_graph]]'s entry: the clean
 * call of kp_kretprobe_clean_entry (optprobe_entry.S), which saves only the call-clobbered
 * registers and passes the slot S instead of struct pt_regs.  aggr_pre_handler() with the
 * kretprobes' entry half called directly.
 */
void kp_kretprobe_clean_callback(unsigned long site_index, unsigned long S)
{
	kp_platform_dispatch_begin();
	const struct kp_site *s = kp_site(site_index);
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
				kp_kret_enter((struct kretprobe *)((char *)p - __builtin_offsetof(struct kretprobe, kp)), S, t, 1, 0);
			else if (pre && pre(p, 0))
				break;
		}
		t->active = 0;
	}
	kp_platform_dispatch_end();
}
#endif

static inline void kp_ri_fire(struct kp_thread *t, struct kretprobe_instance *ri, struct pt_regs *regs)
{
	struct kretprobe *rp = ri->rp;
	if (KP_KRET_HANDLER(rp)) {
		/* The slot swapped for the trampoline by a tail call through a pointer
		 * (the caller's kretprobe is still pending there): the handler sees
		 * the real return address, as the kernel's trampoline handler
		 * reports it (correct_ret_addr). */
		unsigned long ip = regs ? instruction_pointer(regs) : 0;
		if (unlikely(ip == TRAMP))
			instruction_pointer_set(regs, (unsigned long)ri->ret_addr);
		t->active = 1;
		KP_KRET_HANDLER(rp)(ri, regs);
		t->active = 0;
		if (unlikely(ip == TRAMP) && instruction_pointer(regs) == (unsigned long)ri->ret_addr)
			instruction_pointer_set(regs, TRAMP);
	}
	kp_ri_free(ri);
}

/* The thread's instance stack with the frames below slot S reclaimed, or NULL
 * when it holds nothing (the common start of every return-side hook). */
static struct kp_kret_thread *kp_kret_at(struct kp_thread *t, unsigned long S)
{
	struct kp_kret_thread *kt = t ? t->kret : 0;
	if (!kt || !kt->depth)
		return 0;
	kp_reclaim(kt, S, 0);
	return kt;
}

/* Fire the instances recorded at slot S, newest first (those the trampoline
 * fires are left to it).  regs NULL (the clean hook): returns 1 at the first
 * instance whose handler may read regs, for the caller to build them. */
static inline __attribute__((always_inline)) int kp_fire_at(unsigned long S, struct pt_regs *regs)
{
	struct kp_thread *t = kp_current_thread();
	struct kp_kret_thread *kt = t && !t->active ? kp_kret_at(t, S) : 0;
	while (kt && kt->depth) {
		struct kretprobe_instance *ri = kt->stack[kt->depth - 1];
		if ((unsigned long)ri->fp != S || (ri->kp_flags & KP_RI_TRAMP))
			break;
		if (!regs && unlikely(!ri->rp->kp_ret_clean))
			return 1;
		kt->depth--;
		kp_ri_fire(t, ri, regs);
	}
	return 0;
}

/*
 * The return hook, just before a `ret` (called from kp_kretprobe_ret_entry).
 * regs->sp is the stack pointer after the ret, regs->ip the return address,
 * as the kernel's trampoline handler reports them.
 */
void kp_kretprobe_return(struct pt_regs *regs)
{
	kp_fire_at(kp_arch_ret_slot_after_return(regs), regs);
}

/*
 * The same from the clean return hook (kp_kretprobe_ret_clean_entry), for a
 * function whose kretprobes' handlers never read regs: only the scratch
 * registers were saved, S is the return-address slot.  Returns 1 when an
 * instance at S needs struct pt_regs (a tail-calling caller's kretprobe
 * whose handler reads it): the hook then goes on through the full one.
 */
int kp_kretprobe_return_clean(unsigned long S)
{
	return kp_fire_at(S, 0);
}

/* A tail call to a function whose returns are hooked: this frame's instances
 * fire at that function's ret through the same slot. */
void kp_kretprobe_tail_pending(struct pt_regs *regs)
{
	unsigned long S = kp_arch_ret_slot_after_return(regs);
	struct kp_kret_thread *kt = kp_kret_at(kp_current_thread(), S);
	if (!kt)
		return;
	for (unsigned int i = kt->depth; i-- > 0;) {
		struct kretprobe_instance *ri = kt->stack[i];
		if ((unsigned long)ri->fp != S)
			break;
		ri->kp_flags |= KP_RI_PENDING;
	}
	kt->tail_slot = S;
}

/* A tail call to a function we do not hook: swap the slot for the trampoline
 * (the kernel's way, for this path only). */
void kp_kretprobe_tail_swap(struct pt_regs *regs)
{
	unsigned long S = kp_arch_ret_slot_after_return(regs);
	struct kp_kret_thread *kt = kp_kret_at(kp_current_thread(), S);
	if (!kt)
		return;
	struct kretprobe_instance *top = 0;
	for (unsigned int i = kt->depth; i-- > 0;) {
		struct kretprobe_instance *ri = kt->stack[i];
		if ((unsigned long)ri->fp != S)
			break;
		if (!top && !(ri->kp_flags & KP_RI_TRAMP))
			top = ri;
		ri->kp_flags |= KP_RI_TRAMP;
	}
	if (top && kp_arch_ret_addr(regs, S) != TRAMP) {
		top->ret_addr = (kprobe_opcode_t *)kp_arch_ret_addr(regs, S);
		top->kp_flags |= KP_RI_SWAPPED;
		kp_arch_ret_addr_set(regs, S, TRAMP);
	}
}

/*
 * A return hook placed as a breakpoint, at an exit that cannot take a jump
 * (kp_arch_breakpoint_trap(), before the exit is emulated): regs->sp is the slot.
 * The hooks see what the jump-optimized ones see: ip the return address, sp
 * the stack pointer after the ret; a handler's register writes are kept.
 */
void kp_kretprobe_breakpoint_hook(unsigned int kind, struct pt_regs *regs)
{
	unsigned long ip = instruction_pointer(regs), sp = kernel_stack_pointer(regs), flags = kp_arch_regs_flags(regs);
	kp_arch_regs_returned(regs, sp);
	if (kind == KP_KRET_HOOK_RET)
		kp_kretprobe_return(regs);
	else if (kind == KP_KRET_HOOK_PENDING)
		kp_kretprobe_tail_pending(regs);
	else
		kp_kretprobe_tail_swap(regs);
	/* The exit still runs from the trap: only general registers and
	 * arithmetic flags take a handler's writes. */
	kp_arch_regs_unreturned(regs, ip, sp, flags);
}

/* The slot's owner on any thread block: only the start-up block of a static
 * program (before its thread pointer existed) can hold a frame of this thread.
 * Its instance is left claimed; the return address is what matters. */
static unsigned long kp_real_ret_elsewhere(unsigned long S)
{
	for (struct kp_thread *t = kp_rt.threads; t; t = t->next) {
		struct kp_kret_thread *kt = t->kret;
		for (unsigned int i = kt ? kt->depth : 0; i-- > 0;) {
			struct kretprobe_instance *ri = kt->stack[i];
			if ((unsigned long)ri->fp == S && (ri->kp_flags & KP_RI_SWAPPED))
				return (unsigned long)ri->ret_addr;
		}
	}
	return 0;
}

static void kp_kret_fatal(const char *msg)
{
	kp_platform_write(2, msg, strlen(msg));
	BUG();
}

/*
 * __kretprobe_trampoline_handler(): the function returned into the
 * trampoline; fire the handlers of that slot and return the real address.
 */
unsigned long kp_kretprobe_trampoline_handler(struct pt_regs *regs)
{
	unsigned long S = kp_arch_ret_slot_after_return(regs);
	struct kp_thread *t = kp_current_thread();
	struct kp_kret_thread *kt = t ? t->kret : 0;
	if (unlikely(!kt)) {
		unsigned long ret = kp_real_ret_elsewhere(S);
		if (!ret)
			kp_kret_fatal("kprewrite: kretprobe trampoline without instances\n");
		instruction_pointer_set(regs, ret);
		return ret;
	}
	kp_reclaim(kt, S, 0);
	unsigned long ret = kp_real_ret(kt, S);
	if (unlikely(!ret))
		ret = kp_real_ret_elsewhere(S);	/* claimed before the thread had its own block */
	if (!ret)
		kp_kret_fatal("kprewrite: kretprobe trampoline lost the return address\n");
	instruction_pointer_set(regs, ret);
	int active = t->active;
	int fired = 0;
	while (kt->depth) {
		struct kretprobe_instance *ri = kt->stack[kt->depth - 1];
		if ((unsigned long)ri->fp != S)
			break;
		kt->depth--;
		fired = 1;
		int last = (ri->kp_flags & KP_RI_SWAPPED) && (unsigned long)ri->ret_addr == ret && kp_arch_is_a_trampoline(ret);
		if (active)
			kp_ri_free(ri);
		else
			kp_ri_fire(t, ri, regs);
		/* Returning into another runtime's trampoline, whose function our
		 * older instances at S had tail-called: they wait for the frame's
		 * real return, through our trampoline again. */
		if (last)
			break;
	}
	/* Instances kept aside for this slot: their frame was alive after all. */
	for (unsigned int i = kt->norphans; !fired && i-- > 0;) {
		struct kretprobe_instance *ri = kt->orphans[i];
		if ((unsigned long)ri->fp != S)
			continue;
		__builtin_memmove(&kt->orphans[i], &kt->orphans[i + 1], (kt->norphans - i - 1) * sizeof(kt->orphans[0]));
		kt->norphans--;
		if (active)
			kp_ri_free(ri);
		else
			kp_ri_fire(t, ri, regs);
	}
	return ret;
}
