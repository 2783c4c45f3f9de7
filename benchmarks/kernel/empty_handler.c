/* The handler of benchmarks/kernel_probes.py's probes: written as for a kernel module, and
 * empty, so a hit costs what the probe mechanism itself costs (detour, registers saved into a
 * struct pt_regs, dispatch with preemption disabled, reentrancy check, hit counter). */
#include <linux/kprobes.h>

static int bench_empty(struct kprobe *p, struct pt_regs *regs)
{
	return 0;
}

/* The kretprobes' (--kret): an empty handler, and an empty entry_handler. */
static int bench_ret_empty(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	return 0;
}
