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
 * The entries (kp_entry.h) build struct pt_regs, call the C callback and
 * restore every register; when the callback asks (the handler changed pc, sp
 * or PSTATE beyond NZCV) kp_optprobe_resume_regs resumes at regs->pc with all
 * of regs.
 */
#include "kp_entry.h"

	.text
	.p2align 4

	KP_ENTRY kp_optprobe_entry, kp_optimized_callback, 1, 0
	KP_ENTRY kp_optprobe_post_entry, kp_post_callback, 1, 0
	/* The clean callbacks read no regs and return nothing (the frame is the same). */
	KP_ENTRY kp_optprobe_clean_entry, kp_optimized_clean_callback, 0, 0
	KP_ENTRY kp_optprobe_clean_post_entry, kp_post_clean_callback, 0, 0

/*
 * Resume at regs->pc on regs->sp with all of regs (sp at pt_regs).  No branch
 * restores every register (one must hold the target), so this traps: the brk
 * below is ours, and the SIGTRAP handler (kp_brk.c) loads the signal context
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
