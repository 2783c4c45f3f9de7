/*
 * Stacks through probes in a kernel (docs/kernel.md, "Stacks through probes").
 *
 * The kernel's ORC unwinder finds no entry for an address in the text/rodata
 * gap (orc_find(): the fast table covers _stext.._etext, then .init.text,
 * modules and ftrace trampolines), so it takes our code as generated code with a
 * frame pointer, as it does BPF's (orc_fp_entry).  Two things make that hold:
 *
 * - every frame of ours keeps an %rbp chain: the runtime and handlers are
 *   compiled with -fno-omit-frame-pointer (recipe.py), and the asm entries point
 *   %rbp at a frame record below the hit's stack pointer whose return address is
 *   the hit + 1 (KP_UNWIND_FRAME, the arch's kp_platform_asm.h, reads it from kp_site_recs[]);
 *   the probed function's own ORC entry takes over from there;
 * - our code counts as kernel text: the stack printer (show_trace_log_lvl())
 *   steps the unwinder only at a stack word that __kernel_text_address() accepts,
 *   and stack_trace_save() stops at the first address it refuses.  The code is
 *   registered as the kernel registers a BPF image (bpf_ksym_add(), a struct
 *   bpf_ksym named "kprewrite": is_bpf_text_address(), /proc/kallsyms lists it).
 */
#include "kp_internal.h"

extern char __kp_rela_end[];
/* struct bpf_ksym (BTF, rewriter/targets/linux_kernel/unwind.py): [offsetof lnode, sizeof],
 * and the kernel's bpf_ksym_add(); -1 and NULL when the image lacks them (then no
 * registration: stacks stop at our first frame). */
extern const long kp_kernel_bpf_ksym[2];
extern void (*const kp_kernel_bpf_ksym_add)(void *);

/* The entries' frame records read kp_site_recs[SITE].addr and .insn_len (the arch's
 * KP_UNWIND_FRAME, linux_kernel/kp_platform_asm.h: 16-byte records, KP_SITE_REC_LEN). */
_Static_assert(sizeof(struct kp_site_rec) == 16 && __builtin_offsetof(struct kp_site_rec, addr) == 0
	       && __builtin_offsetof(struct kp_site_rec, insn_len) == 12, "KP_UNWIND_FRAME's kp_site_recs[] layout");

/* Two struct bpf_ksym: the code before the kretprobe trampoline's first byte and
 * the code after it.  That address is what a swapped return-address slot holds while
 * the function runs; left out, it is no kernel text, so a stack trace of a task
 * inside such a function ends there as it did (the kernel's unwinder recovers only
 * its own trampoline's real return address), instead of stepping through it by a
 * frame pointer the function never set.  The trampoline's call is after it: a
 * handler's stack goes on through the record it keeps (kretprobe_entry.S). */
extern char kp_kretprobe_trampoline[];
static unsigned long kp_kernel_ksyms[2][1024 / sizeof(unsigned long)];

static void kp_kernel_ksym_add(unsigned long *ksym, unsigned long start, unsigned long end)
{
	char *k = (char *)ksym;
	ksym[0] = start;
	ksym[1] = end;
	__builtin_memcpy(k + 16, "kprewrite", 10);		/* name[KSYM_NAME_LEN] */
	void **head = (void **)(k + kp_kernel_bpf_ksym[0]);	/* INIT_LIST_HEAD(&lnode) */
	head[0] = head;
	head[1] = head;
	kp_kernel_bpf_ksym_add(k);
}

/* At the setup_per_cpu_areas() boot hook (platform.c), when the probes start firing. */
void kp_kernel_unwind_init(void)
{
	if (!kp_kernel_bpf_ksym_add || kp_kernel_bpf_ksym[0] < 0
	    || kp_kernel_bpf_ksym[1] > (long)sizeof(kp_kernel_ksyms[0]))
		return;
	unsigned long tramp = (unsigned long)kp_kretprobe_trampoline;
	kp_kernel_ksym_add(kp_kernel_ksyms[0], kp_kernel_gap_start, tramp);
	kp_kernel_ksym_add(kp_kernel_ksyms[1], tramp + 1, (unsigned long)__kp_rela_end);
}
