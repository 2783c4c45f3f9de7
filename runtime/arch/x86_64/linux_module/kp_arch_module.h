/*
 * A kernel module on x86-64, for the linux_module platform (its kp_platform.h
 * includes this): what the module's trace events read of the CPU, through the
 * kernel's exported per-CPU symbols (their CRCs from the kernel's Module.symvers).
 */
#ifndef _KP_ARCH_MODULE_H
#define _KP_ARCH_MODULE_H

/* `current` as x86-64 reads it before 6.2: the per-CPU current_task (exported per CPU;
 * 6.2 moved it into pcpu_hot). */
extern void *current_task;

static inline __attribute__((always_inline)) void *kp_arch_module_current(void)
{
	void *t;
	__asm__ volatile("movq %%gs:current_task, %0" : "=r"(t));
	return t;
}

/* this_cpu_read(this_cpu_off): the running CPU's per-CPU offset (exported per CPU). */
extern unsigned long this_cpu_off;

static inline __attribute__((always_inline)) unsigned long kp_arch_module_this_cpu_off(void)
{
	unsigned long off;
	__asm__ volatile("movq %%gs:this_cpu_off, %0" : "=r"(off));
	return off;
}

/* The module's dispatch's view of a struct pt_regs (kp_module_runtime.c): the instruction and stack
 * pointers, and the probed address a hit reports (regs->ip is past the int3, as the kernel's). */
#define KP_REGS_IP(regs) ((regs)->ip)
#define KP_REGS_SP(regs) ((regs)->sp)
#define KP_HIT_ADDR(regs) ((regs)->ip - 1)
/* A kretprobe's return address at entry (on the stack, at sp), and the key that finds its instance
 * again at return (that slot's address: sp - 8 once returned). */
#define KP_KRET_RET_SLOT(regs) ((unsigned long *)KP_REGS_SP(regs))
#define KP_KRET_ENTRY_FP(regs, slot) (slot)
#define KP_KRET_RETURN_FP(regs) ((void *)(KP_REGS_SP(regs) - 8))

/* How the dispatch (kp_module_runtime.c's KP_KPROBE) runs a breakpoint's and an ftrace site's
 * pre_handler and post_handler: regs->ip one past the int3, five past the ftrace call. */
/* kprobe_int3_handler(): a pre_handler that returned 1 and moved regs->ip resumes there (no
 * copy, no post_handler); else the slot runs the instruction, and a post_handler runs at the
 * trap after it (kp_post_N()). */
#define KP_RUN_INT3(pre) if (pre(p, regs) && KP_REGS_IP(regs) != (unsigned long)p->addr + 1) { r = KP_REGS_IP(regs); goto out; }
/* kprobe_ftrace_handler(): a pre_handler that returned 1 chose where to resume; else the
 * post_handler runs with regs->ip past the call. */
#define KP_RUN_FTRACE(pre, post)						\
	pre									\
	KP_REGS_IP(regs) = (unsigned long)p->addr + 5;			\
	post									\
	KP_REGS_IP(regs) = (unsigned long)p->addr + 1;
#define KP_FTRACE_PRE(pre) if (pre(p, regs)) { r = KP_REGS_IP(regs); goto out; }
#define KP_FTRACE_POST(post) post(p, regs, 0);

#endif
