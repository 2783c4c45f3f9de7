/*
 * The platform half of the runtime's interface, included by the generic core
 * (kp_internal.h): a Linux kernel image, whatever the CPU.  The CPU's half
 * (per-CPU data, the preempt count, interrupt flags, the #BP hook) is the
 * arch's kp_arch_platform.h (runtime/arch/<arch>/linux_kernel/), included here.
 *
 * The runtime is linked at the address it runs at, inside the kernel image,
 * and calls the kernel's own functions by their kallsyms addresses (resolved
 * at link time by rewriter/link/ld.py).  It is never started
 * (KP_PLATFORM_NO_STARTUP): the runtime's own probes (the boot hooks) are ready
 * from the first instruction of boot, and the probe tables are built from
 * compact records at the setup_per_cpu_areas() hook (KP_PLATFORM_TABLES_AT_BOOT,
 * platform.c), from where every probe fires.  The "thread" of the core is the CPU, as the kernel's
 * current_kprobe is per-CPU: its key is the CPU's number, read with
 * preemption disabled around the dispatch, so a hit while a handler runs on
 * the same CPU counts as missed.
 */
#ifndef _KP_PLATFORM_H
#define _KP_PLATFORM_H
#pragma GCC visibility push(hidden)

#include <kp_arch_platform.h>

#define KP_PLATFORM_NO_STARTUP 1
#define KP_PLATFORM_TABLES_AT_BOOT 1

/* --- the kernel's own functions and per-CPU variables (kallsyms) --- */

int _printk(const char *fmt, ...);
long long ktime_get(void);
long copy_from_kernel_nofault(void *dst, const void *src, unsigned long size);
int set_memory_ro(unsigned long addr, int numpages);
int __cond_resched(void);
const char *kallsyms_lookup(unsigned long addr, unsigned long *symbolsize, unsigned long *offset,
			    char **modname, char *namebuf);
extern unsigned int nr_cpu_ids;
/* The kernel's first byte: the generated tables write the image's addresses as
 * _text + offset, relocated with the kernel when KASLR moves it. */
extern char _text[];

/* --- breakpoint probes: the kernel's breakpoint trap (the arch's hook: x86-64's
 * linux_kernel/kp_int3_hook.c, rewriter/arch/<arch>/toolchain.py's
 * RUNTIME_FILES["breakpoint_hook"]) --- */

/* The arch's hook has a C half (x86-64's kp_arch_int3_bp()): entered in place of the
 * kernel's kprobe breakpoint handler, it goes on into the rest of it when a
 * breakpoint is not ours (kp_kernel_breakpoint_next, the arch's hook: on x86-64,
 * kprobe_int3_handler() past its ftrace site). */
#define KP_PLATFORM_BREAKPOINT_HOOK 1
struct pt_regs;
int kp_kernel_breakpoint_next(struct pt_regs *regs);
static inline int kp_platform_breakpoint_not_ours(struct pt_regs *regs)
{
	return kp_kernel_breakpoint_next(regs);
}

#define KP_KERN_INFO "\001" "6"	/* KERN_INFO */
#define KP_KERN_ERR "\001" "3"	/* KERN_ERR */

/* --- thread identity: the CPU --- */

/* The running CPU's slot in kp_thread_table[]: smp_processor_id() + 1, the
 * same from the first instruction of boot on (cpu_number is 0 on the boot CPU
 * before its per-CPU area exists). */
static inline unsigned long kp_platform_cpu_slot(void)
{
	return kp_arch_cpu_index() + 1;
}

/* The key of the CPU's block: its slot << 12, so that KP_HASH() is the slot
 * (never 0, which is "no thread yet"). */
static inline unsigned long kp_platform_thread_key_fast(void)
{
	return kp_platform_cpu_slot() << 12;
}

static inline unsigned long kp_platform_thread_key(void)
{
	return kp_platform_thread_key_fast();
}

/* this_cpu_ptr()'s offset, for the kernel's per-CPU data (perf's lists). */
static inline unsigned long kp_platform_this_cpu_off(void)
{
	return kp_arch_this_cpu_off();
}

static inline int kp_platform_thread_key_ready(void)
{
	return 1;
}

/* optimized_callback()'s preempt_disable()/preempt_enable(): the key is the
 * CPU's, so the dispatch must not move to another CPU.  On the way out a
 * pending reschedule is taken as preempt_enable() takes it. */
static inline void kp_platform_dispatch_begin(void)
{
	kp_arch_preempt_disable();
}

static inline void kp_platform_dispatch_end(void)
{
	kp_arch_preempt_enable();
}

/* --- memory, output, time (platform.c) --- */

/* kprewrite.enabled (kp_debugfs.c): disarm (0) or arm every probe but the runtime's own. */
extern int kp_kernel_disarmed;
void kp_kernel_arm(int on);

void *kp_platform_alloc(unsigned long size);	/* zeroed, from a static pool; NULL when it is used up */
void kp_platform_write(int fd, const char *buf, unsigned long len);	/* one printk line */
int kp_platform_open_append(const char *path);
void kp_platform_close(int fd);
unsigned long kp_platform_ncpus(void);
long long kp_platform_ktime(void);

/* The boot CPU's first block and the size of one (struct kp_thread and the
 * hit counters), generated with the probe table (rewriter/targets/linux_kernel). */
extern unsigned long kp_kernel_pool[];
extern const unsigned long kp_kernel_pool_size, kp_kernel_block;
void *memblock_alloc_try_nid(unsigned long size, unsigned long align, unsigned long min_addr,
			     unsigned long max_addr, int nid);
/* kretprobes' instance pools, from memblock at the setup_per_cpu_areas() hook
 * (kp_kretprobe_task.c). */
void kp_kernel_kretprobes_init(void);
/* The breakpoint sites' breakpoints, written at the sched_init_smp() hook (the arch's
 * breakpoint hook file; the kernel's arch_arm_kprobe()). */
void kp_arch_arm_breakpoints(void);
/* The text/rodata gap, PFN_ALIGN(_etext) .. __start_rodata, which holds our code and data. */
extern const unsigned long kp_kernel_gap_start, kp_kernel_gap_end;

/* --- the current task, for trace lines --- */

#define KP_TASK_COMM_LEN 16

/* The task's name and pid: struct task_struct's layout from the image's BTF,
 * generated with the probe table (-1: no BTF, trace lines say "kernel"). */
extern const long kp_kernel_task_comm, kp_kernel_task_pid;
char *kp_kernel_current(void);

static inline void kp_platform_task_comm(char *comm)
{
	const char *s = kp_kernel_task_comm < 0 ? "kernel" : kp_kernel_current() + kp_kernel_task_comm;
	int i;
	for (i = 0; i < KP_TASK_COMM_LEN - 1 && s[i]; i++)
		comm[i] = s[i];
	comm[i] = 0;
}

static inline int kp_platform_task_pid(void)
{
	return kp_kernel_task_pid < 0 ? 0 : *(int *)(kp_kernel_current() + kp_kernel_task_pid);
}

static inline unsigned int kp_platform_cpu(void)
{
	return kp_arch_smp_processor_id();
}

/* A trace line written whole (before the ring buffer exists): the ring buffer's
 * own default clock, trace_clock_local() (sched_clock()), which also runs before
 * timekeeping_init(), where ktime_get() would read a clocksource not yet set. */
unsigned long long trace_clock_local(void);

struct kp_timespec { long sec, nsec; };
static inline void kp_platform_trace_clock(struct kp_timespec *ts)
{
	long long ns = (long long)trace_clock_local();
	ts->sec = ns / 1000000000;
	ts->nsec = ns % 1000000000;
}

/* copy_from_kernel_nofault(): 0, or non-zero if any byte cannot be read. */
static inline int kp_platform_copy_nofault(void *dst, unsigned long addr, unsigned long len, int tid)
{
	(void)tid;
	return len ? (int)copy_from_kernel_nofault(dst, (const void *)addr, len) : 0;
}

/* --- trace events (kp_trace_buffer.c): kprobe_events' fetch args and output --- */

/* copy_from_user_nofault(): `ustring`, `+u0(...)` and the u-types read user
 * memory as the kernel's FETCH_OP_UDEREF and FETCH_OP_ST_USTRING do (access_ok(),
 * page faults disabled: a bad pointer reads as (fault)). */
long copy_from_user_nofault(void *dst, const void *src, unsigned long size);

static inline int kp_platform_copy_user_nofault(void *dst, unsigned long addr, unsigned long len, int tid)
{
	(void)tid;
	return len ? (int)copy_from_user_nofault(dst, (const void *)addr, len) : 0;
}

/* symbol/symstr types and return addresses read the running kernel's kallsyms
 * (sprint_symbol(), as %pS), not a table compiled in: every function of a kernel
 * would not fit the gap, and kallsyms knows the KASLR base and modules. */
#define KP_PLATFORM_KALLSYMS 1
/* A hit's record is built on the stack of the probed function (16 KiB kernel stacks,
 * deep call chains): 1.5 KiB, not user space's 2; a line (printed when the trace is read,
 * or at the hit before the ring buffer exists) 1 KiB; longer ones end in "...". */
#define KP_PLATFORM_TRACE_LINE 1024
#define KP_PLATFORM_TRACE_REC 1536
#define KP_PLATFORM_SYM_LEN 768		/* >= KSYM_SYMBOL_LEN */
int kp_platform_symbol(char *buf, unsigned long addr, int with_offset);

/* A hit's record into the kernel's ftrace ring buffer as an entry of the event's own
 * output type (registered at boot, printed when the trace is read): 1 when the buffer
 * took it or tracing is set to drop it, 0 when there is no buffer or no type (early boot)
 * and the caller prints the line now (kp_platform_trace_buffer()). */
#define KP_PLATFORM_TRACE_RECORD 1
struct kp_trace_event;
struct pt_regs;
int kp_platform_trace_record(const struct kp_trace_event *ev, struct pt_regs *regs, unsigned long ip,
			     unsigned long ret_addr, const unsigned char *rec, unsigned long len);
/* 0 when no instance has the event enabled (its tracefs `enable`): the hit fetches
 * nothing, as kprobe_dispatcher() tests TP_FLAG_TRACE first. */
#define KP_PLATFORM_TRACE_WANTED 1
int kp_platform_trace_wanted(const struct kp_trace_event *ev);
/* The output types, registered at the setup_per_cpu_areas() boot hook; the events'
 * trace_event_calls (events/kprobes/<EVENT>/, enabled) at the console_on_rootfs() hook
 * (may sleep), with the kernel's cmdline recording for them. */
void kp_kernel_trace_init(void);
void kp_kernel_trace_late(void);

/* One trace line's body ("EVENT: (SYM+off/size) name=value ...\n") into the
 * kernel's ftrace ring buffer as a trace_printk() entry (an event without a type):
 * 1 when the buffer took it or tracing is set to drop it, 0 when there is no buffer
 * yet (early boot) and the caller writes the whole line to printk. */
int kp_platform_trace_buffer(unsigned long ip, const char *body, unsigned long len);

#pragma GCC visibility pop

void kp_profile_signal_configure(const char *value);
#endif
