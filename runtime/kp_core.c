/*
 * The generic part of the runtime: kernel/kprobes.c's dispatch semantics.
 *
 * - aggregation: several kprobes at one address share a site; pre_handlers run
 *   in spec order and the first non-zero return stops the chain
 *   (aggr_pre_handler), every post_handler runs (aggr_post_handler);
 * - reentrancy: a hit while a handler runs on the same thread increments the
 *   probe's nmissed and runs nothing (kprobes_inc_nmissed_count);
 * - disabled probes stay silent; KPREWRITE_ENABLED=0 is kprobes/enabled = 0;
 * - hit counters are per thread, like trace kprobes' per-CPU nhit, so a hit
 *   costs no atomic operation and the sums stay exact.
 */
#include "kp_internal.h"

#ifdef KP_PLATFORM_NO_STARTUP
/* Linked where it runs and never started (a kernel image): ready at the first
 * hit, with nothing to relocate or configure. */
struct kp_runtime kp_rt = { .state = 2, .armed = 1 };
volatile int kp_fast;		/* set by kp_thread_table_ready() */
#else
struct kp_runtime kp_rt;
volatile int kp_fast;
#endif

/* Single-threaded start-up before the C library has set up a thread pointer. */
static struct kp_thread *kp_early_thread;


/* The anchor whose link-time address kprewrite records: bias = run - link. */
void kp_link_anchor(void) { }

/*
 * Self-relocation: the runtime's own relative relocations (the arch's *_RELATIVE)
 * were applied by kprewrite at link-time addresses; a PIE or shared object loaded elsewhere adds
 * the load bias here.  Runs once, from start-up or from the first hit if a probe
 * fires earlier (a shared object's code can run before its init_array).
 */
static void kp_thread_table_init(void);

struct kp_rela { unsigned long offset, info; long addend; };
extern const struct kp_rela __kp_rela_start[], __kp_rela_end[];
#ifndef KP_PLATFORM_NO_STARTUP
extern char __kp_ro_start[], __kp_ro_end[];	/* the linker script's, page-aligned */
#endif

void kp_relocate(void)
{
	int expected = 0;
	if (kp_rt.state == 2)
		return;
	if (!__atomic_compare_exchange_n(&kp_rt.state, &expected, 1, 0,
					 __ATOMIC_ACQUIRE, __ATOMIC_ACQUIRE)) {
		while (__atomic_load_n(&kp_rt.state, __ATOMIC_ACQUIRE) != 2)
			cpu_relax();
		return;
	}
	unsigned long bias = (unsigned long)&kp_link_anchor - kp_link_anchor_addr;
	kp_rt.bias = bias;
	if (bias) {
		for (const struct kp_rela *r = __kp_rela_start; r < __kp_rela_end; r++)
			*(unsigned long *)(r->offset + bias) += bias;
		for (unsigned int i = 0; i < kp_nprobes; i++)
			kp_probes[i].addr += bias;
		for (unsigned int i = 0; i < kp_nsites; i++) {
			kp_sites[i].addr += bias;
			kp_sites[i].post_ip += bias;
			kp_sites[i].resume += bias;
			kp_sites[i].resume_post += bias;
		}
	}
	kp_thread_table_init();
	kp_kretprobe_relocate(bias);
#ifndef KP_PLATFORM_NO_STARTUP
	/* Sites, their probe lists and the handlers the dispatch calls: read-only from
	 * now on (kp_internal.h, kp_site_handlers[]). */
	kp_platform_protect_tables(__kp_ro_start, __kp_ro_end);
#endif
#ifdef KP_ARCH_TEXT_ALTERNATIVES
	/* The arch's code chosen for this CPU (AArch64: LSE atomics in light detours),
	 * while kp_fast is still 0, so no detour runs the words it rewrites. */
	kp_arch_text_alternatives(bias);
#endif
	kp_rt.armed = 1;
	__atomic_store_n(&kp_rt.state, 2, __ATOMIC_RELEASE);
	kp_update_fast();
}

/* Start-up configuration from the environment (after kp_relocate). */
void kp_configure(char **envp)
{
	const char *e = kp_getenv(envp, "KPREWRITE_ENABLED");
	if (e && e[0] == '0' && e[1] == 0) {
		kp_rt.armed = 0;
		kp_update_fast();
	}
	kp_rt.profile_path = kp_getenv(envp, "KPREWRITE_PROFILE");
	kp_trace_configure(envp);	/* kp_trace.c: KPREWRITE_TRACE */
}

static struct kp_thread *kp_new_thread(unsigned long key)
{
	/* Hit counters: kprobes, then kretprobes (whose kp.index follows kp_nprobes). */
	struct kp_thread *t = kp_platform_alloc(sizeof(*t) + (kp_nprobes + kp_nkretprobes) * sizeof(unsigned long));
	if (!t)
		return 0;
	t->key = key;
	struct kp_thread *head = kp_rt.threads;
	do {
		t->next = head;
	} while (!__atomic_compare_exchange_n(&kp_rt.threads, &head, t, 1,
					      __ATOMIC_RELEASE, __ATOMIC_RELAXED));
	return t;
}

/*
 * Thread blocks by thread pointer: an open-addressed table whose empty slots
 * hold kp_no_thread (key 0, never a thread pointer), so the probe path's
 * lookup is one load and one compare.  Thread pointers sit in separate
 * mappings, so their page numbers spread well.
 */
static struct kp_thread kp_no_thread;
struct kp_thread *kp_thread_table[KP_TABLE_SIZE];

static void kp_thread_table_init(void)
{
	for (unsigned long i = 0; i < KP_TABLE_SIZE; i++)
		kp_thread_table[i] = &kp_no_thread;
}

#ifdef KP_PLATFORM_NO_STARTUP
/* Never started (a kernel): the table starts zeroed, not filled with pointers
 * (each would need a KASLR relocation entry, 8,192 of them), its empty slots
 * NULL, and kp_fast stays 0 so lookups take the slow path, which takes NULL
 * for empty too, until the platform calls this once, while only one CPU runs. */
void kp_thread_table_ready(void)
{
	for (unsigned long i = 0; i < KP_TABLE_SIZE; i++)
		if (!kp_thread_table[i])
			kp_thread_table[i] = &kp_no_thread;
	__atomic_store_n(&kp_fast, 1, __ATOMIC_RELEASE);
}
#endif

/* Slow path of the thread lookup: claim a slot for a thread seen first. */
struct kp_thread *kp_thread_slow(unsigned long key)
{
	if (!key) {
		/* No thread pointer yet: start-up is single-threaded. */
		if (!kp_early_thread)
			kp_early_thread = kp_new_thread(0);
		return kp_early_thread;
	}
	struct kp_thread *t = 0;
	for (unsigned long n = 0, i = KP_HASH(key); n < KP_TABLE_SIZE; n++, i = (i + 1) & KP_TABLE_MASK) {
		struct kp_thread **slot = &kp_thread_table[i];
		struct kp_thread *cur = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
		if (cur && cur != &kp_no_thread) {
			if (cur->key == key)
				return cur;
			continue;
		}
		if (!t && !(t = kp_new_thread(key)))
			return 0;
		if (__atomic_compare_exchange_n(slot, &cur, t, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
			return t;
		if (cur->key == key)
			return cur;
	}
	return t;	/* table full: an unshared block, counts still summed */
}

/* kp_fast: armed, and the thread pointer can be read (the probe path's one test). */
void kp_update_fast(void)
{
	__atomic_store_n(&kp_fast, kp_rt.armed && kp_rt.state == 2 && kp_platform_thread_key_ready(), __ATOMIC_RELEASE);
}

/* Slow path of kp_current_thread() (kp_internal.h): before start-up (relocate
 * first), before a static program has a thread pointer, with KPREWRITE_ENABLED=0. */
__attribute__((noinline)) struct kp_thread *kp_current_thread_slow(void)
{
	if (kp_rt.state != 2)
		kp_relocate();		/* a probe fired before start-up */
	if (!kp_rt.armed)
		return 0;
	return kp_thread_slow(kp_platform_thread_key());
}

/* Where to resume at `ip`: an address under a shared region's jump runs in the
 * detour (kp_region_ips[]); any other address is the program's own code. */
unsigned long kp_region_ip(unsigned long ip)
{
	unsigned long bias = kp_rt.bias, a = ip - bias;
	unsigned int lo = 0, hi = kp_nregion_ips;
	while (lo < hi) {
		unsigned int mid = lo + (hi - lo) / 2;
		if (kp_region_ips[mid].from < a)
			lo = mid + 1;
		else
			hi = mid;
	}
	if (lo < kp_nregion_ips && kp_region_ips[lo].from == a)
		return kp_region_ips[lo].to + bias;
	return ip;
}

/* Return values of the callbacks, read by the arch entry code. */
#define KP_RESUME_DETOUR 0	/* restore and continue in the detour */
#define KP_RESUME_REGS 1	/* resume at regs->ip with regs->sp and the full regs->flags */


/*
 * optimized_callback() of arch/x86/kernel/kprobes/opt.c with the aggregator's
 * aggr_pre_handler(), plus what the kernel cannot do: a pre_handler that
 * returns non-zero after changing regs->ip resumes there.  `regs` is NULL for a
 * clean call (kprewrite proved from their code that the site's handlers never
 * read it), so the inlined copies below drop everything about registers.
 */
static __attribute__((always_inline)) inline long
kp_pre_dispatch(unsigned long site_index, struct pt_regs *regs)
{
	struct kp_site *s = kp_site(site_index);
	if (unlikely(!s))		/* before the tables are built */
		return KP_RESUME_DETOUR;
	struct kp_thread *t = kp_current_thread();
	if (unlikely(!t))
		return KP_RESUME_DETOUR;
	if (unlikely(t->active)) {
		kp_count_missed(s);
		return KP_RESUME_DETOUR;
	}
	unsigned long sp = 0, flags = 0, ip = kp_arch_trap_ip(s->addr);	/* as if the breakpoint had trapped */
	if (regs) {
		sp = kernel_stack_pointer(regs);
		flags = kp_arch_regs_flags(regs);
		instruction_pointer_set(regs, ip);
	}
	t->active = 1;
	int stop = kp_run_pre_handlers(t, s, regs);
	t->active = 0;
	if (!regs)
		return KP_RESUME_DETOUR;
	if (unlikely(stop && instruction_pointer(regs) != ip))
		return KP_RESUME_REGS;		/* the handler changed the path */
	if (unlikely(kernel_stack_pointer(regs) != sp || kp_arch_flags_changed(flags, kp_arch_regs_flags(regs)))) {
		instruction_pointer_set(regs, s->resume);
		return KP_RESUME_REGS;
	}
	return KP_RESUME_DETOUR;
}

long kp_optimized_callback(unsigned long site_index, struct pt_regs *regs)
{
	kp_platform_dispatch_begin();
	long r = kp_pre_dispatch(site_index, regs);
	kp_platform_dispatch_end();
	return r;
}

#ifndef KP_PLATFORM_TABLES_AT_BOOT
void kp_optimized_clean_callback(unsigned long site_index)
{
	kp_platform_dispatch_begin();
	kp_pre_dispatch(site_index, 0);
	kp_platform_dispatch_end();
}
#else
/* at: the site's index * sizeof(struct kp_site_fast), as the fast path below has it. */
static __attribute__((noinline)) void kp_clean_dispatch_general(unsigned long at)
{
	kp_pre_dispatch(at / sizeof(struct kp_site_fast), 0);
	kp_platform_dispatch_end();
}

/*
 * A kernel's clean hit, the path of every optimized and ftrace-site probe whose
 * handlers never read regs (the detours call the shared kp_optprobe_clean_entry):
 * the common case straight through -- kp_site_fast[] published (tables built, every
 * CPU's block in its slot), one probe with a pre_handler at the site, no handler
 * running on this CPU -- with one register kept across the pre_handler's call;
 * anything else takes the general dispatch above.  The CPU's block is read by its
 * number, with no key to compare, and the site's probe and pre_handler from one
 * 16-byte entry: no kp_sites[], kp_site_probes[] or kp_site_handlers[] on the way.
 */
void kp_optimized_clean_callback(unsigned long site_index)
{
	kp_platform_dispatch_begin();
	const struct kp_site_fast *f = kp_site_fast;
	unsigned long at = site_index * sizeof(*f);
	if (__builtin_expect(f != 0, 1)) {
		f = (const struct kp_site_fast *)((const char *)f + at);
		struct kprobe *p = f->p;
		struct kp_thread *t = kp_thread_table[kp_platform_cpu_slot()];
		/* t->active and p->flags read once each, as plain loads the compiler
		 * folds into their tests (kprobe_disabled()'s test). */
		if (__builtin_expect(p != 0, 1) && __builtin_expect(*(const unsigned int *)&t->active == 0, 1)) {
			if (!(*(const unsigned int *)&p->flags & (KPROBE_FLAG_DISABLED | KPROBE_FLAG_GONE))) {
				t->active = 1;
				t->hits[p->index]++;
				f->pre(p, 0);
				t->active = 0;
			}
			kp_platform_dispatch_end();
			return;
		}
	}
	kp_clean_dispatch_general(at);
}
#endif

/* The post_handler half (aggr_post_handler): after the probed instruction, in the detour. */
static __attribute__((always_inline)) inline long
kp_post_dispatch(unsigned long site_index, struct pt_regs *regs)
{
	struct kp_site *s = kp_site(site_index);
	if (unlikely(!s))
		return KP_RESUME_DETOUR;
	struct kp_thread *t = kp_current_thread();
	if (unlikely(!t || t->active))
		return KP_RESUME_DETOUR;	/* the pre half already counted the miss */
	unsigned long sp = 0, flags = 0;
	if (regs) {
		sp = kernel_stack_pointer(regs);
		flags = kp_arch_regs_flags(regs);
		instruction_pointer_set(regs, s->post_ip);
	}
	t->active = 1;
	kp_run_post_handlers(s, regs);
	t->active = 0;
	if (!regs)
		return KP_RESUME_DETOUR;
	if (unlikely(kernel_stack_pointer(regs) != sp || kp_arch_flags_changed(flags, kp_arch_regs_flags(regs))
		     || instruction_pointer(regs) != s->post_ip)) {
		if (instruction_pointer(regs) == s->post_ip)
			instruction_pointer_set(regs, s->resume_post);
		return KP_RESUME_REGS;
	}
	return KP_RESUME_DETOUR;
}

long kp_post_callback(unsigned long site_index, struct pt_regs *regs)
{
	kp_platform_dispatch_begin();
	long r = kp_post_dispatch(site_index, regs);
	kp_platform_dispatch_end();
	return r;
}

void kp_post_clean_callback(unsigned long site_index)
{
	kp_platform_dispatch_begin();
	kp_post_dispatch(site_index, 0);
	kp_platform_dispatch_end();
}

int enable_kprobe(struct kprobe *kp)
{
	__atomic_fetch_and(&kp->flags, ~KPROBE_FLAG_DISABLED, __ATOMIC_RELAXED);
	return 0;
}

int disable_kprobe(struct kprobe *kp)
{
	__atomic_fetch_or(&kp->flags, KPROBE_FLAG_DISABLED, __ATOMIC_RELAXED);
	return 0;
}

int enable_kretprobe(struct kretprobe *rp)
{
	return enable_kprobe(&rp->kp);
}

int disable_kretprobe(struct kretprobe *rp)
{
	return disable_kprobe(&rp->kp);
}

/* One kprobe_profile row, "  %-44s %15lu %15lu\n" as trace_kprobe's probes_profile_seq_show()
 * prints it, in one write (a kernel's platform makes each write one printk line).  An
 * event name of any length (a C++ symbol's runs to hundreds of characters) is written
 * whole up to 1 KiB: writing snprintf's would-be length from a fixed 160-byte line wrote
 * the stack bytes past it. */
void kp_profile_row(int fd, const char *name, unsigned long hits, unsigned long missed)
{
	size_t n = strlen(name);
	if (n > 1024)
		n = 1024;
	char line[1024 + 2 + 2 * 17 + 2];
	size_t pos = 0;
	line[pos++] = ' ';
	line[pos++] = ' ';
	memcpy(line + pos, name, n);	/* the runtime's snprintf knows no "%-44.*s" */
	pos += n;
	while (pos < 2 + 44)
		line[pos++] = ' ';
	pos += snprintf(line + pos, sizeof(line) - pos, " %15lu %15lu\n", hits, missed);
	kp_platform_write(fd, line, pos);
}

/* kprobe_profile: "  EVENT  HITS  MISSES", written where KPREWRITE_PROFILE says. */
/* A line the platform adds to the profile after its rows (a Linux process: the
 * program replaced the SIGTRAP handler of the breakpoint probes, kp_trap_check()). */
const char *kp_profile_note;

void kp_write_profile(void)
{
	const char *path = kp_rt.profile_path;
	if (!path || !*path || kp_rt.state != 2)
		return;
#ifdef KP_PLATFORM_TABLES_AT_BOOT
	if (!kp_tables_built)
		return;
#endif
	int fd = (!strcmp(path, "-") || !strcmp(path, "stderr")) ? 2 : kp_platform_open_append(path);
	if (fd < 0)
		return;
	for (unsigned int i = 0; i < kp_nprobes; i++) {
		unsigned long hits = 0;
		for (struct kp_thread *t = kp_rt.threads; t; t = t->next)
			hits += t->hits[i];
		if (i < kp_nlight_hits)
			for (unsigned int s = 0; s < KP_LIGHT_SHARDS; s++)
				hits += __atomic_load_n(&kp_light_hits[KP_LIGHT_INDEX(i, s)], __ATOMIC_RELAXED);
		kp_profile_row(fd, kp_probes[i].name, hits, kp_probes[i].nmissed);
	}
	/* The kretprobes' rows: kp.nmissed + nmissed, as trace_kprobe reports return probes. */
	for (unsigned int i = 0; i < kp_nkretprobes; i++) {
		struct kretprobe *rp = &kp_kretprobes[i];
		unsigned long hits = 0;
		for (struct kp_thread *t = kp_rt.threads; t; t = t->next)
			hits += t->hits[rp->kp.index];
		if (rp->kp.index < kp_nlight_hits)	/* a light kretprobe's entry counts there */
			for (unsigned int s = 0; s < KP_LIGHT_SHARDS; s++)
				hits += __atomic_load_n(&kp_light_hits[KP_LIGHT_INDEX(rp->kp.index, s)], __ATOMIC_RELAXED);
		kp_profile_row(fd, rp->kp.name, hits, rp->kp.nmissed + (unsigned long)rp->nmissed);
	}
	if (kp_profile_note)
		kp_platform_write(fd, kp_profile_note, strlen(kp_profile_note));
	if (fd != 2)
		kp_platform_close(fd);
}
