/*
 * The shared half of every detour buffer (arch/x86/kernel/kprobes/opt.c's
 * optprobe_template, split so each probe's own stub stays small).
 *
 * A probe's stub, emitted by kprewrite, does:
 *	lea  -128(%rsp), %rsp		step over the user red zone
 *	push $SITE			which kp_sites[] entry
 *	call kp_optprobe_entry		(or kp_optprobe_post_entry)
 *	lea  136(%rsp), %rsp		pop SITE and the red zone
 *	<relocated DCR>; jmp back
 *
 * Here we build struct pt_regs below that, call the C callback with a 16-byte
 * aligned stack, and restore every register from pt_regs, so handler writes take
 * effect (kp_regs.h: the arithmetic flags by seto/lahf and add/sahf); when the
 * callback asks for it (path change, sp or non-arithmetic flags changed) the slow
 * path restores the full flags with popfq and resumes at regs->ip on regs->sp.
 *
 * pt_regs offsets are kp_asm_offsets.h's PT_* (kp_regs.h).  At entry: 0(%rsp)
 * return into the stub, 8(%rsp) SITE, and the probed code's %rsp was 144(%rsp).
 *
 * A platform with no red zone (a kernel, built with -mno-red-zone: interrupts
 * push on the stack it runs on, so nothing lives below %rsp) also has the short
 * stubs (KP_SHORT_STUBS; emit.short_stub()), 10 bytes instead of 23:
 *	push $SITE
 *	call kp_optprobe_short_entry	(or ..._short_post_entry, ..._short_clean_entry...)
 *	<relocated DCR>; jmp back
 * Their entries are the same bodies with no red zone between SITE and the probed
 * code's %rsp (16(%rsp) at entry), and return over SITE: `popq (%rsp)` moves the
 * return address onto SITE's slot (pop with an %rsp-based destination writes
 * after the increment) without a register or the flags.
 *
 * A platform whose unwinder follows frame records (KP_UNWIND_FRAME_RECORD, a
 * kernel's: linux_kernel/kp_platform_asm.h) wants the record right below the
 * probed code's %rsp, S, which is where a short stub's two words are (SITE at
 * S - 8, the return into the stub at S - 16).  So there the short entries first
 * copy the return address one word lower (`push (%rsp)`, no register), read SITE,
 * and then build the record over the two words; on the way out `popq 8(%rsp)`
 * puts the return address back at S - 8 (over the record's) and `lea 8(%rsp)`
 * steps onto it (the clean entries `pop %rbp`: the probed code's, from the
 * record).  The long stub's entries build it in the 128 bytes the stub
 * steps over.  Layouts, from the return into the stub (the entry's frame above):
 *	long stub:			ret, SITE, 128 bytes, S
 *	short stub:			ret, SITE, S
 *	short stub, frame record:	ret (copy), ret -> %rbp, SITE -> hit + 1, S
 */
#include "kp_regs.h"

	.text
	.p2align 5

/* The short entries' layouts: SITE's and S's offsets from the return into the
 * stub, and what is popped on the way out (0: nothing, 1: SITE, 2: the copy of
 * the return address and the record). */
#ifdef KP_UNWIND_FRAME_RECORD
#define SHORT_LAYOUT 16, 24, 2
#else
#define SHORT_LAYOUT 8, 16, 1
#endif

/* Before the frame: the return address copied below the record's words. */
.macro COPY_RET pop
.if \pop == 2
	push	(%rsp)
	KP_CFI(.cfi_adjust_cfa_offset 8)
.endif
.endm

/* Back into the stub; pop 1: over SITE too (a short stub's entries); pop 2: the
 * copy of the return address back at S - 8, over the record's, whose %rbp word
 * the clean entries pop into %rbp (rbp 1: the probed code's, KP_UNWIND_FRAME_END's
 * work) and the full ones step over (they restored it from pt_regs). */
.macro RET_OVER_SITE pop, rbp=0
.if \pop == 1
	popq	(%rsp)
	KP_CFI(.cfi_adjust_cfa_offset -8)
.endif
.if \pop == 2
	popq	8(%rsp)
.if \rbp
	pop	%rbp
.else
	lea	8(%rsp), %rsp
.endif
	KP_CFI(.cfi_adjust_cfa_offset -16)
.endif
	KP_RET
.endm

/* unwind: 1 when the frame record's return address is after the probed instruction
 * (KP_UNWIND_FRAME: a post_handler's); site, sp: SITE's and S's offsets from the
 * return into the stub; pop: RET_OVER_SITE's. */
.macro OPTPROBE_ENTRY name, callback, unwind, site=8, sp=144, pop=0
	.globl \name
	.hidden \name
	.type \name, @function
\name:
	KP_CFI(.cfi_startproc)
	COPY_RET \pop
	lea	-PT_SIZE(%rsp), %rsp
	KP_CFI(.cfi_adjust_cfa_offset PT_SIZE)
	PT_REGS_SAVE
	KP_CFI(.cfi_rel_offset %rbx, PT_BX)
	lea	PT_SIZE+\sp(%rsp), %rax
	mov	%rax, PT_SP(%rsp)		/* sp before the detour */
	mov	PT_SIZE+\site(%rsp), %edi	/* SITE */
	KP_UNWIND_FRAME PT_SIZE+\sp, PT_SIZE, \unwind
	mov	%rsp, %rsi
#ifdef KP_STACK_ALIGN8
	call	\callback
#else
	mov	%rsp, %rbx
	KP_CFI(.cfi_def_cfa_register %rbx)
	and	$-16, %rsp
	call	\callback
	mov	%rbx, %rsp
	KP_CFI(.cfi_def_cfa_register %rsp)
#endif
	test	%eax, %eax
	jnz	kp_optprobe_resume_regs
	/* Fast path: arithmetic flags back with add/sahf, then the registers. */
	PT_REGS_RESTORE
	lea	PT_SIZE(%rsp), %rsp
	KP_CFI(.cfi_adjust_cfa_offset -PT_SIZE)
	RET_OVER_SITE \pop
	KP_CFI(.cfi_endproc)
	.size \name, .-\name
.endm

	OPTPROBE_ENTRY kp_optprobe_entry, kp_optimized_callback, 0
	OPTPROBE_ENTRY kp_optprobe_post_entry, kp_post_callback, 1
#ifdef KP_SHORT_STUBS
	OPTPROBE_ENTRY kp_optprobe_short_entry, kp_optimized_callback, 0, SHORT_LAYOUT
	OPTPROBE_ENTRY kp_optprobe_short_post_entry, kp_post_callback, 1, SHORT_LAYOUT
#endif

/*
 * The clean call: for sites whose handlers kprewrite proved never read their
 * regs argument.  Saves only what a C call clobbers (rax rcx rdx rsi rdi
 * r8-r11) and the arithmetic flags, calls callback(SITE) on a 16-byte aligned
 * stack and restores them; the callee-saved registers are the callee's to keep.
 * Frame: 0..64 the nine registers, 72 the flags word (al = OF, ah = lahf),
 * 80 return into the stub, then SITE and S as OPTPROBE_ENTRY's (site, sp).
 */
.macro OPTPROBE_CLEAN_ENTRY name, callback, slot=0, unwind=0, site=8, sp=144, pop=0, flags=1
	.globl \name
	.hidden \name
	.type \name, @function
\name:
	KP_CFI(.cfi_startproc)
	COPY_RET \pop
	lea	-80(%rsp), %rsp
	KP_CFI(.cfi_adjust_cfa_offset 80)
	CLEAN_SAVE \flags
	mov	80+\site(%rsp), %edi		/* SITE */
	KP_UNWIND_FRAME 80+\sp, 80, \unwind
.if \slot
	/* The stack pointer at the hit: above SITE and probe_stub()'s 128 bytes (none: a short stub). */
	lea	80+\sp(%rsp), %rsi
.endif
#ifdef KP_STACK_ALIGN8
	call	\callback
#else
	mov	%rsp, %rcx
	and	$-16, %rsp
	push	%rcx
	push	%rcx
	/* CFA = [%rsp] + 88: the old %rsp stored (DW_OP_breg7 0, deref, plus_uconst 88). */
	KP_CFI(.cfi_escape 0x0f, 0x05, 0x77, 0x00, 0x06, 0x23, 88)
	call	\callback
	mov	(%rsp), %rsp
	KP_CFI(.cfi_def_cfa %rsp, 88)
#endif
.if \pop != 2
	KP_UNWIND_FRAME_END
.endif
	CLEAN_RESTORE \flags
	lea	80(%rsp), %rsp
	KP_CFI(.cfi_adjust_cfa_offset -80)
	RET_OVER_SITE \pop, 1
	KP_CFI(.cfi_endproc)
	.size \name, .-\name
.endm

	OPTPROBE_CLEAN_ENTRY kp_optprobe_clean_entry, kp_optimized_clean_callback
	OPTPROBE_CLEAN_ENTRY kp_optprobe_clean_post_entry, kp_post_clean_callback, 0, 1
#ifdef KP_KRET_CLEAN_ENTRY
/* A kretprobe's entry as a clean call (Rules.kretprobe_clean_entry): callback(SITE, the
 * return-address slot), a kernel's (runtime/platform/linux_kernel/kp_kretprobe_task.c). */
	OPTPROBE_CLEAN_ENTRY kp_kretprobe_clean_entry, kp_kretprobe_clean_callback, 1
#endif
#ifdef KP_SHORT_STUBS
	OPTPROBE_CLEAN_ENTRY kp_optprobe_short_clean_entry, kp_optimized_clean_callback, 0, 0, SHORT_LAYOUT
/* The same where the arithmetic flags are dead at the site (Site.flags_live, e.g. a
 * function's entry): the flags are neither kept nor put back. */
	OPTPROBE_CLEAN_ENTRY kp_optprobe_short_clean_nf_entry, kp_optimized_clean_callback, 0, 0, SHORT_LAYOUT, 0
	OPTPROBE_CLEAN_ENTRY kp_optprobe_short_clean_post_entry, kp_post_clean_callback, 0, 1, SHORT_LAYOUT
#ifdef KP_KRET_CLEAN_ENTRY
	OPTPROBE_CLEAN_ENTRY kp_kretprobe_short_clean_entry, kp_kretprobe_clean_callback, 1, 0, SHORT_LAYOUT
#endif
#endif

/*
 * Resume at regs->ip on regs->sp with all of regs, flags by popfq.
 * %rsp = R (pt_regs).  T = regs->sp.  Copy pt_regs down to
 * N = min(R, T - 136) - 168 so that the return address we store at T - 136
 * (below T's red zone) overlaps neither copy, then pop everything and
 * `ret $128`: ip from T - 136, and %rsp ends at T.
 */
	.globl kp_optprobe_resume_regs
	.hidden kp_optprobe_resume_regs
	.type kp_optprobe_resume_regs, @function
kp_optprobe_resume_regs:
	/* regs->ip under a shared region's jump: its place in the detour. */
	mov	PT_IP(%rsp), %rdi
	mov	%rsp, %rbx
	and	$-16, %rsp
	call	kp_region_ip
	mov	%rbx, %rsp
	mov	%rax, PT_IP(%rsp)
	mov	PT_SP(%rsp), %rax		/* T */
	lea	-136(%rax), %rdx		/* where ip goes */
	mov	%rsp, %rcx
	cmp	%rdx, %rcx
	cmova	%rdx, %rcx			/* min(R, T - 136) */
	sub	$PT_SIZE, %rcx			/* N */
	/* Move %rsp down to N first, so the copy and its source both lie above it:
	 * an interrupt (kernel) pushes below %rsp at any instruction, and a signal
	 * frame (user) lands 128 bytes below it, inside the copy's lower end. */
	mov	%rsp, %rsi			/* R */
	mov	%rcx, %rsp
	xor	%eax, %eax
1:	mov	(%rsi,%rax,8), %rdi		/* N + PT_SIZE <= R: no overlap */
	mov	%rdi, (%rsp,%rax,8)
	inc	%eax
	cmp	$PT_SIZE/8, %eax
	jb	1b
	mov	PT_IP(%rsp), %rdi
	mov	%rdi, (%rdx)			/* ip at T - 136 */
	mov	%rdx, PT_SP(%rsp)		/* pop %rsp lands at T - 136 */
	PT_REGS_LOAD
	lea	PT_FLAGS(%rsp), %rsp
	popfq
	pop	%rsp
	ret	$128
	.size kp_optprobe_resume_regs, .-kp_optprobe_resume_regs

	.section .note.GNU-stack,"",@progbits
