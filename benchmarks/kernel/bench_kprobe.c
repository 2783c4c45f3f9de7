/* The running kernel's own kprobe with an empty pre_handler, as a kernel module: what
 * benchmarks/kernel_probes.py compares our probes with, like for like (register_kprobe(), no
 * tracefs event, no BPF).  Built against Debian's linux-headers package of the same kernel.
 *
 *   insmod bench_kprobe.ko symbol=__do_sys_getgid offset=14
 *
 * The handler counts its hits (ours count theirs too), printed with nmissed at rmmod. */
#include <linux/kprobes.h>
#include <linux/module.h>

static char *symbol = "__do_sys_getgid";
static uint offset;
module_param(symbol, charp, 0444);
module_param(offset, uint, 0444);

static unsigned long hits;

static int bench_pre(struct kprobe *p, struct pt_regs *regs)
{
	hits++;
	return 0;
}

static struct kprobe kp = { .pre_handler = bench_pre };

static int __init bench_init(void)
{
	int ret;

	kp.symbol_name = symbol;
	kp.offset = offset;
	ret = register_kprobe(&kp);
	if (ret < 0)
		pr_err("bench_kprobe: register_kprobe %s+%#x: %d\n", symbol, offset, ret);
	return ret;
}

static void __exit bench_exit(void)
{
	unregister_kprobe(&kp);
	pr_info("bench_kprobe: %s+%#x hits %lu nmissed %lu\n", symbol, offset, hits, kp.nmissed);
}

module_init(bench_init);
module_exit(bench_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("kprewrite benchmark: an empty kprobe pre_handler");
