/*
 * The shared entry of AArch64 detours and return hooks (optprobe_entry.S,
 * kretprobe_entry.S), reached from a stub kprewrite emits
 * (rewriter/arch/aarch64/emit.py, probe_stub()):
 *	stp  x16, x30, [sp, #-16]!	the probed code's x16 and x30
 *	movz/movk x16, #SITE		which kp_sites[] entry
 *	bl   <entry>
 *	ldp  x16, x30, [sp], #16
 *
 * struct pt_regs is built below that (AArch64 Linux has no red zone; sp stays
 * 16-byte aligned), the C callback runs, and every register comes back from
 * pt_regs, so a handler's writes take effect (x16 and x30 through the stub's
 * pair, NZCV by msr).  Frame: pt_regs at sp, the return into the stub at
 * PT_SIZE, the stub's pair at PT_SIZE + 16; the probed code's sp above it.
 *
 * KP_ENTRY name, callback, check, ret:
 *   check: a non-zero result resumes through kp_optprobe_resume_regs (the
 *          handler changed pc, sp or PSTATE beyond NZCV);
 *   ret:   callback(regs) with regs as after a `ret` (pc the return address,
 *          x30) for the return hooks; else callback(SITE, regs), pc set by it.
 */
#include "kp_regs.h"

.macro KP_ENTRY name, callback, check, ret
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
.if \ret
	str	x1, [sp, #PT_PC]		/* as after the ret: at the return address */
	mov	x0, sp
.else
	str	xzr, [sp, #PT_PC]		/* the callback sets it (kp_arch_trap_ip()) */
	mov	x0, x16				/* SITE */
	mov	x1, sp
.endif
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
