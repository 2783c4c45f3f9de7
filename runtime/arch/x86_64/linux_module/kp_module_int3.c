/*
 * A module's breakpoint sites: their traps taken by a die notifier, as an out-of-tree module takes an int3
 * (_int3_c() appends the per-site parts).
 * Read as text by rewriter/targets/linux_module/x86_64/writer.py (module_source()), from the line after
 * this comment; not compiled alone.
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
