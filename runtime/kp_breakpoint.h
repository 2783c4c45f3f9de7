/*
 * The breakpoint probe's arch-neutral half, as kernel/kprobes.c's get_kprobe() and the
 * order the arch trap handlers share (x86's kprobe_int3_handler(), arm64's
 * kprobe_breakpoint_handler()): the descriptors' tables (rewriter/emit/breakpoints.py
 * with the rows of rewriter/arch/<arch>/kprobe_xol.py), the lookup of a trap's site, the
 * lookup of a single-step's end, the trap handler itself (kp_arch_breakpoint_regs(): the
 * arch's own traps, a hit, a single-step's end, in that order), a hit (the pre_handlers,
 * at a function's exit the return hook, then the instruction emulated with its
 * post_handlers, or run out of line) and a single-step's end (resume, then the
 * post_handlers).  Each arch's trap file (x86-64's kp_int3.c, AArch64's kp_brk.c:
 * rewriter/arch/<arch>/toolchain.py's RUNTIME_FILES["breakpoint"]) includes it after its
 * struct kp_breakpoint_site (kp_arch.h) and writes only the hooks declared below, as the
 * kernel's arch_*() for kernel/kprobes.c.
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

/*
 * The arch's hooks (its trap file defines them, static inline): where a trap's
 * breakpoint and a single-step's end are, how an instruction is emulated here or run out
 * of line, and how a single-stepped copy resumes.  `bias` is kp_rt.bias (link-time to
 * run-time addresses).
 */
#define KP_ARCH_BREAKPOINT_HOOK static inline __attribute__((always_inline))
/* A trap of the arch's own that is no probe's (AArch64: a detour's slow resume), handled
 * here: 1 (regs updated), else 0. */
KP_ARCH_BREAKPOINT_HOOK int kp_arch_breakpoint_own(struct pt_regs *regs);
/* The run-time address of the breakpoint the trap reports (x86-64: the ip after its
 * int3, as kprobe_int3_handler()'s regs->ip - INT3_INSN_SIZE; AArch64: the pc at the brk). */
KP_ARCH_BREAKPOINT_HOOK unsigned long kp_arch_breakpoint_addr(const struct pt_regs *regs);
/* The run-time end of a single-stepped copy this trap may follow, or 0 where it can be no
 * copy's end (x86-64: no trap flag and no int3 after the copy). */
KP_ARCH_BREAKPOINT_HOOK unsigned long kp_arch_breakpoint_ss_end(const struct pt_regs *regs, int ss_trap);
/* setup_singlestep()'s emulation (x86-64's emulate_op, arm64's simulate-insn.c): 1 when
 * the probed instruction was emulated on regs, 0 when it is to run out of line. */
KP_ARCH_BREAKPOINT_HOOK int kp_arch_breakpoint_emulate(const struct kp_breakpoint_site *d, struct pt_regs *regs,
							  unsigned long bias);
/* setup_singlestep()'s copy out of line: boosted (it jumps back and runs the post stub
 * itself) or single-stepped (the trap flag, or the breakpoint after it). */
KP_ARCH_BREAKPOINT_HOOK void kp_arch_breakpoint_resume(const struct kp_breakpoint_site *d, struct pt_regs *regs,
							 unsigned long bias, int ss_trap);
/* resume_singlestep(): the copy was no branch, so the original next instruction follows
 * (and the arch's single-step state ends). */
KP_ARCH_BREAKPOINT_HOOK void kp_arch_breakpoint_ss_resume(const struct kp_breakpoint_site *d, struct pt_regs *regs,
							    unsigned long bias);

/* A hit at one of our breakpoints: kprobe_int3_handler()'s order (the pre_handlers, at an
 * exit the kretprobe's return hook, then the instruction, unless a pre_handler moved the
 * path).  An emulated instruction's post_handlers run here (kprobe_post_process()), unless
 * the hit was missed (nmissed counted in kp_trap_pre()); a boosted copy runs them itself,
 * a single-stepped one at its end (kp_breakpoint_ss_done()). */
static inline __attribute__((always_inline)) int kp_breakpoint_hit(struct kp_breakpoint_site *d, struct pt_regs *regs,
								   unsigned long bias, int ss_trap)
{
	struct kp_site *s = kp_site(d->site);
	int r = kp_trap_pre(s, regs);
	if (r == KP_TRAP_CHANGED)
		return 1;
	if (d->kret)		/* at an exit: the return hook, then the exit */
		kp_kretprobe_breakpoint_hook(d->kret, regs);
	if (kp_arch_breakpoint_emulate(d, regs, bias)) {
		if (r == KP_TRAP_RUN)
			kp_trap_post(s, regs);
	} else {
		kp_arch_breakpoint_resume(d, regs, bias, ss_trap);
	}
	return 1;
}

/* The trap at a single-stepped copy's end: resume at the original next instruction,
 * then kprobe_post_process()'s post_handlers. */
static inline __attribute__((always_inline)) int kp_breakpoint_ss_done(const struct kp_breakpoint_site *d,
								       struct pt_regs *regs, unsigned long bias)
{
	kp_arch_breakpoint_ss_resume(d, regs, bias);
	kp_trap_post(kp_site(d->site), regs);
	return 1;
}

/*
 * The trap handler on the trap's registers, whatever the platform (a user SIGTRAP's
 * context converted, linux_user's kp_breakpoint_signal.h; a kernel's #BP frame): 1 if the
 * trap was the arch's own, at one of our breakpoints, or at the end of one of our
 * single-stepped copies (`ss_trap`: such copies end with a breakpoint, not under the
 * trap flag), with regs updated to resume; 0 otherwise (nothing changed).
 */
int kp_arch_breakpoint_regs(struct pt_regs *regs, int ss_trap)
{
#ifndef KP_PLATFORM_NO_STARTUP	/* a kernel's runtime is linked where it runs */
	if (unlikely(kp_rt.state != 2))
		kp_relocate();
#endif
	if (unlikely(kp_arch_breakpoint_own(regs)))
		return 1;
	unsigned long bias = kp_rt.bias, end;
	struct kp_breakpoint_site *d = kp_breakpoint_lookup(kp_arch_breakpoint_addr(regs) - bias);
	if (d)
		return kp_breakpoint_hit(d, regs, bias, ss_trap);
	if (kp_nbreakpoint_ss && (end = kp_arch_breakpoint_ss_end(regs, ss_trap)) &&
	    (d = kp_breakpoint_ss_lookup(end - bias)))
		return kp_breakpoint_ss_done(d, regs, bias);
	return 0;
}

#pragma GCC visibility pop
#endif
