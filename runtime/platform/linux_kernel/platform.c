/*
 * Platform layer: a Linux kernel image.  Output goes to the kernel's printk;
 * memory (the per-CPU blocks) comes from a block for the boot CPU's earliest
 * hits and from memory allocated once at boot for every possible CPU (never
 * in probe context);
 * the boot hooks keep our pages of the text/rodata gap through
 * mark_rodata_ro(), with the kernel's own W^X rules: code read-only and
 * executable like .text, data NX (read-only where it is ro_after_init,
 * read-write after), and make the probe tables read-only then.
 */
#include "kp_internal.h"

#define PAGE_SHIFT KP_ARCH_PAGE_SHIFT
#define PAGE_SIZE (1UL << PAGE_SHIFT)
#define PAGE_ALIGN(x) (((x) + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1))

/* The linked blob's layout (rewriter/link/ld.py's linker script): code and
 * rodata from the text/rodata gap's start up to __kp_rela_end, data from
 * __kp_data_start, the start of the rodata/data gap. */
extern char __kp_rela_end[], __kp_data_start[], __kp_data_end[];
/* The data that is constant once the tables are built (.data..ro_after_init: the
 * records, the tables' pointers, the arch's breakpoint descriptors), first in the
 * data and page-aligned: the kernel's own set_memory_ro() of mark_rodata_ro() makes
 * it read-only, as it does the kernel's __ro_after_init. */
extern char __kp_ro_start[], __kp_ro_end[];

static unsigned long kp_kernel_pool_used;
/* Every possible CPU's block, allocated by the setup_per_cpu_areas() boot hook. */
static char *kp_kernel_cpus;
static unsigned long kp_kernel_cpus_size, kp_kernel_cpus_used;

void *kp_platform_alloc(unsigned long size)
{
	size = (size + 63) & ~63UL;
	char *cpus = __atomic_load_n(&kp_kernel_cpus, __ATOMIC_ACQUIRE);
	if (cpus) {
		unsigned long at = __atomic_fetch_add(&kp_kernel_cpus_used, size, __ATOMIC_RELAXED);
		return at + size > kp_kernel_cpus_size ? 0 : cpus + at;
	}
	unsigned long at = __atomic_fetch_add(&kp_kernel_pool_used, size, __ATOMIC_RELAXED);
	if (at + size > kp_kernel_pool_size)
		return 0;
	return (char *)kp_kernel_pool + at;
}

/* --- the probe tables, built at boot (KP_PLATFORM_TABLES_AT_BOOT) --- */

#define KP_KSYM_NAME_LEN 512	/* KSYM_NAME_LEN */
unsigned long kp_early_hits;	/* hits before the tables, which ran no handler */

/* Names the tables own: copied into memblock memory, 64 KiB at a time. */
static char *kp_names;
static unsigned long kp_names_left;

static const char *kp_kernel_keep_name(const char *s, unsigned long n)
{
	if (n + 1 > kp_names_left) {
		unsigned long size = n + 1 > 65536 ? n + 1 : 65536;
		kp_names = memblock_alloc_try_nid(size, 8, 0, 0, -1);
		if (!kp_names)
			return 0;
		kp_names_left = size;
	}
	char *out = kp_names;
	memcpy(out, s, n);
	out[n] = 0;
	kp_names += n + 1;
	kp_names_left -= n + 1;
	return out;
}

int kp_pre_handler_kretprobe(struct kprobe *p, struct pt_regs *regs);	/* kp_kretprobe_task.c */

static const char *kp_rec_string(unsigned int at)
{
	return at == KP_REC_NONE ? 0 : kp_rec_strings + at - 1;
}

/* p's symbol_name and name from a record's fields (p->addr and offset set): a name the
 * records left out from kallsyms, an event name left out the default KIND_SYMBOL_OFFSET
 * (trace_kprobe's, the symbol sanitized).  1 when the event name was made. */
static int kp_kernel_name(struct kprobe *p, unsigned int symbol, unsigned int event, char kind, char *name)
{
	p->symbol_name = kp_rec_string(symbol);
	if (symbol == KP_REC_DERIVED) {
		const char *s = kallsyms_lookup((unsigned long)p->addr - p->offset, 0, 0, 0, name);
		p->symbol_name = s ? kp_kernel_keep_name(name, strlen(name)) : 0;
	}
	p->name = kp_rec_string(event);
	int made = 0;
	if (event == KP_REC_DERIVED && p->symbol_name) {
		int n = snprintf(name, KP_KSYM_NAME_LEN + 32, "%c_%s_%u", kind, p->symbol_name, p->offset);
		for (int k = 2; k < n; k++)
			if (!((name[k] >= 'a' && name[k] <= 'z') || (name[k] >= 'A' && name[k] <= 'Z')
			      || (name[k] >= '0' && name[k] <= '9') || name[k] == '_'))
				name[k] = '_';
		p->name = kp_kernel_keep_name(name, n);
		made = 1;
	}
	if (!p->name)
		p->name = "?";
	return made;
}

/* The built tables that never change (sites, probe lists, handler pairs, the kretprobes'
 * handlers): whole
 * pages of their own, made read-only at mark_rodata_ro() (kp_kernel_keep_ro()). */
static unsigned long kp_kernel_ro_tables, kp_kernel_ro_size;
/* The clean hit's per-site entries (kp_internal.h), published by kp_kernel_alloc_cpus(). */
const struct kp_site_fast *kp_site_fast __attribute__((section(".data..ro_after_init")));
static struct kp_site_fast *kp_kernel_site_fast;

/* What register_kprobe() fills in, from the records emit/tables.py wrote: addresses
 * from _text, the handler pair, a symbol name the kernel's kallsyms gives (the
 * records leave out those that are the first name at the symbol's address), the
 * event name p_SYMBOL_OFFSET (r_ for a kretprobe) when it is the default; a
 * kretprobe's struct kretprobe from its record and kind.  Then the pointers are
 * published; the runtime's own probes keep the counts of their early copies.
 * struct kprobe (nmissed, flags) stays writable; what the dispatch follows to
 * code -- kp_site (its resume addresses), the probe lists, the handler pairs it
 * calls -- goes in separate pages, read-only from mark_rodata_ro() on. */
static void kp_kernel_build_tables(void)
{
	unsigned long base = (unsigned long)_text;
	unsigned long size = kp_nprobes * sizeof(struct kprobe) + kp_nkretprobes * sizeof(struct kretprobe);
	unsigned long ro_size = PAGE_ALIGN(kp_nsites * (sizeof(struct kp_site_fast) + sizeof(struct kp_site))
					   + kp_nsite_probes * (sizeof(struct kprobe *) + sizeof(struct kp_handler_rec))
					   + kp_nkretprobes * sizeof(struct kp_kret_handler_rec));
	char *m = memblock_alloc_try_nid(size, 64, 0, 0, -1);
	char *ro = memblock_alloc_try_nid(ro_size, PAGE_SIZE, 0, 0, -1);
	size += ro_size;
	if (!m || !ro) {
		_printk(KP_KERN_ERR "kprewrite: no memory for the tables of %u probes (%lu KiB): "
			"they stay disarmed\n", kp_nprobes, size >> 10);
		return;
	}
	struct kprobe *probes = (struct kprobe *)m;
	struct kretprobe *krets = (struct kretprobe *)(probes + kp_nprobes);
	struct kp_site_fast *fast = (struct kp_site_fast *)ro;
	struct kp_handler_rec *handlers = (struct kp_handler_rec *)(fast + kp_nsites);
	struct kp_site *sites = (struct kp_site *)(handlers + kp_nsite_probes);
	struct kprobe **site_probes = (struct kprobe **)(sites + kp_nsites);
	struct kp_kret_handler_rec *kret_handlers = (struct kp_kret_handler_rec *)(site_probes + kp_nsite_probes);
	char name[KP_KSYM_NAME_LEN + 32];
	unsigned long named = 0;
	for (unsigned int i = 0; i < kp_nprobes; i++) {
		const struct kp_probe_rec *r = &kp_probe_recs[i];
		struct kprobe *p = &probes[i];
		p->addr = (kprobe_opcode_t *)(base + kp_site_recs[r->site].addr);
		p->offset = r->offset;
		p->pre_handler = kp_rec_handlers[r->handlers].pre;
		p->post_handler = kp_rec_handlers[r->handlers].post;
		p->flags = r->flags;
		p->index = i;
		p->site = r->site;
		named += kp_kernel_name(p, r->symbol, r->name, 'p', name);
	}
	for (unsigned int i = 0; i < kp_nkretprobes; i++) {
		const struct kp_kret_rec *r = &kp_kret_recs[i];
		const struct kp_kret_kind *kind = &kp_kret_kinds[r->kind];
		struct kretprobe *rp = &krets[i];
		struct kprobe *p = &rp->kp;
		p->addr = (kprobe_opcode_t *)(base + kp_site_recs[r->site].addr);
		p->offset = kind->offset;
		p->pre_handler = kp_pre_handler_kretprobe;
		p->flags = r->flags & 0xff;
		p->index = kp_nprobes + i;	/* its hit counter follows the kprobes' */
		p->site = r->site;
		named += kp_kernel_name(p, r->symbol, r->name, 'r', name);
		/* For handlers to read; the dispatch calls kp_kret_handler_table[]'s (KP_KRET_HANDLER()). */
		rp->handler = kind->handler;
		rp->entry_handler = kind->entry_handler;
		kret_handlers[i] = (struct kp_kret_handler_rec){ kind->handler, kind->entry_handler };
		rp->maxactive = kind->maxactive;
		rp->data_size = kind->data_size;
		rp->kp_mode = r->flags & KP_KRET_REC_TRAMPOLINE ? 1 : 0;	/* KP_KRET_TRAMPOLINE */
		rp->kp_ret_clean = !!(r->flags & KP_KRET_REC_RET_CLEAN);
	}
	for (unsigned int i = 0, first = 0; i < kp_nsites; i++) {
		const struct kp_site_rec *r = &kp_site_recs[i];
		sites[i] = (struct kp_site){ base + r->addr, base + r->addr + r->insn_len, base + r->resume,
					     base + r->resume_post, first, r->count };
		first += r->count;
	}
	for (unsigned int i = 0; i < kp_nsite_probes; i++) {
		unsigned int k = kp_site_probe_recs[i];
		site_probes[i] = k & KP_REC_KRET ? &krets[k & ~KP_REC_KRET].kp : &probes[k];
		handlers[i] = k & KP_REC_KRET ? (struct kp_handler_rec){ kp_pre_handler_kretprobe, 0 }
					      : kp_rec_handlers[kp_probe_recs[k].handlers];
	}
	for (unsigned int i = 0; i < kp_nsites; i++) {
		unsigned int first = sites[i].first;
		int one = sites[i].count == 1 && handlers[first].pre;
		fast[i] = (struct kp_site_fast){ one ? site_probes[first] : 0, one ? handlers[first].pre : 0 };
	}
	for (unsigned int i = 0; i < kp_nearly_probes; i++)
		probes[kp_early_probes[i].index].nmissed = kp_early_probes[i].nmissed;
	kp_probes = probes;
	kp_kretprobes = krets;
	kp_kret_handler_table = kret_handlers;
	kp_sites = sites;
	kp_site_probes = (struct kprobe *const *)site_probes;
	kp_site_handlers = handlers;
	kp_kernel_site_fast = fast;
	kp_kernel_ro_tables = (unsigned long)ro;
	kp_kernel_ro_size = ro_size;
	__atomic_store_n(&kp_tables_built, 1, __ATOMIC_RELEASE);
	if (kp_kernel_disarmed)		/* kprewrite.enabled=0, read before the tables existed */
		kp_kernel_arm(0);
	_printk(KP_KERN_INFO "kprewrite: built the tables of %u probes at %s (%lu KiB, %lu names from kallsyms); "
		"%lu hits before ran no handler\n", kp_nprobes + kp_nkretprobes, "setup_per_cpu_areas", size >> 10, named,
		__atomic_load_n(&kp_early_hits, __ATOMIC_RELAXED));
}

/* setup_per_cpu_areas(): nr_cpu_ids is known and memblock still hands out
 * memory for good, as it does for the per-CPU areas themselves.  Until here
 * only the boot CPU runs, on the static block, which it keeps; every other
 * CPU's block comes from this memory. */
void kp_kernel_unwind_init(void);	/* kp_unwind.c */
int kp_kernel_alloc_cpus(struct kprobe *p, struct pt_regs *regs)
{
	(void)p;
	(void)regs;
	kp_kernel_build_tables();
	/* Lookups take the fast path from here on; kp_optimized_clean_callback()'s reads
	 * the tables once kp_fast is set, so it stays 0 if they could not be built. */
	if (kp_tables_built)
		kp_thread_table_ready();
	kp_kernel_kretprobes_init();
	kp_kernel_trace_init();		/* our trace events' output types */
	kp_kernel_unwind_init();	/* our code as kernel text for the unwinder (kp_unwind.c) */
	unsigned long size = (unsigned long)nr_cpu_ids * kp_kernel_block;
	char *m = memblock_alloc_try_nid(size, 64, 0, 0, -1);	/* MEMBLOCK_ALLOC_ACCESSIBLE, NUMA_NO_NODE */
	if (!m) {
		_printk(KP_KERN_ERR "kprewrite: no memory for %u CPUs' counters (%lu KiB): "
			"hits on CPUs without one count as missed\n", nr_cpu_ids, size >> 10);
		return 0;
	}
	kp_kernel_cpus_size = size;
	__atomic_store_n(&kp_kernel_cpus, m, __ATOMIC_RELEASE);
	/* Every possible CPU's block now, in slot smp_processor_id() + 1 (the boot CPU's
	 * may be the static one it took before, this hook's), so that a clean or int3 hit
	 * reads its CPU's by number (kp_optimized_clean_callback(), kp_int3_bp_hit()); then
	 * its per-site entries. */
	int all = kp_fast && kp_kernel_site_fast && nr_cpu_ids < KP_TABLE_SIZE;
	for (unsigned int cpu = 0; all && cpu < nr_cpu_ids; cpu++) {
		unsigned long key = ((unsigned long)cpu + 1) << 12;
		struct kp_thread *t = kp_thread_slow(key);
		all = t && kp_thread_table[KP_HASH(key)] == t;
	}
	if (all)
		__atomic_store_n(&kp_site_fast, kp_kernel_site_fast, __ATOMIC_RELEASE);
	return 0;
}

/* sched_init_smp(), right after smp_init() has brought every CPU up: the breakpoints of
 * the breakpoint sites that came from globs (kp_arch_arm_breakpoints()).  Not earlier: on
 * x86-64 a CPU coming up runs cr4_init() (native_write_cr4()) before it loads the IDT, where
 * an int3 is a triple fault (as the boot CPU does before setup_arch(): Xen PVH's entry
 * calls memcmp()). */
int kp_kernel_arm_breakpoints(struct kprobe *p, struct pt_regs *regs)
{
	(void)p;
	(void)regs;
	kp_arch_arm_breakpoints();
	return 0;
}

/* Each write is one printk: at the level the handler's text starts with
 * (pr_err(), KERN_CONT...; the kernel's printk reads it from the formatted
 * text), else KERN_INFO, pr_info()'s. */
static int kp_kernel_may_sleep;	/* set while kp_kernel_profile() writes its rows */

void kp_platform_write(int fd, const char *buf, unsigned long len)
{
	(void)fd;
	if (len && buf[0] == KERN_SOH[0])
		_printk("%.*s", (int)len, buf);
	else
		_printk(KP_KERN_INFO "%.*s", (int)len, buf);
	if (kp_kernel_may_sleep)	/* a long profile (a row per probe): let RCU and others run */
		__cond_resched();
}

/* No files in a kernel: every output goes to printk. */
int kp_platform_open_append(const char *path)
{
	(void)path;
	return 2;
}

void kp_platform_close(int fd)
{
	(void)fd;
}

unsigned long kp_platform_ncpus(void)
{
	return nr_cpu_ids;
}

long long kp_platform_ktime(void)
{
	return ktime_get();
}

/* No signals in a kernel. */
void kp_profile_signal_configure(const char *value)
{
	(void)value;
}

/*
 * The boot hooks, pre_handlers of probes the rewriter adds on the kernel's
 * own set_memory_ro(), set_memory_nx() and free_kernel_image_pages() (their
 * ftrace sites).  mark_rodata_ro() calls set_memory_ro(_text, ...) up to the
 * end of the rodata/data gap, set_memory_nx(PFN_ALIGN(_etext), ...), then
 * free_kernel_image_pages(what, PFN_ALIGN(_etext), __start_rodata) and the
 * same for the rodata/data gap.  Our writable data pages are kept out of the
 * first (every probe hit writes them, the hooks' own included, so they must
 * never be read-only; the ro_after_init pages before them are left in, as the
 * kernel's own __ro_after_init), our code pages out of the second, both out
 * of the frees.  Only the arguments' meanings are relied on, not the code of
 * mark_rodata_ro().
 */

/* The set_memory_ro() over our data is mark_rodata_ro()'s: the built tables'
 * read-only pages go read-only with the kernel's rodata (once). */
static void kp_kernel_tables_ro(void)
{
	unsigned long at = kp_kernel_ro_tables, size = kp_kernel_ro_size;
	if (!at)
		return;
	kp_kernel_ro_tables = 0;
	/* May sleep, as the caller may: see below. */
	kp_platform_dispatch_end();
	int err = set_memory_ro(at, (int)(size >> PAGE_SHIFT));
	kp_platform_dispatch_begin();
	_printk(KP_KERN_INFO "kprewrite: probe tables read-only: %lu KiB of sites, probe lists and handlers%s; "
		"%lu KiB of records and descriptors (ro_after_init)\n", size >> 10, err ? " FAILED" : "",
		(unsigned long)(__kp_ro_end - __kp_ro_start) >> 10);
}

/* set_memory_ro(addr, numpages) over our data pages: everything but the writable ones. */
int kp_kernel_keep_ro(struct kprobe *p, struct pt_regs *regs)
{
	(void)p;
	unsigned long data = (unsigned long)__kp_ro_end;	/* page-aligned: the writable data */
	unsigned long data_end = PAGE_ALIGN((unsigned long)__kp_data_end);
	unsigned long lo = kp_arch_arg0(regs), hi = lo + ((unsigned long)(long)(int)kp_arch_arg1(regs) << PAGE_SHIFT);
	if (lo <= (unsigned long)__kp_data_start && (unsigned long)__kp_data_start < hi)
		kp_kernel_tables_ro();
	if (data_end == data || hi <= data || lo >= data_end)
		return 0;
	if (hi > data_end) {
		/* set_memory_ro() may sleep (change_page_attr takes mutexes),
		 * and its caller may: allow it for the call.  The nested hit
		 * on this probe counts as missed and changes nothing. */
		kp_platform_dispatch_end();
		set_memory_ro(data_end, (int)((hi - data_end) >> PAGE_SHIFT));
		kp_platform_dispatch_begin();
	}
	kp_arch_arg1(regs) = lo < data ? (data - lo) >> PAGE_SHIFT : 0;
	return 0;
}

/* set_memory_nx(addr, numpages): start the NX range after our code pages. */
int kp_kernel_keep_nx(struct kprobe *p, struct pt_regs *regs)
{
	(void)p;
	unsigned long code_end = PAGE_ALIGN((unsigned long)__kp_rela_end);
	if (kp_arch_arg0(regs) != kp_kernel_gap_start)
		return 0;
	long pages = (long)(int)kp_arch_arg1(regs) - (long)((code_end - kp_kernel_gap_start) >> PAGE_SHIFT);
	kp_arch_arg0(regs) = code_end;
	kp_arch_arg1(regs) = pages > 0 ? (unsigned long)pages : 0;
	return 0;
}

/* free_kernel_image_pages(what, begin, end): keep our code pages (the start
 * of the text/rodata gap) and our data pages (the start of the rodata/data gap). */
int kp_kernel_keep_free(struct kprobe *p, struct pt_regs *regs)
{
	(void)p;
	unsigned long code_end = PAGE_ALIGN((unsigned long)__kp_rela_end);
	unsigned long data = (unsigned long)__kp_data_start;
	unsigned long data_end = PAGE_ALIGN((unsigned long)__kp_data_end);
	if (kp_arch_arg1(regs) == kp_kernel_gap_start) {
		kp_arch_arg1(regs) = code_end < kp_arch_arg2(regs) ? code_end : kp_arch_arg2(regs);
		_printk(KP_KERN_INFO "kprewrite: kept %lx..%lx of the text/rodata gap: code %lu KiB (read-only)\n",
			kp_kernel_gap_start, code_end, (code_end - kp_kernel_gap_start) >> 10);
	} else if (kp_arch_arg1(regs) == data && data_end > data) {
		kp_arch_arg1(regs) = data_end < kp_arch_arg2(regs) ? data_end : kp_arch_arg2(regs);
		_printk(KP_KERN_INFO "kprewrite: kept %lx..%lx of the rodata/data gap: data %lu KiB (NX; "
			"read-only from %lx, read-write from %lx)\n", data, data_end, (data_end - data) >> 10,
			data, (unsigned long)__kp_ro_end);
	}
	return 0;
}

/* kernel_power_off(), kernel_restart(), kernel_halt(): kprobe_profile's rows
 * (event, hits, nmissed) in the kernel log, the counters' last chance to be
 * read. */
int kp_kernel_profile(struct kprobe *p, struct pt_regs *regs)
{
	_printk(KP_KERN_INFO "kprewrite: kprobe_profile at %s:\n", p->symbol_name);
	kp_rt.profile_path = "-";	/* kp_platform_write(): the kernel log */
	/* A row per probe through the serial console can take seconds (37,000 probes: some
	 * 20 s under TCG), too long with preemption off (an RCU stall).  These functions are
	 * called in process context (reboot(2), the orderly power-off work): when interrupts
	 * are on, the dump runs preemptible, as a read of kprobe_profile would; a hit on
	 * this CPU meanwhile counts as missed. */
	(void)regs;
	unsigned long flags = kp_arch_local_save_flags();
	int sleep = !kp_arch_irqs_disabled_flags(flags);	/* the detour keeps the caller's */
	if (sleep) {
		kp_platform_dispatch_end();
		kp_kernel_may_sleep = 1;
	}
	kp_write_profile();
	if (sleep) {
		kp_kernel_may_sleep = 0;
		kp_platform_dispatch_begin();
	}
	return 0;
}
