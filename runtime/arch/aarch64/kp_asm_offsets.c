/*
 * AArch64 layouts that code written outside C reads: struct pt_regs, as the
 * .S entries build it (kp_regs.h, through the generated kp_asm_offsets.h) and
 * as kprewrite's templates and fetch programs address it (rewriter/link/runtime.py
 * turns this file into both; the kernel's arch/arm64/kernel/asm-offsets.c,
 * whose S_X0.. names these follow as PT_X0..).
 */
#include "kp_internal.h"
#include "kp_kbuild.h"

void kp_asm_offsets(void)
{
	OFFSET(PT_X0, pt_regs, regs[0]);
	OFFSET(PT_X1, pt_regs, regs[1]);
	OFFSET(PT_X2, pt_regs, regs[2]);
	OFFSET(PT_X3, pt_regs, regs[3]);
	OFFSET(PT_X4, pt_regs, regs[4]);
	OFFSET(PT_X5, pt_regs, regs[5]);
	OFFSET(PT_X6, pt_regs, regs[6]);
	OFFSET(PT_X7, pt_regs, regs[7]);
	OFFSET(PT_X8, pt_regs, regs[8]);
	OFFSET(PT_X9, pt_regs, regs[9]);
	OFFSET(PT_X10, pt_regs, regs[10]);
	OFFSET(PT_X11, pt_regs, regs[11]);
	OFFSET(PT_X12, pt_regs, regs[12]);
	OFFSET(PT_X13, pt_regs, regs[13]);
	OFFSET(PT_X14, pt_regs, regs[14]);
	OFFSET(PT_X15, pt_regs, regs[15]);
	OFFSET(PT_X16, pt_regs, regs[16]);
	OFFSET(PT_X17, pt_regs, regs[17]);
	OFFSET(PT_X18, pt_regs, regs[18]);
	OFFSET(PT_X19, pt_regs, regs[19]);
	OFFSET(PT_X20, pt_regs, regs[20]);
	OFFSET(PT_X21, pt_regs, regs[21]);
	OFFSET(PT_X22, pt_regs, regs[22]);
	OFFSET(PT_X23, pt_regs, regs[23]);
	OFFSET(PT_X24, pt_regs, regs[24]);
	OFFSET(PT_X25, pt_regs, regs[25]);
	OFFSET(PT_X26, pt_regs, regs[26]);
	OFFSET(PT_X27, pt_regs, regs[27]);
	OFFSET(PT_X28, pt_regs, regs[28]);
	OFFSET(PT_X29, pt_regs, regs[29]);
	OFFSET(PT_X30, pt_regs, regs[30]);
	OFFSET(PT_FP, pt_regs, regs[29]);
	OFFSET(PT_LR, pt_regs, regs[30]);
	OFFSET(PT_SP, pt_regs, sp);
	OFFSET(PT_PC, pt_regs, pc);
	OFFSET(PT_PSTATE, pt_regs, pstate);
	OFFSET(PT_ORIG_X0, pt_regs, orig_x0);
	OFFSET(PT_SYSCALLNO, pt_regs, syscallno);
	DEFINE(PT_SIZE, sizeof(struct pt_regs));
	DEFINE(ARITH_FLAGS, KP_ARITH_FLAGS);
	DEFINE(BREAKPOINT_SITE_SIZE, sizeof(struct kp_breakpoint_site));
}
