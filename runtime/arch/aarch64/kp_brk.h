/*
 * AArch64 breakpoint-site descriptors, as kprewrite's back end generates them
 * (rewriter/arch/aarch64/kprobe_xol.py, table_c()) and the brk trap handler
 * reads them (kp_int3.c).  One per site, addresses link-time (the handler
 * subtracts kp_rt.bias).
 */
#ifndef _KP_BRK_H
#define _KP_BRK_H
#pragma GCC visibility push(hidden)

/* The kernel's arch/arm64/include/asm/brk-imm.h. */
#define KPROBES_BRK_IMM		0x004
#define KPROBES_BRK_SS_IMM	0x006

struct kp_int3_site {
	unsigned long addr;		/* the probed instruction, now brk #0x004 */
	unsigned long slot;		/* single-step: the out-of-line copy */
	unsigned long ss_end;		/* single-step: the brk #0x006 after the copy */
	unsigned long target;		/* simulate: the PC-relative address */
	unsigned int site;		/* kp_sites[] index */
	unsigned char mode;		/* KP_XOL_* */
	unsigned char kind;		/* simulate: KP_SIM_* */
	unsigned char rt;		/* simulate: the register */
	unsigned char cond;		/* b.cond: condition; cbnz/tbnz: 1 */
	unsigned char sf;		/* cbz: 64-bit; ldr literal: 8 bytes */
	unsigned char bit;		/* tbz: the tested bit */
	unsigned char kret;		/* a kretprobe return hook at this exit: KP_KRET_HOOK_* (0 none) */
	unsigned char post;		/* a probe of the site has a post_handler */
	unsigned char pad[20];		/* 64 bytes */
};
#ifndef KP_XOL_EMULATE
#define KP_XOL_EMULATE 1
#define KP_XOL_SINGLESTEP 3
#endif
/* Simulated kinds (kprobe_xol.KIND): simulate-insn.c's functions. */
enum { KP_SIM_B = 1, KP_SIM_BL, KP_SIM_BCOND, KP_SIM_CBZ, KP_SIM_TBZ, KP_SIM_ADR, KP_SIM_LDR_LIT,
       KP_SIM_LDRSW_LIT, KP_SIM_BR, KP_SIM_BLR, KP_SIM_RET };

extern struct kp_int3_site kp_int3_sites[];
extern const unsigned int kp_nint3;
extern const unsigned int kp_int3_hash_shift, kp_int3_hash_mask;
extern const unsigned int kp_int3_hash[];
extern const unsigned int kp_int3_ss[];	/* single-step entries, by ss_end */
extern const unsigned int kp_nint3_ss;

#pragma GCC visibility pop
#endif
