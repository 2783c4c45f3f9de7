/*
 * What the AArch64 brk trap handler (kp_brk.c) and the tables kprewrite's
 * back end generates (rewriter/emit/breakpoints.py with rewriter/arch/aarch64/kprobe_xol.py's rows) share
 * beyond struct kp_breakpoint_site (kp_arch.h): the simulated kinds, the hash of the
 * descriptors by address and the single-step entries.
 */
#ifndef _KP_BRK_H
#define _KP_BRK_H
#pragma GCC visibility push(hidden)

/* Simulated kinds (kprobe_xol.KIND): simulate-insn.c's functions. */
enum { KP_SIM_B = 1, KP_SIM_BL, KP_SIM_BCOND, KP_SIM_CBZ, KP_SIM_TBZ, KP_SIM_ADR, KP_SIM_LDR_LIT,
       KP_SIM_LDRSW_LIT, KP_SIM_BR, KP_SIM_BLR, KP_SIM_RET };

/* The descriptors' hash and single-step entries: kp_breakpoint.h. */

#pragma GCC visibility pop
#endif
