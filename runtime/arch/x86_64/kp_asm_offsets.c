/*
 * x86-64 layouts that code written outside C reads: struct pt_regs, as the
 * .S entries build it (kp_regs.h, through the generated kp_asm_offsets.h) and
 * as kprewrite's templates and fetch programs address it (rewriter/link/runtime.py
 * turns this file into both; the kernel's asm-offsets_64.c).
 */
#include "kp_internal.h"
#include "kp_kbuild.h"

void kp_asm_offsets(void)
{
	OFFSET(PT_R15, pt_regs, r15);
	OFFSET(PT_R14, pt_regs, r14);
	OFFSET(PT_R13, pt_regs, r13);
	OFFSET(PT_R12, pt_regs, r12);
	OFFSET(PT_BP, pt_regs, bp);
	OFFSET(PT_BX, pt_regs, bx);
	OFFSET(PT_R11, pt_regs, r11);
	OFFSET(PT_R10, pt_regs, r10);
	OFFSET(PT_R9, pt_regs, r9);
	OFFSET(PT_R8, pt_regs, r8);
	OFFSET(PT_AX, pt_regs, ax);
	OFFSET(PT_CX, pt_regs, cx);
	OFFSET(PT_DX, pt_regs, dx);
	OFFSET(PT_SI, pt_regs, si);
	OFFSET(PT_DI, pt_regs, di);
	OFFSET(PT_ORIG_AX, pt_regs, orig_ax);
	OFFSET(PT_IP, pt_regs, ip);
	OFFSET(PT_CS, pt_regs, cs);
	OFFSET(PT_FLAGS, pt_regs, flags);
	OFFSET(PT_SP, pt_regs, sp);
	OFFSET(PT_SS, pt_regs, ss);
	DEFINE(PT_SIZE, sizeof(struct pt_regs));
	DEFINE(ARITH_FLAGS, KP_ARITH_FLAGS);
}
