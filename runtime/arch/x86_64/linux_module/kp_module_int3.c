/*
 * A module's breakpoint sites, x86-64: their traps taken by a die notifier, as an out-of-tree module
 * takes an int3 (do_int3() calls notify_die(DIE_INT3) once kprobe_int3_handler() has found no kprobe
 * of the kernel's there), which claims (NOTIFY_STOP) the traps at our sites only:
 *
 * - at a site (regs->ip its address + 1): the site's dispatch (the pre_handlers, as
 *   kprobe_int3_handler() runs them), then regs->ip to the slot, where the copy runs
 *   (setup_singlestep()), unless a pre_handler moved regs->ip; a single-stepped copy with
 *   interrupts off (IF cleared in regs->flags), from the slot that says whether they were on;
 * - at a slot's closing int3 (kp_ss_N): IF set again if the site's trap came with it
 *   (resume_singlestep()), regs->ip to the instruction after the original, then the
 *   post_handlers (kprobe_post_process()).
 *
 * The trap comes with interrupts off and in NMI-like context (exc_int3()'s irqentry_nmi_enter()),
 * preemption off; a hit inside a handler of ours is missed, its instruction still run from the
 * slot.  The address is looked up by halves in kp_int3_at[] (kp_int3_find(), writer.py's
 * int3_runs()), its entry's index a case of a switch.  Included by kp_module_runtime.c with
 * KP_MODULE_INT3; the sites' facts are the writer's (_int3_c()):
 *
 *   KP_INT3_DECLS     each site's KP_SLOT(n), KP_SLOT_IRQOFF(n), KP_POST_FUNC(n, KP_POST_CALL(i, h)...)
 *   KP_INT3_TARGETS   each emulated branch's KP_TARGET(n)
 *   KP_INT3_RUNS, KP_INT3_NRUNS   the runs of kp_int3_at[]
 *   KP_INT3_CASES     the switch's cases (KP_CASE_*), by kp_int3_at[]'s index
 */

/* arch/x86/include/asm/kdebug.h, include/linux/notifier.h */
#define KP_DIE_INT3 2
#define KP_NOTIFY_DONE 0
#define KP_NOTIFY_STOP 0x8001		/* NOTIFY_OK | NOTIFY_STOP_MASK */
struct kp_die_args { struct pt_regs *regs; const char *str; long err; int trapnr; int signr; };
struct kp_notifier_block {
	int (*notifier_call)(struct kp_notifier_block *, unsigned long, void *);
	struct kp_notifier_block *next;
	int priority;
};
extern int register_die_notifier(struct kp_notifier_block *nb);
extern int unregister_die_notifier(struct kp_notifier_block *nb);
/* Each breakpoint site's address (kp_detours.S): a distance from its entry, relocated at insmod. */
extern const int kp_int3_at[];
static inline unsigned long kp_int3_addr(unsigned int k)
{
	return (unsigned long)&kp_int3_at[k] + (long)kp_int3_at[k];
}
/* The runs of kp_int3_at[], each sorted by address (writer.py's int3_runs()): an entry's index
 * by halves in each, -1 for an address of no breakpoint of ours. */
static __attribute__((always_inline)) inline int kp_int3_find(const unsigned int *runs, unsigned int n,
								unsigned long at)
{
	unsigned int g;
	for (g = 0; g + 1 < n; g++) {
		unsigned int lo = runs[g], hi = runs[g + 1];
		if (at < kp_int3_addr(lo) || at > kp_int3_addr(hi - 1))
			continue;
		while (lo < hi) {
			unsigned int mid = lo + (hi - lo) / 2;
			unsigned long a = kp_int3_addr(mid);
			if (a == at)
				return (int)mid;
			if (a < at)
				lo = mid + 1;
			else
				hi = mid;
		}
	}
	return -1;
}
/* arch/x86/include/uapi/asm/processor-flags.h */
#define KP_X86_EFLAGS_IF 0x200
static inline unsigned long kp_int3_target(const int *t)
{
	return (unsigned long)t + (long)*t;
}

/* A jcc's condition on the trap's flags (kprobe_emulate_jcc(); runtime/arch/x86_64/kp_int3.c's
 * kp_cond()): cc>>1 picks the test, bit 0 negates. */
static inline int kp_cond(unsigned long f, unsigned int cc)
{
	int r;
	switch (cc >> 1) {
	case 0: r = !!(f & 0x800); break;		/* OF */
	case 1: r = !!(f & 0x1); break;			/* CF */
	case 2: r = !!(f & 0x40); break;		/* ZF */
	case 3: r = !!(f & 0x41); break;		/* CF | ZF */
	case 4: r = !!(f & 0x80); break;		/* SF */
	case 5: r = !!(f & 0x4); break;			/* PF */
	case 6: r = !(f & 0x80) != !(f & 0x800); break;	/* SF != OF */
	default: r = (f & 0x40) || (!(f & 0x80) != !(f & 0x800)); break;
	}
	return (cc & 1) ? !r : r;
}

#define KP_SLOT(n) extern char kp_slot_##n[];
#define KP_SLOT_IRQOFF(n) extern char kp_slot_##n##_irqoff[];
#define KP_TARGET(n) extern const int kp_int3_target_##n;
#define KP_POST_CALL(i, h)							\
	if (!(kp_probes[i].flags & KPROBE_FLAG_DISABLED))			\
		h(&kp_probes[i], regs, 0);
/* kprobe_post_process(): after the copy ran, regs->ip at the next instruction. */
#define KP_POST_FUNC(n, calls)							\
static void kp_post_##n(struct pt_regs *regs)					\
{										\
	if (!kp_armed || !kp_enter())						\
		return;								\
	calls									\
	kp_leave();								\
}
KP_INT3_DECLS
KP_INT3_TARGETS

/* prepare_emulation()'s branch done in the trap (the site's k-th entry, n its dispatch, len the
 * instruction's length): a jmp, a jcc on the trap's flags, a call pushing the next instruction's
 * address onto the probed code's stack (int3_emulate_push(): the #BP entry leaves a gap below its
 * frame for it). */
#define KP_EMULATE_JMP(n) regs->ip = kp_int3_target(&kp_int3_target_##n);
#define KP_EMULATE_JCC(k, n, len, cc) \
	regs->ip = kp_cond(regs->flags, cc) ? kp_int3_target(&kp_int3_target_##n) : kp_int3_addr(k) + len;
#define KP_EMULATE_CALL(k, n, len)						\
	regs->sp -= 8;								\
	*(unsigned long *)regs->sp = kp_int3_addr(k) + len;			\
	regs->ip = kp_int3_target(&kp_int3_target_##n);
#define KP_CASE_EMULATED(k, n, emulate)						\
	case k: {								\
		unsigned long r = kp_dispatch_##n(regs);			\
		if (r) {							\
			regs->ip = r;						\
			return KP_NOTIFY_STOP;					\
		}								\
		emulate								\
		kp_post_##n(regs);	/* kprobe_post_process(): regs->ip where the branch went */ \
		return KP_NOTIFY_STOP;						\
	}
/* After the copy: regs->ip to the next instruction, then the post_handlers (KP_POST(n)). */
#define KP_POST(n) kp_post_##n(regs);
#define KP_AFTER(k, len, post)							\
		regs->ip = kp_int3_addr(k) + len;				\
		post								\
		return KP_NOTIFY_STOP;
/* Boosted, or an IF modifier: the copy runs with IF untouched. */
#define KP_CASE_SLOT(k, n)							\
	case k: {								\
		unsigned long r = kp_dispatch_##n(regs);			\
		regs->ip = r ? r : (unsigned long)kp_slot_##n;			\
		return KP_NOTIFY_STOP;						\
	}
#define KP_CASE_RESUME(e, after) case e:		/* resume_singlestep() */ after
#define KP_CASE_SS(k, n)							\
	case k: {								\
		unsigned long r = kp_dispatch_##n(regs);			\
		if (r)								\
			regs->ip = r;						\
		else if (regs->flags & KP_X86_EFLAGS_IF) {	/* setup_singlestep(): nothing preempts the slot */ \
			regs->flags &= ~KP_X86_EFLAGS_IF;			\
			regs->ip = (unsigned long)kp_slot_##n;			\
		} else								\
			regs->ip = (unsigned long)kp_slot_##n##_irqoff;		\
		return KP_NOTIFY_STOP;						\
	}
/* resume_singlestep(): kprobe_saved_flags, the slot kp_slot_N (e), else kp_slot_N_irqoff (e1). */
#define KP_CASE_RESUME_IF(e, e1, after)						\
	case e:									\
		regs->flags |= KP_X86_EFLAGS_IF;				\
		__attribute__((fallthrough));					\
	case e1: after

static const unsigned int kp_int3_runs[KP_INT3_NRUNS] = { KP_INT3_RUNS };

static int kp_int3_notify(struct kp_notifier_block *nb, unsigned long val, void *data)
{
	struct pt_regs *regs = ((struct kp_die_args *)data)->regs;
	(void)nb;
	if (val != KP_DIE_INT3 || (regs->cs & 3))	/* from user mode: never ours */
		return KP_NOTIFY_DONE;
	switch (kp_int3_find(kp_int3_runs, KP_INT3_NRUNS, regs->ip - 1)) {
	KP_INT3_CASES
	}
	return KP_NOTIFY_DONE;
}

/* First on the chain: the traps at our sites are ours whoever else listens. */
static struct kp_notifier_block kp_int3_nb = { .notifier_call = kp_int3_notify, .priority = 0x7fffffff };
