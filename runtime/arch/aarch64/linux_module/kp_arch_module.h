/*
 * A kernel module on arm64, for the linux_module platform (its kp_platform.h includes this): what the
 * module's runtime reads of the CPU.
 */
#ifndef _KP_ARCH_MODULE_H
#define _KP_ARCH_MODULE_H

/* `current`: arm64 keeps the task in sp_el0 (get_current()). */
static inline __attribute__((always_inline)) void *kp_arch_module_current(void)
{
	void *t;
	__asm__ volatile("mrs %0, sp_el0" : "=r"(t));
	return t;
}

/* __my_cpu_offset: tpidr_el1 (a kernel at EL2, VHE, keeps it in tpidr_el2: not read here). */
static inline __attribute__((always_inline)) unsigned long kp_arch_module_this_cpu_off(void)
{
	unsigned long off;
	__asm__ volatile("mrs %0, tpidr_el1" : "=r"(off));
	return off;
}

/* The module's dispatch's view of a struct pt_regs (kp_module_runtime.c): the instruction and stack
 * pointers, and the probed address a hit reports (regs->pc: the detour sets it to the probe's address). */
#define KP_REGS_IP(regs) ((regs)->pc)
#define KP_REGS_SP(regs) ((regs)->sp)
#define KP_HIT_ADDR(regs) ((regs)->pc)
/* A kretprobe's return address at entry (x30: the detour runs before the function's paciasp signs it,
 * as arch_prepare_kretprobe() swaps it), and the key that finds its instance again at return: sp, the
 * same at the function's entry and after its ret. */
#define KP_KRET_RET_SLOT(regs) (&(regs)->regs[30])
#define KP_KRET_ENTRY_FP(regs, slot) ((void *)(regs)->sp)
#define KP_KRET_RETURN_FP(regs) ((void *)(regs)->sp)

#endif
