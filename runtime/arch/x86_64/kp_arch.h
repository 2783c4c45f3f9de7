/*
 * The x86-64 half of the runtime's interface, included by the generic core
 * (kp_internal.h): what the core needs of the CPU, and the breakpoint-site
 * descriptor kprewrite's x86 back end generates (rewriter/arch/x86_64/kprobe_xol.py).
 * struct pt_regs is the handler API's (include/kprewrite/arch/x86_64/ptrace.h).
 * Linux's ABI on x86-64 is in uapi/, the CPU on each platform in <platform>/.
 */
#ifndef _KP_ARCH_H
#define _KP_ARCH_H
#pragma GCC visibility push(hidden)

#define KP_ARITH_FLAGS 0x8d5UL	/* OF SF ZF AF PF CF: restored without popfq */

/* --- a probe hit on struct pt_regs (kp_core.c, kp_internal.h) --- */

/* regs->ip as a breakpoint at addr leaves it: past the 1-byte int3 (the
 * kernel's optimized_callback(): p->addr + INT3_INSN_SIZE), which an optimized
 * probe reports too. */
#define INT3_INSN_SIZE 1
#define kp_arch_trap_ip(addr) ((addr) + INT3_INSN_SIZE)

/* The flags word of pt_regs (EFLAGS). */
#define kp_arch_regs_flags(regs) ((regs)->flags)

/* Whether a handler changed flags the detours do not restore themselves (they
 * restore the arithmetic ones with add/sahf: any other change resumes through
 * pt_regs, popfq). */
#define kp_arch_flags_changed(before, after) (((after) ^ (before)) & ~KP_ARITH_FLAGS)

/* --- fetch args (kp_fetch.c): $argN past the registers --- */

/* di si dx cx r8 r9; at a function's entry the 7th argument is the word above
 * the return address. */
#define KP_ARCH_REG_ARGS 6
#define kp_arch_stack_arg(n) ((n) - 5)

/* --- kretprobes: where the return address is (the kernel's arch rethook part,
 * arch/x86/kernel/rethook.c; kp_kretprobe.c) --- */

/* At a function's entry, `call` has just pushed the return address: its slot
 * (the kernel's "sara", ri->fp) is the stack pointer. */
static __attribute__((always_inline)) inline unsigned long kp_arch_ret_slot_at_entry(const struct pt_regs *regs)
{
	return regs->sp;
}

/* Right after the `ret` (regs as the return hooks report them: sp after the
 * ret, ip the return address), the slot it popped. */
static __attribute__((always_inline)) inline unsigned long kp_arch_ret_slot_after_return(const struct pt_regs *regs)
{
	return regs->sp - 8;
}

/* The return address of the frame whose slot is S (regs: at its entry or exit,
 * NULL on the clean paths): on x86-64 the slot itself. */
#define kp_arch_ret_addr(regs, S) (*(unsigned long *)(S))
/* ...replaced (the kernel's way: by the trampoline). */
#define kp_arch_ret_addr_set(regs, S, v) (*(unsigned long *)(S) = (v))
/* Whether slot S of a frame that is not running now still returns to v. */
#define kp_arch_ret_slot_holds(S, v) (*(unsigned long *)(S) == (v))

/* Whether code address v is a kretprobe trampoline, ours or another rewritten
 * object's runtime's (a tail call through a pointer chained across two rewritten
 * libraries: libstdc++'s __cxa_end_catch to libgcc's _Unwind_DeleteException to
 * libstdc++'s exception cleanup): every trampoline starts with a `jmp` over the
 * same 8 bytes (kretprobe_entry.S).  Compared a byte at a time: v is a return
 * address, code that runs next. */
static __attribute__((always_inline)) inline int kp_arch_is_a_trampoline(unsigned long v)
{
	const unsigned char *p = (const unsigned char *)v;
	static const unsigned char sig[10] = { 0xeb, 0x08, 'k', 'p', 'r', 'w', 'T', 'R', 'M', 'P' };
	for (int i = 0; i < 10; i++)
		if (p[i] != sig[i])
			return 0;
	return 1;
}
#define kp_arch_entry_slot_foreign(kt, S) kp_arch_is_a_trampoline(*(unsigned long *)(S))

/* regs at a `ret` (sp at the slot) made as after it: ip the return address,
 * sp past the slot (a return hook placed as a breakpoint). */
static __attribute__((always_inline)) inline void kp_arch_regs_returned(struct pt_regs *regs, unsigned long sp)
{
	regs->ip = *(unsigned long *)sp;
	regs->sp = sp + 8;
}

/* ...and back as the trap left them, keeping what a handler may change there:
 * the general registers and the arithmetic flags. */
static __attribute__((always_inline)) inline void
kp_arch_regs_unreturned(struct pt_regs *regs, unsigned long ip, unsigned long sp, unsigned long flags)
{
	regs->ip = ip;
	regs->sp = sp;
	regs->flags = (flags & ~KP_ARITH_FLAGS) | (regs->flags & KP_ARITH_FLAGS);
}

/* A spin-wait iteration (the kernel's cpu_relax()). */
static inline void cpu_relax(void)
{
	__builtin_ia32_pause();
}

/* Stop for good (the kernel's BUG()). */
#define BUG() do { for (;;) __asm__ volatile("ud2"); } while (0)

/* INT3 fallback probes (kp_trap.c, arch/x86_64/kp_int3.c, the platform's trap entry).
 * One descriptor per breakpoint site, sorted by address; addresses are link-time
 * (the trap handler subtracts kp_rt.bias). */
struct kp_breakpoint_site {
	unsigned long addr;		/* the probed instruction, now 0xcc */
	unsigned long slot;		/* boost / single-step: the out-of-line copy */
	unsigned long ss_end;		/* single-step: right after the copy (where TF traps) */
	unsigned long target;		/* emulate: branch target */
	unsigned int site;		/* kp_sites[] index */
	unsigned char mode;		/* KP_XOL_* */
	unsigned char kind;		/* emulate: KP_EMU_* */
	unsigned char cc;		/* jcc condition; loop variant */
	unsigned char size;		/* length of the probed instruction */
	unsigned short imm;		/* ret imm16 */
	unsigned char reg;		/* call/jmp through a register: pt_regs word index */
	unsigned char addr32;		/* loop/jcxz with an address-size prefix */
	unsigned char index;		/* call/jmp through memory: index register (0xff none) */
	unsigned char scale;
	unsigned char rip;		/* call/jmp through memory: target is the absolute address */
	unsigned char kret;		/* a kretprobe return hook at this exit: KP_KRET_HOOK_* (0 none) */
	unsigned char post;		/* a probe of the site has a post_handler */
	unsigned char plain;		/* boosted or single-stepped, no kretprobe hook (kp_arch_int3_bp()) */
	unsigned char pad[14];		/* 64 bytes: an index is a shift */
};
#define KP_XOL_EMULATE 1
#define KP_XOL_BOOST 2
#define KP_XOL_SINGLESTEP 3
/* A mode's tag in a kernel's kprobes/list (kp_debugfs.c), after the kernel's [OPTIMIZED]. */
#define kp_arch_xol_tag(mode) \
	((mode) == KP_XOL_EMULATE ? "[EMULATED]" : (mode) == KP_XOL_BOOST ? "[BOOSTED]" : "[SINGLESTEP]")
extern struct kp_breakpoint_site kp_breakpoints[];
extern const unsigned int kp_nbreakpoints;
/* The descriptors' hash and single-step entries: kp_breakpoint.h. */
/* The first and last end of an int3-ended single-step copy (link-time; ~0 and 0: none):
 * each such slot's jmp back is followed by its descriptor's index. */
extern const unsigned long kp_breakpoint_ss_first, kp_breakpoint_ss_last;

/* Handle a trap's struct pt_regs if it follows one of our int3s or single-stepped
 * copies; 1 if it did (a user SIGTRAP's context converted, linux_user's
 * kp_arch_breakpoint_trap(); a kernel's #BP frame): ss_trap is 1 where single-stepped
 * copies end with an int3 rather than trap with TF set. */
struct pt_regs;
int kp_arch_breakpoint_regs(struct pt_regs *regs, int ss_trap);
/* The same for a kernel's #BP (ss_trap 1), its common cases first. */
int kp_arch_int3_bp(struct pt_regs *regs);
/* The same for an int3 through a kernel's early IDT (no handlers yet); 0: not ours. */
int kp_arch_int3_early(struct pt_regs *regs);

#pragma GCC visibility pop
#endif
