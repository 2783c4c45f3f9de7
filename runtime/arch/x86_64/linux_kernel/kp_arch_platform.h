/*
 * A Linux kernel image on x86-64, for the linux_kernel platform (its
 * kp_platform.h includes this): per-CPU data through %gs, the preempt count,
 * EFLAGS.IF and cli/sti, and a function's arguments in the kernel's calling
 * convention, each as the kernel's arch/x86/include/asm has it (percpu.h,
 * preempt.h, irqflags.h, processor.h).  The #BP hook, its entry stub included,
 * is kp_int3_hook.c beside this.
 *
 * Everything here is inlined (always_inline): the platform's functions built
 * on it compile to the code they held before.
 */
#ifndef _KP_ARCH_PLATFORM_H
#define _KP_ARCH_PLATFORM_H

#define KP_ARCH_INLINE static inline __attribute__((always_inline))

#define KP_ARCH_PAGE_SHIFT 12	/* 4 KiB pages */

/* --- per-CPU data: its symbols are offsets from the CPU's %gs base --- */

extern unsigned long this_cpu_off;
extern int __preempt_count;
extern int cpu_number;

/* The running CPU's per-CPU offset (this_cpu_read(this_cpu_off)). */
KP_ARCH_INLINE unsigned long kp_arch_this_cpu_off(void)
{
	unsigned long off;
	__asm__ volatile("mov %%gs:this_cpu_off, %0" : "=r"(off));
	return off;
}

/* smp_processor_id() as an index (movl zero-extends). */
KP_ARCH_INLINE unsigned long kp_arch_cpu_index(void)
{
	unsigned long cpu;
	__asm__ volatile("movl %%gs:cpu_number, %k0" : "=r"(cpu));
	return cpu;
}

/* smp_processor_id(): this_cpu_read(cpu_number). */
KP_ARCH_INLINE unsigned int kp_arch_smp_processor_id(void)
{
	int cpu;
	__asm__ volatile("movl %%gs:cpu_number, %0" : "=r"(cpu));
	return cpu;
}

/* --- preemption: the per-CPU __preempt_count --- */

/* preempt_disable(). */
KP_ARCH_INLINE void kp_arch_preempt_disable(void)
{
	__asm__ volatile("incl %%gs:__preempt_count" ::: "memory", "cc");
}

/* preempt_enable(): a pending reschedule (the count reaching zero: x86 folds an
 * inverted PREEMPT_NEED_RESCHED into it) is taken as preempt_enable() takes it,
 * through kp_kernel_resched (the image's preempt_schedule thunk, which keeps
 * every register; the probe table defines it per image). */
void kp_kernel_resched(void);

KP_ARCH_INLINE void kp_arch_preempt_enable(void)
{
	register unsigned long sp __asm__("rsp");
	__asm__ volatile("decl %%gs:__preempt_count\n\tjnz 1f\n\tcall kp_kernel_resched\n1:"
			 : "+r"(sp) :: "memory", "cc");	/* "+r"(sp): ASM_CALL_CONSTRAINT */
}

/* --- interrupts: EFLAGS.IF --- */

#define KP_ARCH_FLAGS_IF 0x200UL	/* X86_EFLAGS_IF */

/* arch_local_save_flags(): EFLAGS. */
KP_ARCH_INLINE unsigned long kp_arch_local_save_flags(void)
{
	unsigned long flags;
	__asm__ volatile("pushfq; popq %0" : "=r"(flags));
	return flags;
}

/* arch_irqs_disabled_flags(). */
#define kp_arch_irqs_disabled_flags(flags) (((flags) & KP_ARCH_FLAGS_IF) ? 0 : 1)

/* arch_local_irq_save(): EFLAGS, then interrupts off. */
KP_ARCH_INLINE unsigned long kp_arch_local_irq_save(void)
{
	unsigned long flags;
	__asm__ volatile("pushfq; popq %0; cli" : "=r"(flags) :: "memory");
	return flags;
}

/* arch_local_irq_restore(): interrupts on again if they were (0: they were not). */
KP_ARCH_INLINE void kp_arch_local_irq_restore(unsigned long flags)
{
	if (flags & KP_ARCH_FLAGS_IF)
		__asm__ volatile("sti" ::: "memory");
}

/* A spin-wait iteration: cpu_relax(), a compiler barrier too. */
KP_ARCH_INLINE void kp_arch_spin_relax(void)
{
	__asm__ volatile("pause" ::: "memory");
}

/* --- a function's arguments on its entry's struct pt_regs (lvalues) --- */

#define kp_arch_arg0(regs) ((regs)->di)
#define kp_arch_arg1(regs) ((regs)->si)
#define kp_arch_arg2(regs) ((regs)->dx)

/* Stacks through probes (kp_platform_asm.h, KP_UNWIND_EXIT_FRAME): the return address
 * of the frame record a kretprobe's exit hook keeps below the return-address slot S,
 * and of the trampoline's, which is the slot itself (the real return address). */
static inline void kp_arch_unwind_exit_ip(unsigned long S, unsigned long ip)
{
	((unsigned long *)S)[-1] = ip;
}

static inline void kp_arch_unwind_trampoline_ip(unsigned long S, unsigned long ip)
{
	*(unsigned long *)S = ip;
}

#endif
