/*
 * The layouts of the core's structures that code written outside C reads:
 * kprewrite's inlined templates (rewriter/arch/<arch>/emit.py, retprobe.py)
 * read these as Python constants, made from this file by rewriter/link/runtime.py
 * (the kernel's asm-offsets.c).  The arch's own are in its kp_asm_offsets.c.
 */
#include "kp_internal.h"
#include "kp_kbuild.h"

void kp_asm_offsets(void)
{
	DEFINE(KPROBE_SIZE, sizeof(struct kprobe));
	OFFSET(KPROBE_FLAGS, kprobe, flags);
	DEFINE(KRETPROBE_SIZE, sizeof(struct kretprobe));

	OFFSET(THREAD_ACTIVE, kp_thread, active);
	OFFSET(THREAD_HITS, kp_thread, hits);
	OFFSET(THREAD_KRET, kp_thread, kret);
	DEFINE(THREAD_TABLE_MASK, KP_TABLE_MASK);
	DEFINE(LIGHT_SHARDS, KP_LIGHT_SHARDS);

	OFFSET(KRET_DEPTH, kp_kret_thread, depth);
	OFFSET(KRET_TAIL_SLOT, kp_kret_thread, tail_slot);
	OFFSET(KRET_NORPHANS, kp_kret_thread, norphans);
	OFFSET(KRET_STACK, kp_kret_thread, stack);

	OFFSET(RP_MAXACTIVE, kretprobe, maxactive);
	OFFSET(RP_STRIDE, kretprobe, kp_stride);
	OFFSET(RP_POOL, kretprobe, kp_pool);
	OFFSET(RP_HINT, kretprobe, kp_hint);

	OFFSET(RI_RP, kretprobe_instance, rp);
	OFFSET(RI_RET_ADDR, kretprobe_instance, ret_addr);
	OFFSET(RI_FP, kretprobe_instance, fp);
	OFFSET(RI_STATE, kretprobe_instance, kp_state);
	OFFSET(RI_FLAGS, kretprobe_instance, kp_flags);
	DEFINE(RI_TRAMP, KP_RI_TRAMP);
	DEFINE(RI_PENDING, KP_RI_PENDING);
	DEFINE(KRET_HANDLER_REC_SIZE, sizeof(struct kp_kret_handler_rec));

	/* A kernel's KASLR table gets an entry for kp_rt.bias (targets/linux_kernel/x86_64/kaslr.py). */
	OFFSET(RT_BIAS, kp_runtime, bias);
}
