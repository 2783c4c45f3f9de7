/*
 * The debugfs views of a kernel's static probes, as the kernel's own
 * (kernel/kprobes.c, kernel/trace/trace_kprobe.c), under debugfs's kprewrite/:
 *
 *  - list     kprobes/list: address, type, symbol+offset, [DISABLED], and how
 *             the probe is placed ([OPTIMIZED] [FTRACE] [BOOSTED] [EMULATED]
 *             [SINGLESTEP]) as `kprewrite list` prints it;
 *  - enabled  kprobes/enabled: reads 1 or 0; writing 0 disarms every probe,
 *             1 arms them again (arm_all_kprobes()/disarm_all_kprobes());
 *  - profile  kprobe_profile: event, hits (summed over the CPUs), nmissed.
 *
 * Made by a boot hook on console_on_rootfs() (initcalls done, debugfs up,
 * /init not started yet), with the kernel's debugfs_create_dir() and
 * debugfs_create_file(); struct file_operations is laid out from the image's
 * BTF (kp_kernel_fops[], generated with the tables).
 *
 * Disarming marks every probe KPROBE_FLAG_GONE (kept apart from its own
 * KPROBE_FLAG_DISABLED, so arming again does not enable what the spec
 * disabled): the dispatch skips it without counting a hit, a breakpoint site
 * still runs its instruction out of line.  The runtime's own hooks (event
 * names kprewrite_*: the boot and shutdown hooks) stay armed, since the kernel's
 * W^X handling of our pages depends on them.  `kprewrite.enabled=0` on the
 * kernel command line disarms every probe from setup_arch() on (a boot hook on
 * parse_early_param()); the kernel ignores dotted parameters it does not know.
 */
#include "kp_internal.h"

struct dentry;
struct dentry *debugfs_create_dir(const char *name, struct dentry *parent);
struct dentry *debugfs_create_file(const char *name, unsigned short mode, struct dentry *parent, void *data,
				   const void *fops);
long simple_read_from_buffer(void *to, unsigned long count, long long *ppos, const void *from,
			     unsigned long available);
void *vmalloc(unsigned long size);
void vfree(const void *addr);
int kstrtoint_from_user(const char *s, unsigned long count, unsigned int base, int *res);
long long default_llseek(void *file, long long offset, int whence);
extern char boot_command_line[];
/* sizeof(struct file_operations), offsetof llseek, read, write; -1 without BTF. */
extern const long kp_kernel_fops[4];

#define KP_ENOMEM 12
#define KP_EINVAL 22

int kp_kernel_disarmed;		/* the probe-table build applies it too */

static int kp_runtime_hook(const struct kprobe *p)
{
	return p->name && !strncmp(p->name, "kprewrite_", 10);
}

static void kp_arm_one(struct kprobe *p, int on)
{
	if (kp_runtime_hook(p))
		return;
	if (on)
		__atomic_fetch_and(&p->flags, ~KPROBE_FLAG_GONE, __ATOMIC_RELAXED);
	else
		__atomic_fetch_or(&p->flags, KPROBE_FLAG_GONE, __ATOMIC_RELAXED);
}

/* Before the tables are built (kprewrite.enabled=0 is read in setup_arch()) only the
 * early structures exist: kp_kernel_build_tables() disarms the rest as it builds them. */
void kp_kernel_arm(int on)
{
	if (__atomic_load_n(&kp_tables_built, __ATOMIC_ACQUIRE))
		for (unsigned int i = 0; i < kp_nprobes; i++)
			kp_arm_one(&kp_probes[i], on);
	else
		for (unsigned int i = 0; i < kp_nearly_probes; i++)
			kp_arm_one(&kp_early_probes[i], on);
	for (unsigned int i = 0; i < kp_nkretprobes; i++)
		kp_arm_one(&kp_kretprobes[i].kp, on);
	__atomic_store_n(&kp_kernel_disarmed, !on, __ATOMIC_RELEASE);
}

/* parse_early_param(), in setup_arch(): kprewrite.enabled=0 (the last one given wins). */
int kp_kernel_cmdline(struct kprobe *p, struct pt_regs *regs)
{
	(void)p;
	(void)regs;
	static const char key[] = "kprewrite.enabled=";
	const char *c = boot_command_line;
	int on = -1;
	for (const char *s = c; *s; s++)
		if ((s == c || s[-1] == ' ') && !strncmp(s, key, sizeof(key) - 1))
			on = !(s[sizeof(key) - 1] == '0' && (s[sizeof(key)] == 0 || s[sizeof(key)] == ' '));
	if (on == 0) {
		kp_kernel_arm(0);
		_printk(KP_KERN_INFO "kprewrite: kprewrite.enabled=0: every probe disarmed\n");
	}
	return 0;
}

/* --- the files' text, made at each read ---------------------------------------------------- */

struct kp_text {
	char *buf;
	unsigned long len, cap;		/* cap 0: only count */
};

static void kp_put(struct kp_text *t, const char *s, unsigned long n)
{
	if (t->len + n <= t->cap)
		memcpy(t->buf + t->len, s, n);
	t->len += n;
}

static void kp_puts(struct kp_text *t, const char *s)
{
	kp_put(t, s, strlen(s));
}

static const char *kp_placement(const struct kprobe *p)
{
	if (p->flags & KPROBE_FLAG_FTRACE)
		return "[FTRACE]";
	if (p->flags & KPROBE_FLAG_OPTIMIZED)
		return "[OPTIMIZED]";
	/* The breakpoint sites are sorted by link-time address. */
	unsigned long a = (unsigned long)p->addr - kp_rt.bias;
	unsigned int lo = 0, hi = kp_nbreakpoints;
	while (lo < hi) {
		unsigned int mid = (lo + hi) / 2;
		const struct kp_breakpoint_site *d = &kp_breakpoints[mid];
		if (d->addr == a)
			return kp_arch_xol_tag(d->mode);
		if (d->addr < a)
			lo = mid + 1;
		else
			hi = mid;
	}
	return "";
}

static void kp_list_one(struct kp_text *t, const struct kprobe *p, const char *type)
{
	char line[96];
	snprintf(line, sizeof(line), "%016lx  %s  ", (unsigned long)p->addr, type);
	kp_puts(t, line);
	kp_puts(t, p->symbol_name ? p->symbol_name : "");
	snprintf(line, sizeof(line), "+0x%x    %s%s\n", p->offset, kprobe_disabled(p) && !(p->flags & KPROBE_FLAG_GONE)
		 ? "[DISABLED]" : "", kp_placement(p));
	kp_puts(t, line);
}

static void kp_fill_list(struct kp_text *t)
{
	for (unsigned int i = 0; i < kp_nprobes; i++)
		kp_list_one(t, &kp_probes[i], "k");
	for (unsigned int i = 0; i < kp_nkretprobes; i++)
		kp_list_one(t, &kp_kretprobes[i].kp, "r");
}

static void kp_profile_one(struct kp_text *t, const char *name, unsigned int index, unsigned long missed)
{
	unsigned long hits = 0;
	for (struct kp_thread *th = kp_rt.threads; th; th = th->next)
		hits += th->hits[index];
	char nums[48];
	unsigned long n = strlen(name);
	kp_puts(t, "  ");
	kp_put(t, name, n);
	for (; n < 44; n++)
		kp_put(t, " ", 1);
	snprintf(nums, sizeof(nums), " %15lu %15lu\n", hits, missed);
	kp_puts(t, nums);
}

/* trace_kprobe's probes_profile_seq_show(): "  %-44s %15lu %15lu\n". */
static void kp_fill_profile(struct kp_text *t)
{
	for (unsigned int i = 0; i < kp_nprobes; i++)
		kp_profile_one(t, kp_probes[i].name, kp_probes[i].index, kp_probes[i].nmissed);
	for (unsigned int i = 0; i < kp_nkretprobes; i++)
		kp_profile_one(t, kp_kretprobes[i].kp.name, kp_kretprobes[i].kp.index,
			       kp_kretprobes[i].kp.nmissed + (unsigned long)kp_kretprobes[i].nmissed);
}

static void kp_fill_enabled(struct kp_text *t)
{
	kp_puts(t, __atomic_load_n(&kp_kernel_disarmed, __ATOMIC_ACQUIRE) ? "0\n" : "1\n");
}

/* The text of the last file read, kept for its next read(): a reader takes a file in
 * chunks (a page at a time), and with a probe on every function each chunk would
 * format the whole text again (some 90,000 lines).  The reader that holds kp_text_busy
 * uses and replaces it; a concurrent one formats its own.  A read at offset 0 formats
 * afresh, so each reading from the start sees the counters of that moment. */
static struct {
	void *file;
	void (*fill)(struct kp_text *);
	char *buf;
	unsigned long len;
} kp_text_kept;
static int kp_text_busy;

static long kp_read_text(void *file, char *ubuf, unsigned long count, long long *ppos,
			 void (*fill)(struct kp_text *))
{
	int own = !__atomic_exchange_n(&kp_text_busy, 1, __ATOMIC_ACQUIRE);
	if (own && *ppos && kp_text_kept.buf && kp_text_kept.file == file && kp_text_kept.fill == fill) {
		long r = simple_read_from_buffer(ubuf, count, ppos, kp_text_kept.buf, kp_text_kept.len);
		__atomic_store_n(&kp_text_busy, 0, __ATOMIC_RELEASE);
		return r;
	}
	struct kp_text t = { 0, 0, 0 };
	fill(&t);			/* its length */
	t.cap = t.len + 64;		/* counters may grow in between */
	t.buf = vmalloc(t.cap);
	long r = -KP_ENOMEM;
	if (t.buf) {
		t.len = 0;
		fill(&t);
		if (t.len > t.cap)
			t.len = t.cap;
		r = simple_read_from_buffer(ubuf, count, ppos, t.buf, t.len);
	}
	if (own) {
		if (kp_text_kept.buf)
			vfree(kp_text_kept.buf);
		kp_text_kept.file = file;
		kp_text_kept.fill = fill;
		kp_text_kept.buf = t.buf;
		kp_text_kept.len = t.len;
		__atomic_store_n(&kp_text_busy, 0, __ATOMIC_RELEASE);
	} else if (t.buf) {
		vfree(t.buf);
	}
	return r;
}

static long kp_list_read(void *file, char *ubuf, unsigned long count, long long *ppos)
{
	return kp_read_text(file, ubuf, count, ppos, kp_fill_list);
}

static long kp_profile_read(void *file, char *ubuf, unsigned long count, long long *ppos)
{
	return kp_read_text(file, ubuf, count, ppos, kp_fill_profile);
}

static long kp_enabled_read(void *file, char *ubuf, unsigned long count, long long *ppos)
{
	return kp_read_text(file, ubuf, count, ppos, kp_fill_enabled);
}

/* write_enabled_file_bool(): 0 disarms, 1 arms. */
static long kp_enabled_write(void *file, const char *ubuf, unsigned long count, long long *ppos)
{
	(void)file;
	(void)ppos;
	int v;
	int err = kstrtoint_from_user(ubuf, count, 0, &v);
	if (err)
		return err;
	if (v != 0 && v != 1)
		return -KP_EINVAL;
	kp_kernel_arm(v);
	return (long)count;
}

/* struct file_operations, three of them, laid out from BTF (never used before they are filled). */
static unsigned long kp_fops_mem[3][64];

static const void *kp_fops(int i, void *read, void *write)
{
	char *f = (char *)kp_fops_mem[i];
	*(void **)(f + kp_kernel_fops[1]) = (void *)default_llseek;
	*(void **)(f + kp_kernel_fops[2]) = read;
	if (write)
		*(void **)(f + kp_kernel_fops[3]) = write;
	return f;
}

/* console_on_rootfs(): initcalls are done and debugfs is up; /init has not started.
 * Our trace events' cmdline recording starts here too (kp_kernel_trace_late()). */
int kp_kernel_debugfs(struct kprobe *p, struct pt_regs *regs)
{
	(void)p;
	(void)regs;
#ifndef KP_PLACED_AT_BOOT	/* placed at boot, its glue has registered them before (kp_rt_events()) */
	/* the kernel's cmdline recording for our trace events (kp_trace_buffer.c): it
	 * registers tracepoint probes, which may sleep */
	kp_platform_dispatch_end();
	kp_kernel_trace_late();
	kp_platform_dispatch_begin();
#endif
	if (kp_kernel_fops[0] < 0 || (unsigned long)kp_kernel_fops[0] > sizeof(kp_fops_mem[0])) {
		_printk(KP_KERN_INFO "kprewrite: no struct file_operations in the image's BTF: no debugfs files\n");
		return 0;
	}
	/* debugfs_create_*() allocate and take inode locks: allow sleeping for the
	 * calls, as the caller can (a nested hit on this CPU counts as missed). */
	kp_platform_dispatch_end();
	struct dentry *d = debugfs_create_dir("kprewrite", 0);
	/* The kernel's modes: kprobes/list 0400 and enabled 0600 (kernel/kprobes.c: the
	 * list shows kernel addresses), kprobe_profile TRACE_MODE_READ (0440). */
	debugfs_create_file("list", 0400, d, 0, kp_fops(0, (void *)kp_list_read, 0));
	debugfs_create_file("enabled", 0600, d, 0, kp_fops(1, (void *)kp_enabled_read, (void *)kp_enabled_write));
	debugfs_create_file("profile", 0440, d, 0, kp_fops(2, (void *)kp_profile_read, 0));
	kp_platform_dispatch_begin();
	return 0;
}
