/*
 * The AArch64 half of the runtime's interface, included by the generic core
 * (kp_internal.h): what the core needs of the CPU, and the breakpoint-site
 * descriptor kprewrite's AArch64 back end generates (rewriter/arch/aarch64/).
 * struct pt_regs is the handler API's (include/kprewrite/arch/aarch64/ptrace.h);
 * the entries build it as kp_regs.h describes.  Linux's ABI on AArch64 is in
 * uapi/, the CPU on each platform in <platform>/.
 *
 * The CPU facts the core relies on (the kernel's arch/arm64/kernel/probes/):
 * instructions are 4 bytes and 4-aligned; a breakpoint is `brk #imm16`, which
 * traps with pc at the brk itself (not past it, unlike x86's int3); a
 * function's return address is in x30 (the link register) until its prologue
 * spills it; the flags are PSTATE's NZCV, which user code reads and writes with
 * `mrs`/`msr nzcv`.
 */
#ifndef _KP_ARCH_H
#define _KP_ARCH_H
#pragma GCC visibility push(hidden)

#define KP_ARITH_FLAGS 0xf0000000UL	/* PSTATE.NZCV: all the flags EL0 can change */

/* The breakpoint immediates (arch/arm64/include/asm/brk-imm.h). */
#define KPROBES_BRK_IMM		0x004	/* a probe: brk #0x004 */
#define UPROBES_BRK_IMM		0x005
#define KPROBES_BRK_SS_IMM	0x006	/* the end of a single-stepped copy */
#define KRETPROBES_BRK_IMM	0x007
#define AARCH64_BREAK_MON	0xd4200000	/* brk #0: imm16 in bits 20..5 */
#define KP_BRK_INSN(imm)	(AARCH64_BREAK_MON | ((imm) << 5))
#define BRK_INSN_SIZE		4
#define AARCH64_INSN_SIZE	4

/* --- a probe hit on struct pt_regs (kp_core.c, kp_internal.h) --- */

/* regs->pc as a breakpoint at addr leaves it: at the brk itself (the arm64
 * kernel's pre_handlers see regs->pc == p->addr), which an optimized probe
 * reports too. */
#define kp_arch_trap_ip(addr) (addr)

/* The flags word of pt_regs (PSTATE). */
#define kp_arch_regs_flags(regs) ((regs)->pstate)

/* Whether a handler changed flags the detours do not restore themselves: they
 * restore NZCV from pt_regs (`msr nzcv`); any other PSTATE bit cannot be set
 * from EL0, so such a change resumes through pt_regs like on x86. */
#define kp_arch_flags_changed(before, after) (((after) ^ (before)) & ~KP_ARITH_FLAGS)

/* --- fetch args (kp_fetch.c): $argN past the registers --- */

/* AAPCS64 passes x0..x7; at a function's entry the 9th argument is at sp
 * (nothing is pushed by a `bl`). */
#define KP_ARCH_REG_ARGS 8
#define kp_arch_stack_arg(n) ((n) - 8)

/* --- kretprobes: where the return address is (the kernel's arch rethook part,
 * arch/arm64/kernel/rethook.c; kp_kretprobe.c) ---
 *
 * A `bl` leaves the return address in x30 and sp as it was: sp at a function's
 * entry equals sp right after its `ret`, and names the frame (the kernel's
 * arm64 rethook records regs->regs[29] there; sp is what both the entry and
 * every exit hook have).  The "slot" the core orders and matches instances by
 * is that sp; the return address itself is read and swapped in regs->regs[30]
 * (kp_arch_ret_addr()), so on AArch64 every entry that reaches the C code passes
 * its regs (the inlined clean entry's slow path is the dispatch with pt_regs).
 */
static __attribute__((always_inline)) inline unsigned long kp_arch_ret_slot_at_entry(const struct pt_regs *regs)
{
	return regs->sp;
}

/* Right after the `ret` (regs as the return hooks report them: pc the return
 * address, sp unchanged by the ret), or at the `ret` itself (a hook runs just
 * before it, sp already as after it). */
static __attribute__((always_inline)) inline unsigned long kp_arch_ret_slot_after_return(const struct pt_regs *regs)
{
	return regs->sp;
}

/* The return address of the frame whose slot is S, at its entry or its exit. */
#define kp_arch_ret_addr(regs, S) ((regs)->regs[30])
/* ...replaced (the kernel's way: by the trampoline); the entry restores x30 from regs. */
#define kp_arch_ret_addr_set(regs, S, v) ((regs)->regs[30] = (v))
/* Whether slot S of a frame that is not running now still returns to v: unknown
 * on AArch64 (x30 was spilled wherever that frame's prologue chose), so no. */
#define kp_arch_ret_slot_holds(S, v) 0
/* ...but the call being entered has its return address in x30, in its regs:
 * an entry notes it, so that an instance of the same slot whose tail call
 * swapped x30 for the trampoline is seen chained, not dead (kp_ri_chained()). */
#define KP_ARCH_KRET_THREAD_FIELDS unsigned long entry_slot, entry_x30;
#define kp_arch_note_entry(kt, regs, S) \
	((kt)->entry_slot = (S), (kt)->entry_x30 = (regs) ? (regs)->regs[30] : 0)
#define kp_arch_entry_slot_holds(kt, S, v) ((kt)->entry_slot == (S) && (kt)->entry_x30 == (v))

/* Whether code address v is a kretprobe trampoline, ours or another rewritten
 * object's runtime's: each starts with a `b` over the same 8 bytes
 * (kretprobe_entry.S); see x86-64's kp_arch.h for the chain it serves. */
static __attribute__((always_inline)) inline int kp_arch_is_a_trampoline(unsigned long v)
{
	const unsigned char *p = (const unsigned char *)v;
	static const unsigned char sig[12] = { 0x03, 0x00, 0x00, 0x14, 'k', 'p', 'r', 'w', 'T', 'R', 'M', 'P' };
	if (v < 4096 || (v & 3))
		return 0;
	for (int i = 0; i < 12; i++)
		if (p[i] != sig[i])
			return 0;
	return 1;
}
/* The call being entered at S returns into another runtime's trampoline. */
#define kp_arch_entry_slot_foreign(kt, S) ((kt)->entry_slot == (S) && kp_arch_is_a_trampoline((kt)->entry_x30))

/* regs at a `ret` made as after it: pc the return address (x30), sp unchanged
 * (a return hook placed as a breakpoint).  x30 is as the hook finds it: at the
 * `ret` of `autiasp; ret` it is authenticated (plain); before the autiasp it
 * would still carry its PAC signature. */
static __attribute__((always_inline)) inline void kp_arch_regs_returned(struct pt_regs *regs, unsigned long sp)
{
	regs->pc = regs->regs[30];
	regs->sp = sp;
}

/* ...and back as the trap left them, keeping what a handler may change there:
 * the general registers and NZCV. */
static __attribute__((always_inline)) inline void
kp_arch_regs_unreturned(struct pt_regs *regs, unsigned long ip, unsigned long sp, unsigned long flags)
{
	regs->pc = ip;
	regs->sp = sp;
	regs->pstate = (flags & ~KP_ARITH_FLAGS) | (regs->pstate & KP_ARITH_FLAGS);
}

/* A spin-wait iteration (the kernel's cpu_relax()). */
static inline void cpu_relax(void)
{
	__asm__ volatile("yield" ::: "memory");
}

/* Stop for good (the kernel's BUG(); at EL0 an undefined instruction: SIGILL). */
#define BUG() do { for (;;) __asm__ volatile("udf #0"); } while (0)

/*
 * Breakpoint probes (the platform's trap entry, arch/aarch64/'s trap code): one
 * descriptor per brk site, sorted by address; addresses are link-time (the trap
 * handler adds kp_rt.bias).  The generic names (kp_breakpoint_*) are the core's and
 * the platform's; the fields are this arch's, after the kernel's struct
 * arch_probe_insn (arch/arm64/include/asm/probes.h): a site is simulated (the
 * kernel's simulate-insn.c: PC-relative and branch instructions) or
 * single-stepped out of line in a slot that holds the instruction then
 * `brk #0x006`.  The trap code and the back end that fills it
 * (rewriter/arch/aarch64/) own the meaning of the per-kind fields.
 */
struct kp_breakpoint_site {
	unsigned long addr;		/* the probed instruction, now brk #0x004 */
	unsigned long slot;		/* single-step: the out-of-line copy */
	unsigned long ss_end;		/* single-step: the copy's brk #0x006 (slot + 4) */
	unsigned long target;		/* simulate: branch target, adr/adrp value, literal address */
	unsigned int site;		/* kp_sites[] index */
	unsigned int insn;		/* the probed instruction's encoding */
	unsigned char mode;		/* KP_XOL_* */
	unsigned char kind;		/* simulate: which instruction (the back end's KP_SIM_*) */
	unsigned char cc;		/* b.cond: the condition */
	unsigned char reg;		/* Rt (cbz, tbz, ldr literal), Rd (adr/adrp), Rn (br, blr, ret) */
	unsigned char bit;		/* tbz/tbnz: the bit tested */
	unsigned char sf;		/* 64-bit register (cbz, ldr literal width) */
	unsigned char kret;		/* a kretprobe return hook at this exit: KP_KRET_HOOK_* (0 none) */
	unsigned char post;		/* a probe of the site has a post_handler */
	unsigned char plain;		/* single-stepped, no kretprobe hook */
	unsigned char pad[15];		/* 64 bytes: an index is a shift */
};
_Static_assert(sizeof(struct kp_breakpoint_site) == 64, "kp_breakpoint_site: 64 bytes");
#define KP_XOL_SIMULATE 1
#define KP_XOL_SINGLESTEP 3
/* A mode's tag in a kernel's kprobes/list (kp_debugfs.c), after the kernel's [OPTIMIZED]. */
#define kp_arch_xol_tag(mode) ((mode) == KP_XOL_SIMULATE ? "[SIMULATED]" : "[SINGLESTEP]")
extern struct kp_breakpoint_site kp_breakpoints[];
extern const unsigned int kp_nbreakpoints;

#pragma GCC visibility pop

/*
 * Everything the runtime's and the tables' C declares after this header is
 * hidden, extern declarations too (no matching pop: the rest of the file).  The
 * blob is linked -pie and relocates itself (kp_relocate()); GNU ld for AArch64
 * does not turn a GOT load of a symbol it finds local into adrp + add as ld for
 * x86-64 relaxes GOTPCRELX, so an extern with default visibility (the linker
 * script's __kp_rela_start...) would be read from a GOT slot kp_relocate() has
 * not relocated yet.
 */
#pragma GCC visibility push(hidden)
#endif
