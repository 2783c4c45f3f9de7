/*
 * arm64: the post_handlers of a module's jump-optimized probes, called from the detour after the displaced
 * instruction's copy (kp_module_detours.S's opt_post), with regs->pc the address after it, as the kernel's
 * post_kprobe_handler() after its single-step.  Included after kp_module_runtime.c by the kp_module.c that
 * rewriter/targets/linux_module/aarch64/writer.py generates, whose KP_POSTS lists each site's
 * KP_POST_FUNC(n, KP_POST_CALL(i, handler)...).
 */

#define KP_POST_CALL(i, h)							\
	if (!(kp_probes[i].flags & KPROBE_FLAG_DISABLED))			\
		h(&kp_probes[i], regs, 0);
#define KP_POST_FUNC(n, calls)							\
void kp_post_##n(struct pt_regs *regs)						\
{										\
	if (!kp_armed || !kp_enter())						\
		return;								\
	calls									\
	kp_leave();								\
}
KP_POSTS
