/*
 * kprewrite handler API: the kernel's <linux/kprobes.h> as far as handlers see it.
 *
 * Handlers are written as for kernel kprobes.  They are compiled freestanding
 * (no libc) with -mgeneral-regs-only, like kernel code: no floating point.
 */
#ifndef _KPREWRITE_KPROBES_H
#define _KPREWRITE_KPROBES_H

/* Everything the runtime and handlers share stays inside the rewritten image:
 * hidden visibility keeps references PC-relative (no GOT, no dynamic symbols). */
#pragma GCC visibility push(hidden)

#include <stddef.h>
#include <stdarg.h>

typedef unsigned char kprobe_opcode_t;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long s64;
typedef int s32;

/* The CPU's half: struct pt_regs and its accessors (the kernel's <asm/ptrace.h>),
 * for the architecture the compiler targets.  A new architecture is one more header
 * in kprewrite/arch/ and its #elif here: the runtime's one registry (tests/test_arch.py). */
#if defined(__x86_64__)
#include <kprewrite/arch/x86_64/ptrace.h>
#elif defined(__aarch64__)
#include <kprewrite/arch/aarch64/ptrace.h>
#else
#error "kprewrite: no handler API for this architecture (runtime/include/kprewrite/arch/)"
#endif

struct kprobe;
typedef int (*kprobe_pre_handler_t)(struct kprobe *, struct pt_regs *);
typedef void (*kprobe_post_handler_t)(struct kprobe *, struct pt_regs *, unsigned long flags);

#define KPROBE_FLAG_GONE	1	/* breakpoint has already gone */
#define KPROBE_FLAG_DISABLED	2	/* probe is temporarily disabled */
#define KPROBE_FLAG_OPTIMIZED	4	/* probe is really optimized */
#define KPROBE_FLAG_FTRACE	8	/* probe is using ftrace */

struct kprobe {
	kprobe_opcode_t *addr;		/* location of the probe point (as loaded) */
	const char *symbol_name;	/* symbol the probe was resolved from, or NULL */
	unsigned int offset;		/* offset into the symbol */
	kprobe_pre_handler_t pre_handler;
	kprobe_post_handler_t post_handler;
	unsigned long nmissed;		/* hits skipped because a handler was running */
	volatile unsigned int flags;	/* KPROBE_FLAG_* */
	/* kprewrite: */
	const char *name;		/* event name: spec `name`, else p_SYM_OFF */
	unsigned int index;		/* position in the spec's probe table */
	unsigned int site;		/* the probed address's aggregation site */
};

struct kretprobe_instance;
struct kretprobe;
typedef int (*kretprobe_handler_t)(struct kretprobe_instance *, struct pt_regs *);

struct kretprobe {
	struct kprobe kp;
	kretprobe_handler_t handler;
	kretprobe_handler_t entry_handler;
	int maxactive;
	int nmissed;
	size_t data_size;
	/* kprewrite (runtime/kp_kretprobe.c): the instance pool, claimed atomically. */
	unsigned int kp_mode;		/* KP_KRET_* : how the return is caught */
	unsigned int kp_stride;		/* bytes per instance */
	char *kp_pool;			/* maxactive instances, allocated at start-up */
	unsigned int kp_hint;		/* where the next claim starts looking */
	unsigned int kp_ret_clean;	/* no handler of this kretprobe reads regs at return */
};

struct kretprobe_instance {
	struct kretprobe *rp;
	kprobe_opcode_t *ret_addr;	/* the caller's return address */
	void *fp;			/* the return-address slot at entry (the kernel's "sara") */
	/* kprewrite: */
	unsigned int kp_state;		/* 0 free, 1 claimed */
	unsigned int kp_flags;		/* KP_RI_* */
	char data[] __attribute__((aligned(8)));
};

static inline struct kretprobe *get_kretprobe(struct kretprobe_instance *ri)
{
	return ri->rp;
}

/* Time for handlers (the kernel's ktime_get(): monotonic nanoseconds). */
typedef s64 ktime_t;
ktime_t ktime_get(void);
static inline u64 ktime_get_ns(void) { return ktime_get(); }
static inline ktime_t ktime_sub(ktime_t a, ktime_t b) { return a - b; }
static inline s64 ktime_to_ns(ktime_t t) { return t; }

int enable_kprobe(struct kprobe *kp);
int disable_kprobe(struct kprobe *kp);
int enable_kretprobe(struct kretprobe *rp);
int disable_kretprobe(struct kretprobe *rp);

static inline int kprobe_disabled(struct kprobe *p)
{
	return p->flags & (KPROBE_FLAG_DISABLED | KPROBE_FLAG_GONE);
}

/* printk: the kernel's format subset, one write per call. */
int printk(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int vprintk(const char *fmt, va_list ap);
int snprintf(char *buf, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int vsnprintf(char *buf, size_t size, const char *fmt, va_list ap);

#ifndef pr_fmt
#define pr_fmt(fmt) fmt
#endif
#ifdef __KERNEL__
/* A kernel image: the level reaches the kernel's printk (include/linux/kern_levels.h). */
#define KERN_SOH	"\001"
#define KERN_EMERG	KERN_SOH "0"
#define KERN_ALERT	KERN_SOH "1"
#define KERN_CRIT	KERN_SOH "2"
#define KERN_ERR	KERN_SOH "3"
#define KERN_WARNING	KERN_SOH "4"
#define KERN_NOTICE	KERN_SOH "5"
#define KERN_INFO	KERN_SOH "6"
#define KERN_DEBUG	KERN_SOH "7"
#define KERN_CONT	KERN_SOH "c"
#else
/* A user process: one stream, no levels. */
#define KERN_EMERG	""
#define KERN_ALERT	""
#define KERN_CRIT	""
#define KERN_ERR	""
#define KERN_WARNING	""
#define KERN_NOTICE	""
#define KERN_INFO	""
#define KERN_DEBUG	""
#define KERN_CONT	""
#endif
#define pr_emerg(fmt, ...)	printk(KERN_EMERG pr_fmt(fmt), ##__VA_ARGS__)
#define pr_alert(fmt, ...)	printk(KERN_ALERT pr_fmt(fmt), ##__VA_ARGS__)
#define pr_crit(fmt, ...)	printk(KERN_CRIT pr_fmt(fmt), ##__VA_ARGS__)
#define pr_err(fmt, ...)	printk(KERN_ERR pr_fmt(fmt), ##__VA_ARGS__)
#define pr_warn(fmt, ...)	printk(KERN_WARNING pr_fmt(fmt), ##__VA_ARGS__)
#define pr_notice(fmt, ...)	printk(KERN_NOTICE pr_fmt(fmt), ##__VA_ARGS__)
#define pr_info(fmt, ...)	printk(KERN_INFO pr_fmt(fmt), ##__VA_ARGS__)
#define pr_debug(fmt, ...)	do { } while (0)
#define pr_cont(fmt, ...)	printk(KERN_CONT fmt, ##__VA_ARGS__)

/*
 * Code that must never be probed: NOKPROBE_SYMBOL() records the function's
 * address in the _kprobe_blacklist section, as the kernel does; __kprobes puts
 * it in .kprobes.text.  kprewrite blacklists both when rewriting.
 */
#define __kprobes __attribute__((__section__(".kprobes.text")))
#define NOKPROBE_SYMBOL(fname)						\
	static unsigned long __attribute__((__used__, __section__("_kprobe_blacklist"))) \
	_kbl_addr_##fname = (unsigned long)fname;

/* Probes come from the spec; registration calls in a sample's module init are no-ops. */
static inline int register_kprobe(struct kprobe *p) { (void)p; return 0; }
static inline void unregister_kprobe(struct kprobe *p) { (void)p; }
static inline int register_kretprobe(struct kretprobe *rp) { (void)rp; return 0; }
static inline void unregister_kretprobe(struct kretprobe *rp) { (void)rp; }

/* Module boilerplate of the kernel samples compiles to nothing. */
#define MODULE_LICENSE(x)
#define MODULE_AUTHOR(x)
#define MODULE_DESCRIPTION(x)
#define module_init(fn)
#define module_exit(fn)
#define module_param_string(n, s, l, p)
#define module_param(n, t, p)
#define MODULE_PARM_DESC(n, d)
#define __init
#define __exit
#define __user
#define unlikely(x) __builtin_expect(!!(x), 0)
#define likely(x) __builtin_expect(!!(x), 1)
#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
#define KSYM_NAME_LEN 512

#pragma GCC visibility pop
#endif
