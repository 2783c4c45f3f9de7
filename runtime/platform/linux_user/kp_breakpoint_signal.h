/*
 * A breakpoint probe's SIGTRAP in a Linux user process, whatever the CPU: the signal's
 * machine context converted to struct pt_regs for the trap handler
 * (kp_arch_breakpoint_regs(): kp_breakpoint.h's) and the probes' handlers, and written
 * back afterwards, so whatever a handler changes takes effect when the kernel's
 * rt_sigreturn restores it.
 *
 * Included last by the arch's SIGTRAP file (rewriter/arch/<arch>/toolchain.py's
 * RUNTIME_FILES["breakpoint_signal"]: x86-64's linux_user/kp_int3_signal.c, AArch64's
 * linux_user/kp_brk_signal.c), after the arch's trap file and its hooks on Linux's
 * ucontext_t on that CPU: kp_uc_to_regs(), kp_regs_to_uc() and KP_SIGTRAP_SS_TRAP (the
 * trap handler's ss_trap: whether a user process's single-stepped copies end with a
 * breakpoint).
 */
#ifndef _KP_BREAKPOINT_SIGNAL_H
#define _KP_BREAKPOINT_SIGNAL_H
#include "kp_signal.h"

/*
 * A SIGTRAP raised by the CPU (not sent by kill, kp_sigtrap()).  Ours if it is at
 * (or after) one of our breakpoints, or ends one of our single-stepped copies; 0
 * otherwise (the platform layer passes it on to whoever else handles SIGTRAP).
 */
int kp_breakpoint_sigtrap(void *uc)
{
	struct pt_regs regs;
	kp_uc_to_regs(uc, &regs);
	if (!kp_arch_breakpoint_regs(&regs, KP_SIGTRAP_SS_TRAP))
		return 0;
	kp_regs_to_uc(&regs, uc);
	return 1;
}

#endif
