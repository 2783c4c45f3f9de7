/*
 * x86-64 breakpoint probes in a Linux user process: the hooks of the platform's
 * SIGTRAP glue (kp_breakpoint_signal.h, included last) on the SIGTRAP's machine
 * context (ucontext_t.uc_mcontext.gregs), copied into struct pt_regs for
 * kp_arch_breakpoint_regs() and the handlers, and written back afterwards.
 *
 * A user-process fact: the linux_user recipe compiles this file in place of the
 * arch's kp_int3.c, which it includes first (one unit, as before the two were
 * apart: the user runtime's code keeps its layout); a kernel compiles kp_int3.c
 * alone.
 */
#include <kp_int3.c>

/* A Linux user signal frame: ucontext_t's layout (KP_UC_GREGS, G_*) is Linux's
 * ABI on x86-64. */
#include <kp_uapi.h>

/* The restorer our SIGTRAP handler returns through (SA_RESTORER) is
 * kp_arch_sigreturn, in sigreturn.S. */

/* A user process single-steps a copy with TF: the trap is after the copy, not at an int3. */
#define KP_SIGTRAP_SS_TRAP 0

static void kp_uc_to_regs(const void *uc, struct pt_regs *r)
{
	const unsigned long *g = (const unsigned long *)((const char *)uc + KP_UC_GREGS);
	r->r15 = g[G_R15]; r->r14 = g[G_R14]; r->r13 = g[G_R13]; r->r12 = g[G_R12];
	r->bp = g[G_RBP]; r->bx = g[G_RBX]; r->r11 = g[G_R11]; r->r10 = g[G_R10];
	r->r9 = g[G_R9]; r->r8 = g[G_R8]; r->ax = g[G_RAX]; r->cx = g[G_RCX];
	r->dx = g[G_RDX]; r->si = g[G_RSI]; r->di = g[G_RDI];
	r->orig_ax = -1UL;
	r->ip = g[G_RIP];
	r->cs = g[G_CSGSFS] & 0xffff;
	r->flags = g[G_EFL];
	r->sp = g[G_RSP];
	r->ss = KP_USER_DS;
}

static void kp_regs_to_uc(const struct pt_regs *r, void *uc)
{
	unsigned long *g = (unsigned long *)((char *)uc + KP_UC_GREGS);
	g[G_R15] = r->r15; g[G_R14] = r->r14; g[G_R13] = r->r13; g[G_R12] = r->r12;
	g[G_RBP] = r->bp; g[G_RBX] = r->bx; g[G_R11] = r->r11; g[G_R10] = r->r10;
	g[G_R9] = r->r9; g[G_R8] = r->r8; g[G_RAX] = r->ax; g[G_RCX] = r->cx;
	g[G_RDX] = r->dx; g[G_RSI] = r->si; g[G_RDI] = r->di;
	g[G_RIP] = kp_region_ip(r->ip);		/* a handler may move ip under a shared region's jump */
	g[G_EFL] = r->flags;	/* the kernel keeps only the user-changeable bits */
	g[G_RSP] = r->sp;
}

#include <kp_breakpoint_signal.h>
