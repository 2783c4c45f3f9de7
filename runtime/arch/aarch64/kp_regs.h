/*
 * Register save/restore sequences for the AArch64 asm entries (optprobe and
 * kretprobe detours), and the layout they fill.
 *
 * struct pt_regs (include/kprewrite/arch/aarch64/ptrace.h), byte offsets; the
 * PT_* names come from kp_asm_offsets.h, which rewriter/link/runtime.py
 * generates from kp_asm_offsets.c:
 *
 *     regs[n]   8 * n      x0..x30 (PT_X0..PT_X30; PT_FP = x29 at 232, PT_LR = x30 at 240)
 *     sp        248        PT_SP      the probed code's sp (before the entry made room)
 *     pc        256        PT_PC      the probed address (a brk leaves pc there too)
 *     pstate    264        PT_PSTATE  NZCV in bits 31..28 (`mrs x, nzcv`), EL0t: the rest 0
 *     orig_x0   272        PT_ORIG_X0     0 (no system call)
 *     syscallno 280        PT_SYSCALLNO   -1 (the kernel's NO_SYSCALL), then 4 bytes 0
 *     size      288        PT_SIZE    a multiple of 16: sp stays aligned
 *
 * AArch64 Linux has no red zone: an entry may build pt_regs right below the
 * probed code's sp (`sub sp, sp, #PT_SIZE`).  Handlers are compiled with
 * -mgeneral-regs-only (rewriter/arch/aarch64/toolchain.py), so the entries save
 * no FP/SIMD register; the C they call preserves x19..x29 (AAPCS64) and
 * clobbers x0..x18 and x30.
 */
#include <kp_asm_offsets.h>
#include <kp_platform_asm.h>	/* arch/aarch64/<platform>/: KP_PT_PSTATE */

/* pt_regs at sp: x0..x30, pstate (NZCV | KP_PT_PSTATE), orig_x0 and
 * syscallno; sp and pc are the caller's to fill.  Clobbers x0 (saved first). */
.macro PT_REGS_SAVE
	stp	x0, x1, [sp, #PT_X0]
	stp	x2, x3, [sp, #PT_X2]
	stp	x4, x5, [sp, #PT_X4]
	stp	x6, x7, [sp, #PT_X6]
	stp	x8, x9, [sp, #PT_X8]
	stp	x10, x11, [sp, #PT_X10]
	stp	x12, x13, [sp, #PT_X12]
	stp	x14, x15, [sp, #PT_X14]
	stp	x16, x17, [sp, #PT_X16]
	stp	x18, x19, [sp, #PT_X18]
	stp	x20, x21, [sp, #PT_X20]
	stp	x22, x23, [sp, #PT_X22]
	stp	x24, x25, [sp, #PT_X24]
	stp	x26, x27, [sp, #PT_X26]
	stp	x28, x29, [sp, #PT_X28]
	str	x30, [sp, #PT_LR]
	mrs	x0, nzcv
.if KP_PT_PSTATE
	orr	x0, x0, #KP_PT_PSTATE
.endif
	str	x0, [sp, #PT_PSTATE]
	mov	w0, #-1				/* syscallno -1, unused2 0 */
	stp	xzr, x0, [sp, #PT_ORIG_X0]
.endm

/* x0..x30 and NZCV back from pt_regs at sp (not sp or pc: the caller's). */
.macro PT_REGS_RESTORE
	ldr	x0, [sp, #PT_PSTATE]
	msr	nzcv, x0
	PT_REGS_LOAD
.endm

/* x0..x30 from pt_regs at sp. */
.macro PT_REGS_LOAD
	ldp	x0, x1, [sp, #PT_X0]
	ldp	x2, x3, [sp, #PT_X2]
	ldp	x4, x5, [sp, #PT_X4]
	ldp	x6, x7, [sp, #PT_X6]
	ldp	x8, x9, [sp, #PT_X8]
	ldp	x10, x11, [sp, #PT_X10]
	ldp	x12, x13, [sp, #PT_X12]
	ldp	x14, x15, [sp, #PT_X14]
	ldp	x16, x17, [sp, #PT_X16]
	ldp	x18, x19, [sp, #PT_X18]
	ldp	x20, x21, [sp, #PT_X20]
	ldp	x22, x23, [sp, #PT_X22]
	ldp	x24, x25, [sp, #PT_X24]
	ldp	x26, x27, [sp, #PT_X26]
	ldp	x28, x29, [sp, #PT_X28]
	ldr	x30, [sp, #PT_LR]
.endm
