/* The handlers of benchmarks/kernel_arm64_probes.py's probes (Debian's arm64 kernel): each
 * counts its hits in a static variable, as bench_kprobe.c's do (like for like with the
 * kernel's own kprobe from a module); bench_report(), on __arm64_sys_sync, prints the counts
 * (the probes' own counts are in debugfs kprewrite/profile too, which the benchmark does not read). */
#include <linux/kprobes.h>

static unsigned long entry_hits, inside_hits, ret_hits, reto_hits;

int bench_entry(struct kprobe *p, struct pt_regs *regs)
{
	entry_hits++;
	return 0;
}

int bench_inside(struct kprobe *p, struct pt_regs *regs)
{
	inside_hits++;
	return 0;
}

int bench_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	ret_hits++;
	return 0;
}

int bench_reto_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	return 0;
}

int bench_reto(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	reto_hits++;
	return 0;
}

int bench_report(struct kprobe *p, struct pt_regs *regs)
{
	pr_info("kprewrite-bench: hits entry %lu inside %lu ret %lu reto %lu\n", entry_hits, inside_hits, ret_hits,
		reto_hits);
	return 0;
}
