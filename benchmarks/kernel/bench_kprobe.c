/* The running kernel's own kprobe with an empty pre_handler, as a kernel module: what
 * benchmarks/kernel_probes.py compares our probes with, like for like (register_kprobe(), no
 * tracefs event, no BPF).  Built against Debian's linux-headers package of the same kernel.
 *
 *   insmod bench_kprobe.ko symbol=__do_sys_getgid offset=14
 *   insmod bench_kprobe.ko symbol=__do_sys_getgid kret=1    (register_kretprobe(), empty handler)
 *   insmod bench_kprobe.ko symbol=__do_sys_getgid kret=2    (empty entry_handler and handler)
 *
 * The handler counts its hits (ours count theirs too), printed with nmissed at rmmod. */
#include <linux/kprobes.h>
#include <linux/module.h>

static char *symbol = "__do_sys_getgid";
static uint offset;
static uint kret;
module_param(symbol, charp, 0444);
module_param(offset, uint, 0444);
module_param(kret, uint, 0444);

static unsigned long hits;

static int bench_pre(struct kprobe *p, struct pt_regs *regs)
{
	hits++;
	return 0;
}

static struct kprobe kp = { .pre_handler = bench_pre };

static int bench_ret(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	hits++;
	return 0;
}

static int bench_ret_entry(struct kretprobe_instance *ri, struct pt_regs *regs)
{
	return 0;
}

static struct kretprobe rp = { .handler = bench_ret };

static int __init bench_init(void)
{
	int ret;

	if (kret) {
		rp.kp.symbol_name = symbol;
		if (kret == 2)
			rp.entry_handler = bench_ret_entry;
		ret = register_kretprobe(&rp);
		if (ret < 0)
			pr_err("bench_kprobe: register_kretprobe %s: %d\n", symbol, ret);
		return ret;
	}
	kp.symbol_name = symbol;
	kp.offset = offset;
	ret = register_kprobe(&kp);
	if (ret < 0)
		pr_err("bench_kprobe: register_kprobe %s+%#x: %d\n", symbol, offset, ret);
	return ret;
}

static void __exit bench_exit(void)
{
	if (kret) {
		unregister_kretprobe(&rp);
		pr_info("bench_kprobe: %s+%#x hits %lu nmissed %lu\n", symbol, 0, hits, rp.nmissed + rp.kp.nmissed);
		return;
	}
	unregister_kprobe(&kp);
	pr_info("bench_kprobe: %s+%#x hits %lu nmissed %lu\n", symbol, offset, hits, kp.nmissed);
}

module_init(bench_init);
module_exit(bench_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("kprewrite benchmark: an empty kprobe pre_handler");
