/*
 * A Linux kernel image on arm64, for the linux_kernel platform (its kp_platform.h
 * includes this).  On arm64 the runtime is not linked into the Image: the parts of it an
 * arm64 Image has (the debugfs views, kp_debugfs.c) are a blob placed in module memory at
 * boot and called from the Image's own code (rewriter/targets/linux_kernel/aarch64/
 * runtime.py).  It is only ever called in process context with interrupts on (the hooks
 * unmask them first), and the arm64 dispatch keys a task's nesting on the task (sp_el0),
 * not on the CPU: the dispatch's preemption bracket is empty here.
 *
 * Everything here is inlined (always_inline).
 */
#ifndef _KP_ARCH_PLATFORM_H
#define _KP_ARCH_PLATFORM_H

#define KP_ARCH_INLINE static inline __attribute__((always_inline))

#define KP_ARCH_PAGE_SHIFT 12	/* Debian's arm64 kernel: 4 KiB pages */

/* --- the CPU: MPIDR's affinity is not the kernel's CPU number; the per-CPU offset
 * is in TPIDR_EL1 (this_cpu_off), cpu_number a per-CPU variable --- */

KP_ARCH_INLINE unsigned long kp_arch_this_cpu_off(void)
{
	unsigned long off;
	__asm__ volatile("mrs %0, tpidr_el1" : "=r"(off));
	return off;
}

#ifdef KP_PLACED_AT_BOOT
/* kallsyms names no cpu_number (no KALLSYMS_ALL): the current task's cpu (arm64's
 * thread_info.cpu, THREAD_INFO_IN_TASK: inside task_struct, at the offset BTF gives:
 * runtime.py's glue), the running CPU's while the task runs with interrupts off. */
extern const long kp_kernel_task_cpu;
char *kp_kernel_current(void);

KP_ARCH_INLINE unsigned int kp_arch_smp_processor_id(void)
{
	return kp_kernel_task_cpu < 0 ? 0 : *(unsigned int *)(kp_kernel_current() + kp_kernel_task_cpu);
}
#else
extern int cpu_number;

KP_ARCH_INLINE unsigned int kp_arch_smp_processor_id(void)
{
	return *(int *)((char *)&cpu_number + kp_arch_this_cpu_off());
}
#endif

KP_ARCH_INLINE unsigned long kp_arch_cpu_index(void)
{
	return kp_arch_smp_processor_id();
}

/* --- preemption: nothing to do (above) --- */

KP_ARCH_INLINE void kp_arch_preempt_disable(void)
{
	__asm__ volatile("" ::: "memory");
}

KP_ARCH_INLINE void kp_arch_preempt_enable(void)
{
	__asm__ volatile("" ::: "memory");
}

/* --- interrupts: PSTATE.DAIF's I bit --- */

#define KP_ARCH_DAIF_I 0x80UL

KP_ARCH_INLINE unsigned long kp_arch_local_save_flags(void)
{
	unsigned long flags;
	__asm__ volatile("mrs %0, daif" : "=r"(flags));
	return flags;
}

#define kp_arch_irqs_disabled_flags(flags) (((flags) & KP_ARCH_DAIF_I) ? 1 : 0)

KP_ARCH_INLINE unsigned long kp_arch_local_irq_save(void)
{
	unsigned long flags;
	__asm__ volatile("mrs %0, daif\n\tmsr daifset, #3" : "=r"(flags) :: "memory");
	return flags;
}

KP_ARCH_INLINE void kp_arch_local_irq_restore(unsigned long flags)
{
	__asm__ volatile("msr daif, %0" :: "r"(flags) : "memory");
}

KP_ARCH_INLINE void kp_arch_spin_relax(void)
{
	__asm__ volatile("yield" ::: "memory");
}

/* --- a function's arguments on its entry's struct pt_regs (lvalues) --- */

#define kp_arch_arg0(regs) ((regs)->regs[0])
#define kp_arch_arg1(regs) ((regs)->regs[1])
#define kp_arch_arg2(regs) ((regs)->regs[2])

#endif
