/*
 * Return hooks of kretprobes and the kernel-style trampoline
 * (arch/x86/kernel/rethook.c's arch_rethook_trampoline, plus kprewrite's hooks
 * that run before the function's own `ret`).
 *
 * A return hook is reached by `call` from a detour, right before the ret (or
 * the tail jmp) it guards: 0(%rsp) returns into the detour, 8(%rsp) is the
 * slot holding the caller's return address.  Below the slot everything is dead
 * (the function is leaving), so no red zone is skipped.  pt_regs is built as
 * the kernel's trampoline reports it: ip = the return address, sp = the stack
 * pointer after the ret.  Every register is restored from pt_regs afterwards
 * (a handler may change the return value in regs->ax).  Caller-saved registers
 * are kept too although the ABI leaves them undefined at a return: gcc's
 * interprocedural register allocation (-fipa-ra) lets a caller keep values in
 * them across a call to a function it knows does not touch them, and for the
 * same reason the arithmetic flags are kept (seto/lahf and add/sahf, as in
 * optprobe_entry.S) although the ABI says they are not preserved by a call.
 *
 * pt_regs offsets are kp_asm_offsets.h's PT_* (kp_regs.h).
 */
#include "kp_regs.h"

	.text

/* slot: where the return-address slot is from %rsp on entry: 8 when reached
 * by `call` from a detour, 0 when reached by `jmp` (below). */
.macro KRET_HOOK name, callback, slot=8
	.p2align 4
	.globl \name
	.hidden \name
	.type \name, @function
\name:
	/* CFA = %rsp + 8 either way: reached by jmp (slot 0), the hook's frame is the
	 * function's own, leaving, its return address the slot, as at a ret. */
	KP_CFI(.cfi_startproc)
	lea	-PT_SIZE-KP_KRET_GAP(%rsp), %rsp
	KP_CFI(.cfi_adjust_cfa_offset PT_SIZE)
	PT_REGS_SAVE
	KP_CFI(.cfi_rel_offset %rbx, PT_BX)
	mov	PT_SIZE+KP_KRET_GAP+\slot(%rsp), %rax	/* the return address */
	mov	%rax, PT_IP(%rsp)
	lea	PT_SIZE+KP_KRET_GAP+\slot+8(%rsp), %rax	/* sp after the ret */
	mov	%rax, PT_SP(%rsp)
	KP_UNWIND_EXIT_FRAME PT_SIZE+KP_KRET_GAP+\slot, \slot
	mov	%rsp, %rdi
#ifdef KP_STACK_ALIGN8
	call	\callback			/* 8-byte alignment is all C needs here */
#else
	mov	%rsp, %rbx
	KP_CFI(.cfi_def_cfa_register %rbx)
	and	$-16, %rsp
	call	\callback
	mov	%rbx, %rsp
	KP_CFI(.cfi_def_cfa_register %rsp)
#endif
	KP_UNWIND_EXIT_FRAME_END PT_SIZE+KP_KRET_GAP+\slot, \slot, %rax
	PT_REGS_RESTORE
	lea	PT_SIZE+KP_KRET_GAP(%rsp), %rsp
	KP_CFI(.cfi_adjust_cfa_offset -PT_SIZE)
	KP_RET
	KP_CFI(.cfi_endproc)
	.size \name, .-\name
.endm

	KRET_HOOK kp_kretprobe_ret_entry, kp_kretprobe_return
/*
 * The same hook for a plain `ret`, reached by `jmp` instead of `call`: 0(%rsp)
 * is the slot itself, and the hook's own final `ret` is the function's return
 * (one call/ret pair less; the return-stack predictor stays balanced).
 */
	KRET_HOOK kp_kretprobe_ret_jmp_entry, kp_kretprobe_return, 0
	KRET_HOOK kp_kretprobe_tail_pending_entry, kp_kretprobe_tail_pending
	KRET_HOOK kp_kretprobe_tail_swap_entry, kp_kretprobe_tail_swap

/*
 * Clean return hooks: for a function whose kretprobes' handlers never read
 * regs (kprewrite reads their code), only the call-clobbered registers and
 * the arithmetic flags are saved (callee-saved ones are the C code's to keep),
 * as the clean optprobe entry does.  kp_kretprobe_return_clean(S) returns 1
 * when an instance at the slot needs struct pt_regs after all: everything is
 * restored and the full hook of the same kind takes over.
 * Frame: kp_regs.h's clean frame.
 */
#define CLEAN_SIZE 88

.macro KRET_CLEAN_HOOK name, slot, full
	.p2align 4
	.globl \name
	.hidden \name
	.type \name, @function
\name:
	KP_CFI(.cfi_startproc)
	lea	-CLEAN_SIZE-KP_KRET_GAP(%rsp), %rsp
	KP_CFI(.cfi_adjust_cfa_offset CLEAN_SIZE)
	CLEAN_SAVE
	KP_UNWIND_EXIT_FRAME CLEAN_SIZE+KP_KRET_GAP+\slot, \slot
	lea	CLEAN_SIZE+KP_KRET_GAP+\slot(%rsp), %rdi	/* the return-address slot */
#ifdef KP_STACK_ALIGN8
	call	kp_kretprobe_return_clean	/* 8-byte alignment is all C needs here */
#else
	mov	%rsp, %rcx
	and	$-16, %rsp
	sub	$16, %rsp
	mov	%rcx, 8(%rsp)
	/* CFA = [%rsp + 8] + CLEAN_SIZE + 8 (DW_OP_breg7 8, deref, plus_uconst). */
	KP_CFI(.cfi_escape 0x0f, 0x05, 0x77, 0x08, 0x06, 0x23, CLEAN_SIZE+8)
	call	kp_kretprobe_return_clean
	mov	8(%rsp), %rsp
	KP_CFI(.cfi_def_cfa %rsp, CLEAN_SIZE+8)
#endif
	KP_UNWIND_EXIT_FRAME_END CLEAN_SIZE+KP_KRET_GAP+\slot, \slot, %rcx
	test	%eax, %eax
	jne	1f
	CLEAN_RESTORE
	lea	CLEAN_SIZE+KP_KRET_GAP(%rsp), %rsp
	KP_CFI(.cfi_adjust_cfa_offset -CLEAN_SIZE)
	KP_RET
1:	KP_CFI(.cfi_adjust_cfa_offset CLEAN_SIZE)
	CLEAN_RESTORE
	lea	CLEAN_SIZE+KP_KRET_GAP(%rsp), %rsp
	KP_CFI(.cfi_adjust_cfa_offset -CLEAN_SIZE)
	jmp	\full
	KP_CFI(.cfi_endproc)
	.size \name, .-\name
.endm

	KRET_CLEAN_HOOK kp_kretprobe_ret_clean_entry, 8, kp_kretprobe_ret_entry
	KRET_CLEAN_HOOK kp_kretprobe_ret_clean_jmp_entry, 0, kp_kretprobe_ret_jmp_entry

/*
 * A tail call through a pointer (a user process's: rules.kretprobe_pointer_tails;
 * no kernel frame record): the detour pushed the pointer's target, so 0(%rsp)
 * returns into the detour, 8(%rsp) is the target, 16(%rsp) the slot.
 * kp_kretprobe_tail_pointer(S, target) runs no handler: the clean frame.
 */
#ifdef KP_KRET_POINTER_TAILS
	.p2align 4
	.globl kp_kretprobe_tail_pointer_entry
	.hidden kp_kretprobe_tail_pointer_entry
	.type kp_kretprobe_tail_pointer_entry, @function
kp_kretprobe_tail_pointer_entry:
	KP_CFI(.cfi_startproc)
	lea	-CLEAN_SIZE(%rsp), %rsp
	KP_CFI(.cfi_adjust_cfa_offset CLEAN_SIZE)
	CLEAN_SAVE
	lea	CLEAN_SIZE+16(%rsp), %rdi	/* the return-address slot */
	mov	CLEAN_SIZE+8(%rsp), %rsi	/* the tail call's target */
#ifdef KP_STACK_ALIGN8
	call	kp_kretprobe_tail_pointer
#else
	mov	%rsp, %rcx
	and	$-16, %rsp
	sub	$16, %rsp
	mov	%rcx, 8(%rsp)
	KP_CFI(.cfi_escape 0x0f, 0x05, 0x77, 0x08, 0x06, 0x23, CLEAN_SIZE+8)
	call	kp_kretprobe_tail_pointer
	mov	8(%rsp), %rsp
	KP_CFI(.cfi_def_cfa %rsp, CLEAN_SIZE+8)
#endif
	CLEAN_RESTORE
	lea	CLEAN_SIZE(%rsp), %rsp
	KP_CFI(.cfi_adjust_cfa_offset -CLEAN_SIZE)
	KP_RET
	KP_CFI(.cfi_endproc)
	.size kp_kretprobe_tail_pointer_entry, .-kp_kretprobe_tail_pointer_entry
#endif

/*
 * The trampoline a swapped slot returns into: %rsp is just above the slot.
 * Push a word back into the slot, build pt_regs below it, let the handler
 * fire the instances and return the real address, store it in the slot, and
 * `ret` to it.
 */
	.p2align 4
	.globl kp_kretprobe_trampoline
	.hidden kp_kretprobe_trampoline
	.type kp_kretprobe_trampoline, @function
	nop					/* unwinders look up (return address - 1) */
kp_kretprobe_trampoline:
	/* The mark another rewritten object's runtime knows a trampoline by
	 * (kp_arch_slot_holds_a_trampoline()). */
	jmp	1f
	.ascii	"kprwTRMP"
1:	push	$0
	lea	-PT_SIZE-KP_KRET_GAP(%rsp), %rsp
	PT_REGS_SAVE
	movq	$0, PT_IP(%rsp)
	lea	PT_SIZE+KP_KRET_GAP+8(%rsp), %rax
	mov	%rax, PT_SP(%rsp)
	/* The record below the slot (kp_kretprobe_trampoline_handler() stores the real
	 * return address in it while the handlers run): the caller's frame is next. */
	KP_UNWIND_EXIT_FRAME PT_SIZE+KP_KRET_GAP+8, 0
	mov	%rsp, %rdi
#ifdef KP_STACK_ALIGN8
	call	kp_kretprobe_trampoline_handler
#else
	mov	%rsp, %rbx
	and	$-16, %rsp
	call	kp_kretprobe_trampoline_handler
	mov	%rbx, %rsp
#endif
	mov	%rax, PT_SIZE+KP_KRET_GAP(%rsp)
	PT_REGS_RESTORE
	lea	PT_SIZE+KP_KRET_GAP(%rsp), %rsp
	KP_RET
	.size kp_kretprobe_trampoline, .-kp_kretprobe_trampoline

	.section .note.GNU-stack,"",@progbits
