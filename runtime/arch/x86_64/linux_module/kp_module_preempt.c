/*
 * Handlers run as the kernel's kprobe handlers do (kprobe_ftrace_handler()), with the kernel's CRCs at hand
 * (Module.symvers): preemption disabled, and a hit while a handler of this module runs on the CPU
 * (kprobe_running()) missed.  Included by kp_module_runtime.c with KP_MODULE_CRCS (KP_RESCHED: the
 * kernel's way to reschedule, writer.py's _preempt_c()).
 */

extern int __preempt_count;		/* per CPU */
extern int cpu_number;			/* per CPU */
/* Whether a handler runs on a CPU; CPUs past the array are not checked. */
#define KP_NR_ACTIVE 1024
static unsigned char kp_active[KP_NR_ACTIVE];

/* preempt_disable(), then kprobe_running() on this CPU: 0 when a handler of ours runs. */
static inline int kp_enter(void)
{
	int cpu;
	__asm__ volatile("incl %%gs:__preempt_count" ::: "memory", "cc");
	__asm__ volatile("movl %%gs:cpu_number, %0" : "=r"(cpu));
	if ((unsigned int)cpu >= KP_NR_ACTIVE)
		return 1;
	if (kp_active[cpu]) {
		__asm__ volatile("decl %%gs:__preempt_count" ::: "memory", "cc");
		return 0;
	}
	kp_active[cpu] = 1;
	return 1;
}

/* preempt_enable(): a pending reschedule taken as the kernel's __preempt_schedule() takes it
 * (KP_RESCHED: the preempt_schedule static call, or preempt_schedule_thunk; either keeps
 * every register; none without CONFIG_PREEMPTION). */
static inline void kp_leave(void)
{
	int cpu;
	register unsigned long sp __asm__("rsp");
	__asm__ volatile("movl %%gs:cpu_number, %0" : "=r"(cpu));
	if ((unsigned int)cpu < KP_NR_ACTIVE)
		kp_active[cpu] = 0;
#ifdef KP_RESCHED
	__asm__ volatile("decl %%gs:__preempt_count\n\tjnz 1f\n\tcall " KP_RESCHED "\n1:"
			 : "+r"(sp) :: "memory", "cc");
#else
	__asm__ volatile("decl %%gs:__preempt_count" ::: "memory", "cc");
#endif
}
