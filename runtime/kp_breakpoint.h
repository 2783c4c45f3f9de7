/*
 * The breakpoint probe's arch-neutral half, as kernel/kprobes.c's get_kprobe() and the
 * order of the arch trap handlers (x86's kprobe_int3_handler(), arm64's
 * kprobe_breakpoint_handler()): the descriptors' tables (rewriter/emit/breakpoints.py
 * with the rows of rewriter/arch/<arch>/kprobe_xol.py), the lookup of a trap's site, the
 * lookup of a single-step's end, a hit (the pre_handlers, at a function's exit the return
 * hook, then the arch's resume) and a single-step's end.  Each arch's trap file (x86-64's kp_int3.c, AArch64's
 * kp_brk.c: rewriter/arch/<arch>/toolchain.py's RUNTIME_FILES["breakpoint"]) includes it
 * after its struct kp_breakpoint_site (kp_arch.h) and writes only its hooks, as the
 * kernel's arch_*() for kernel/kprobes.c: kp_arch_breakpoint_resume() (emulate or
 * simulate, boost, single-step), and its kp_arch_breakpoint_regs() (the handler: where a
 * trap's breakpoint and a single-step's end are, a trap of its own that is no probe's).
 */
#ifndef _KP_BREAKPOINT_H
#define _KP_BREAKPOINT_H
#pragma GCC visibility push(hidden)

extern struct kp_breakpoint_site kp_breakpoints[];
extern const unsigned int kp_nbreakpoints;
/* kp_breakpoints[] by address (link-time), open-addressed: kp_breakpoint_hash_mask + 1 entries
 * (at most half used), each an index or ~0 (none), at hash_64(addr, bits) or after it
 * (its shift: 64 - bits). */
extern const unsigned int kp_breakpoint_hash_shift, kp_breakpoint_hash_mask;
extern const unsigned int kp_breakpoint_hash[];
#define KP_GOLDEN_RATIO_64 0x61C8864680B583EBUL
extern const unsigned int kp_breakpoint_ss[];	/* single-step entries, by ss_end */
extern const unsigned int kp_nbreakpoint_ss;

/* get_kprobe(): the descriptor of the breakpoint at link-time address `addr`; a miss ends
 * at the first empty entry. */
static inline __attribute__((always_inline)) struct kp_breakpoint_site *kp_breakpoint_lookup(unsigned long addr)
{
	unsigned int h = (addr * KP_GOLDEN_RATIO_64) >> kp_breakpoint_hash_shift;
	for (;;) {
		unsigned int i = kp_breakpoint_hash[h];
		if (i >= kp_nbreakpoints)
			return 0;
		if (likely(kp_breakpoints[i].addr == addr))
			return &kp_breakpoints[i];
		h = (h + 1) & kp_breakpoint_hash_mask;
	}
}

/* The single-stepped site whose copy ends at link-time address `end` (kp_breakpoint_ss[] is in
 * the order of the ends), or 0. */
static inline __attribute__((always_inline)) struct kp_breakpoint_site *kp_breakpoint_ss_lookup(unsigned long end)
{
	unsigned int lo = 0, hi = kp_nbreakpoint_ss;
	if (!hi || end < kp_breakpoints[kp_breakpoint_ss[0]].ss_end || end > kp_breakpoints[kp_breakpoint_ss[hi - 1]].ss_end)
		return 0;
	while (lo < hi) {
		unsigned int mid = (lo + hi) / 2;
		struct kp_breakpoint_site *d = &kp_breakpoints[kp_breakpoint_ss[mid]];
		if (d->ss_end == end)
			return d;
		if (d->ss_end < end)
			lo = mid + 1;
		else
			hi = mid;
	}
	return 0;
}

/* The arch's resume after the pre_handlers left the path alone (r: kp_trap_pre()'s
 * KP_TRAP_RUN or KP_TRAP_SKIP): run or emulate the probed instruction, its post_handlers
 * where it ran here. */
static inline __attribute__((always_inline)) void kp_arch_breakpoint_resume(const struct kp_breakpoint_site *d, struct kp_site *s,
									     struct pt_regs *regs, unsigned long bias,
									     int r, int ss_trap);

/* A hit at one of our breakpoints: kprobe_int3_handler()'s order (the pre_handlers, at an
 * exit the kretprobe's return hook, then the instruction). */
static inline __attribute__((always_inline)) int kp_breakpoint_hit(struct kp_breakpoint_site *d, struct pt_regs *regs,
								   unsigned long bias, int ss_trap)
{
	struct kp_site *s = kp_site(d->site);
	int r = kp_trap_pre(s, regs);
	if (d->kret && r != KP_TRAP_CHANGED)	/* at an exit: the return hook, then the exit */
		kp_kretprobe_breakpoint_hook(d->kret, regs);
	if (r != KP_TRAP_CHANGED)
		kp_arch_breakpoint_resume(d, s, regs, bias, r, ss_trap);
	return 1;
}

/* The trap at a single-stepped copy's end: resume at the original next instruction (`next`,
 * as the copy was no branch), then kprobe_post_process()'s post_handlers. */
static inline __attribute__((always_inline)) int kp_breakpoint_ss_done(const struct kp_breakpoint_site *d,
								       struct pt_regs *regs, unsigned long next)
{
	instruction_pointer_set(regs, next);
	kp_trap_post(kp_site(d->site), regs);
	return 1;
}

#pragma GCC visibility pop
#endif
