/*
 * The shared half of AArch64 detour buffers (the optprobe template of the arm64
 * OPTPROBES series, split so each probe's own stub stays small).
 *
 * A probe's stub, emitted by kprewrite (rewriter/arch/aarch64/emit.py), does:
 *	stp  x16, x30, [sp, #-16]!	the probed code's x16 and x30
 *	movz/movk x16, #SITE		which kp_sites[] entry
 *	bl   kp_optprobe_entry		(or kp_optprobe_post_entry, the clean ones)
 *	ldp  x16, x30, [sp], #16
 *	<relocated instruction>; b back
 *
 * Here struct pt_regs is built below that (AArch64 Linux has no red zone; sp
 * stays 16-byte aligned), the C callback runs, and every register comes back
 * from pt_regs, so a handler's writes take effect (x16 and x30 through the
 * stub's pair, NZCV by msr).  When the callback asks (the handler changed pc,
 * sp or PSTATE beyond NZCV) kp_optprobe_resume_regs resumes at regs->pc with
 * all of regs.
 *
 * Frame: pt_regs at sp, then the return into the stub (PT_SIZE), padding, then
 * the stub's pair (PT_SIZE + 16: x16, x30); the probed code's sp is above it.
 */
#include "kp_regs.h"

	.text
	.p2align 4

.macro OPTPROBE_ENTRY name, callback, check
	.globl \name
	.hidden \name
	.type \name, @function
\name:
	sub	sp, sp, #(PT_SIZE + 16)
	PT_REGS_SAVE
	str	x30, [sp, #PT_SIZE]		/* the return into the stub */
	ldp	x0, x1, [sp, #(PT_SIZE + 16)]	/* the probed code's x16, x30 */
	str	x0, [sp, #PT_X16]
	str	x1, [sp, #PT_LR]
	add	x0, sp, #(PT_SIZE + 32)
	str	x0, [sp, #PT_SP]		/* sp at the hit */
	str	xzr, [sp, #PT_PC]		/* the callback sets it (kp_arch_trap_ip()) */
	mov	x0, x16				/* SITE */
	mov	x1, sp
	bl	\callback
.if \check
	cbnz	x0, kp_optprobe_resume_regs
.endif
	ldr	x0, [sp, #PT_X16]		/* a handler's x16 and x30: the stub restores them */
	ldr	x1, [sp, #PT_LR]
	stp	x0, x1, [sp, #(PT_SIZE + 16)]
	PT_REGS_RESTORE
	ldr	x30, [sp, #PT_SIZE]
	add	sp, sp, #(PT_SIZE + 16)
	ret
	.size \name, .-\name
.endm

	OPTPROBE_ENTRY kp_optprobe_entry, kp_optimized_callback, 1
	OPTPROBE_ENTRY kp_optprobe_post_entry, kp_post_callback, 1
	/* The clean callbacks read no regs and return nothing (the frame is the same). */
	OPTPROBE_ENTRY kp_optprobe_clean_entry, kp_optimized_clean_callback, 0
	OPTPROBE_ENTRY kp_optprobe_clean_post_entry, kp_post_clean_callback, 0

/*
 * Resume at regs->pc on regs->sp with all of regs (sp at pt_regs).  No branch
 * restores every register (one must hold the target), so this traps: the brk
 * below is ours, and the SIGTRAP handler (kp_int3.c) loads the signal context
 * from the pt_regs sp points at; rt_sigreturn then resumes exactly there.  Only
 * a handler that changes the path, sp or PSTATE pays for it.
 */
	.globl kp_optprobe_resume_regs
	.hidden kp_optprobe_resume_regs
	.type kp_optprobe_resume_regs, @function
kp_optprobe_resume_regs:
	.globl kp_optprobe_resume_brk
	.hidden kp_optprobe_resume_brk
kp_optprobe_resume_brk:
	brk	#0x004
	b	kp_optprobe_resume_brk
	.size kp_optprobe_resume_regs, .-kp_optprobe_resume_regs

	.section .note.GNU-stack,"",@progbits
