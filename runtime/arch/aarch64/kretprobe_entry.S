/*
 * kretprobes on AArch64 (the kernel's arch/arm64/kernel/rethook_trampoline.S,
 * and kprewrite's return hooks; rewriter/arch/aarch64/retprobe.py).
 *
 * The return hooks run just before an exit, from the stub of its detour
 * (kp_entry.h): pt_regs as after the ret (pc the return address in x30, sp
 * unchanged: a `bl` pushes nothing), then kp_kretprobe_return() at a ret,
 * kp_kretprobe_tail_pending() / kp_kretprobe_tail_swap() at a tail call (the
 * latter sets regs->regs[30] to the trampoline, which the stub's pair carries
 * back into x30).  Every hook here passes pt_regs, so the clean names and the
 * jmp forms the generic emission may name are the same code (a function with one
 * kretprobe has its hooks inlined: rewriter/arch/aarch64/retprobe.py).
 */
#include "kp_entry.h"

	.text
	.p2align 4

	KP_ENTRY kp_kretprobe_ret_entry, kp_kretprobe_return, 0, 1
	KP_ENTRY kp_kretprobe_tail_pending_entry, kp_kretprobe_tail_pending, 0, 1
	KP_ENTRY kp_kretprobe_tail_swap_entry, kp_kretprobe_tail_swap, 0, 1

	.globl kp_kretprobe_ret_clean_entry, kp_kretprobe_ret_jmp_entry, kp_kretprobe_ret_clean_jmp_entry
	.hidden kp_kretprobe_ret_clean_entry, kp_kretprobe_ret_jmp_entry, kp_kretprobe_ret_clean_jmp_entry
	.set kp_kretprobe_ret_clean_entry, kp_kretprobe_ret_entry
	.set kp_kretprobe_ret_jmp_entry, kp_kretprobe_ret_entry
	.set kp_kretprobe_ret_clean_jmp_entry, kp_kretprobe_ret_entry

/*
 * __kretprobe_trampoline: a function whose x30 was swapped returns here (sp as
 * at its entry).  pt_regs, the handlers (kp_kretprobe_trampoline_handler()
 * gives the real return address), then `ret` to it with x30 holding it: a ret
 * is never checked by BTI.
 */
	.p2align 4
	.globl kp_kretprobe_trampoline
	.hidden kp_kretprobe_trampoline
	.type kp_kretprobe_trampoline, @function
kp_kretprobe_trampoline:
	/* The mark another rewritten object's runtime knows a trampoline by
	 * (kp_arch_is_a_trampoline()). */
	b	1f
	.ascii	"kprwTRMP"
1:	sub	sp, sp, #PT_SIZE
	PT_REGS_SAVE
	add	x0, sp, #PT_SIZE
	str	x0, [sp, #PT_SP]
	adr	x0, kp_kretprobe_trampoline
	str	x0, [sp, #PT_PC]
	mov	x0, sp
	bl	kp_kretprobe_trampoline_handler
	str	x0, [sp, #PT_LR]		/* x30: the real return address */
	PT_REGS_RESTORE
	add	sp, sp, #PT_SIZE
	ret
	.size kp_kretprobe_trampoline, .-kp_kretprobe_trampoline

/*
 * A kretprobe's entry detour (emit._kret_entry(): KRET_DISPATCH_OFFSET bytes
 * after the trampoline), and the slow path of an inlined one
 * (emit.kret_entry_detour()): the generic dispatch, which runs
 * pre_handler_kretprobe() as the site's pre_handler.
 */
	.org kp_kretprobe_trampoline + 256
	KP_ENTRY kp_kretprobe_entry_dispatch, kp_optimized_callback, 1, 0

	.section .note.GNU-stack,"",@progbits
