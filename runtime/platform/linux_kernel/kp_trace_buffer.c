/*
 * Trace events in a kernel: entries in the kernel's own ftrace ring buffer,
 * symbols from the running kernel's kallsyms.
 *
 * As the kernel's kprobe events (trace_kprobe.c), each event of ours has an
 * output type of its own (a struct trace_event, register_trace_event() at boot)
 * whose entries hold a binary record: struct trace_entry, the probe's address
 * (a kretprobe's: the function's, then the return address), then the fetched
 * values (kp_trace.h), written at each hit as __kprobe_trace_func() writes its
 * kprobe_trace_entry_head and store_trace_args() its fields.  The text is made
 * only when the trace is read, by the type's .trace function, which prints what
 * print_kprobe_event()/print_kretprobe_event() print.  So
 * `cat /sys/kernel/tracing/trace` shows the kernel's context and then
 *
 *     init-1  [001] .....  5.123456: kp_open: (do_sys_openat2+0x0/0x1a0) file="/etc/passwd"
 *
 * between the kernel's own events, as a tracefs kprobe event's line; trace_pipe,
 * the snapshot and tracing_on apply to it.  Before early_trace_init() has
 * allocated the buffer (from setup_per_cpu_areas(), when the tables are built,
 * until a little later in start_kernel()), the line goes to printk whole, with
 * the context kp_trace.c prints for user space; an event whose type could not
 * be registered writes its text as trace_printk() does (__trace_puts(): a
 * TRACE_PRINT entry behind the probe's symbol).
 */
#include "kp_trace.h"

int __trace_puts(unsigned long ip, const char *str, int size);
void tracing_record_cmdline(void *task);
int sprint_symbol(char *buffer, unsigned long address);
int sprint_symbol_no_offset(char *buffer, unsigned long address);
int register_trace_event(void *event);
unsigned int tracing_gen_ctx_irq_test(unsigned int irqs_status);
void *ring_buffer_lock_reserve(void *buffer, unsigned long length);
void trace_buffer_unlock_commit_regs(void *tr, void *buffer, void *event, unsigned int trace_ctx,
				     struct pt_regs *regs);
void trace_seq_putmem(void *s, const void *mem, unsigned int len);
int trace_handle_return(void *s);
/* kernel/trace/trace.c: 1 until tracer_alloc_buffers() (early_trace_init()) has
 * made global_trace's ring buffer, or for good when that failed. */
extern int tracing_disabled;
/* The top-level trace instance (tracing/trace), whose array_buffer.buffer is the
 * ring buffer (swapped with the snapshot's: read at every hit, as __trace_puts() does). */
extern char global_trace[];

/* The layouts BTF gives (rewriter/targets/linux_kernel/btf.py), -1 when unknown. */
extern const long kp_kernel_trace[8];
enum { KP_TR_ENTRY_SIZE, KP_TR_EVENT_SIZE, KP_TR_EVENT_TYPE, KP_TR_EVENT_FUNCS, KP_TR_ITER_SEQ,
       KP_TR_ITER_ENT, KP_TR_ITER_ENT_SIZE, KP_TR_BUFFER };

/* An event's output type: a struct trace_event (its layout from BTF, at most
 * KP_TRACE_EVENT_MAX bytes), the event, the type number. */
#define KP_TRACE_EVENT_MAX 64
struct kp_trace_type {
	unsigned long event[KP_TRACE_EVENT_MAX / 8];
	const struct kp_trace_event *ev;
	unsigned int type;
};
static struct kp_trace_type *kp_trace_types;	/* per kp_trace_events[], memblock */

/* The entry after struct trace_entry: the kernel's kprobe_trace_entry_head's ip, or
 * kretprobe_trace_entry_head's func and ret_ip; the record follows. */
#define KP_ENTRY_IP 8
#define KP_ENTRY_HEAD(ev) ((ev)->is_return ? 24 : 16)

void tracing_start_cmdline_record(void);

/* Set once the kernel's own cmdline recording runs for our events (kp_kernel_trace_late()). */
static int kp_trace_cmdline_recording;

/* The task (pointer, pid, name) each CPU saved last, and the lines since: saving costs
 * some 170 instructions a hit (a third of the line's cost), so the same task with the
 * same name hitting again on the same CPU is saved again only every KP_COMM_RESAVE
 * lines (other tasks' names may have pushed it out of saved_cmdlines meanwhile). */
#define KP_COMM_CPUS 64
#define KP_COMM_RESAVE 256
static struct {
	void *task;
	unsigned long comm[2];		/* TASK_COMM_LEN bytes */
	int pid;
	unsigned int lines;
} __attribute__((aligned(64))) kp_comm_saved[KP_COMM_CPUS];

/* The task's name for the trace file's COMM-PID column (else "<...>"), saved at the hit
 * until the kernel's own recording runs (kp_kernel_trace_late()), as its sched_switch
 * probe saves it after an event.  The dispatch runs with preemption off, so this CPU's
 * slot is ours. */
static void kp_trace_save_cmdline(void)
{
	if (__atomic_load_n(&kp_trace_cmdline_recording, __ATOMIC_RELAXED))
		return;
	char *task = kp_kernel_current();
	unsigned int cpu = kp_platform_cpu();
	if (cpu < KP_COMM_CPUS && kp_kernel_task_comm >= 0) {
		int pid = kp_platform_task_pid();
		unsigned long c0, c1;
		__builtin_memcpy(&c0, task + kp_kernel_task_comm, 8);
		__builtin_memcpy(&c1, task + kp_kernel_task_comm + 8, 8);
		typeof(kp_comm_saved[0]) *saved = &kp_comm_saved[cpu];
		if (saved->task == task && saved->pid == pid && saved->comm[0] == c0 && saved->comm[1] == c1
		    && ++saved->lines < KP_COMM_RESAVE)
			return;
		saved->task = task;
		saved->pid = pid;
		saved->comm[0] = c0;
		saved->comm[1] = c1;
		saved->lines = 0;
	}
	tracing_record_cmdline(task);
}

/* struct ring_buffer_event's data (rb_event_data(): the format trace_pipe_raw readers
 * parse): after a time extend, then after the header word, or after the length word
 * when the header's type_len is 0. */
static inline char *kp_rb_event_data(unsigned int *event)
{
	if ((event[0] & 31) >= 30)		/* RINGBUF_TYPE_TIME_EXTEND, _TIME_STAMP */
		event += 2;
	return (char *)(event + ((event[0] & 31) ? 1 : 2));
}

int kp_platform_trace_record(const struct kp_trace_event *ev, struct pt_regs *regs, unsigned long ip,
			     unsigned long ret_addr, const unsigned char *rec, unsigned long len)
{
	if (__atomic_load_n(&tracing_disabled, __ATOMIC_RELAXED) || !kp_trace_types)
		return 0;
	unsigned int type = kp_trace_types[ev->index].type;
	if (!type)
		return 0;
	void *buffer = *(void **)(global_trace + kp_kernel_trace[KP_TR_BUFFER]);
	unsigned long head = KP_ENTRY_HEAD(ev);
	/* trace_event_buffer_reserve()'s context: the irq flags and the preempt count the
	 * probed code ran with (tracing_gen_ctx_dec(): our dispatch's own taken off, as the
	 * kernel takes off its kprobe handler's). */
	unsigned long flags = kp_arch_local_save_flags();
	unsigned int ctx = tracing_gen_ctx_irq_test(kp_arch_irqs_disabled_flags(flags));	/* TRACE_FLAG_IRQS_OFF */
	if (ctx & 0xf)
		ctx--;
	/* NULL: tracing_on is 0, the buffer is full (overwrite off), or a nested reserve on
	 * this CPU in the same context: dropped, as the kernel drops its own events. */
	unsigned int *event = ring_buffer_lock_reserve(buffer, head + len);
	if (!event)
		return 1;
	char *entry = kp_rb_event_data(event);
	/* tracing_generic_entry_update() */
	*(unsigned short *)entry = (unsigned short)type;
	entry[2] = (char)(ctx >> 16);
	entry[3] = (char)ctx;
	*(int *)(entry + 4) = kp_platform_task_pid();
	*(unsigned long *)(entry + KP_ENTRY_IP) = ip;
	if (ev->is_return)
		*(unsigned long *)(entry + 16) = ret_addr;
	memcpy(entry + head, rec, len);
	trace_buffer_unlock_commit_regs(global_trace, buffer, event, ctx, regs);
	kp_trace_save_cmdline();
	return 1;
}

/* trace_print_func: the line of one of our entries, when the trace is read (tracing/trace,
 * trace_pipe, ftrace_dump()): print_kprobe_event()'s text from the record. */
static int kp_trace_print(char *iter, int flags, char *event)
{
	(void)flags;
	const struct kp_trace_event *ev = ((struct kp_trace_type *)event)->ev;
	char *seq = iter + kp_kernel_trace[KP_TR_ITER_SEQ];
	const unsigned char *entry = *(const unsigned char **)(iter + kp_kernel_trace[KP_TR_ITER_ENT]);
	long size = *(int *)(iter + kp_kernel_trace[KP_TR_ITER_ENT_SIZE]);
	long head = KP_ENTRY_HEAD(ev);
	if (size < head)
		return trace_handle_return(seq);
	char buf[KP_PLATFORM_TRACE_LINE];
	struct kp_line l = { buf, buf + sizeof(buf) - 1 };
	unsigned long n = kp_trace_format(&l, ev, ev->is_return ? *(const unsigned long *)(entry + 16) : 0,
					  entry + head, size - head);
	trace_seq_putmem(seq, buf, n);
	return trace_handle_return(seq);
}

/* struct trace_event_functions: .trace ours; register_trace_event() fills the others
 * with trace_nop_print (so not const). */
static void *kp_trace_funcs[4] = { kp_trace_print };

/* At the setup_per_cpu_areas() hook: an output type for every event, as
 * register_kprobe_event() registers each tracefs kprobe event's (its trace_event_call's
 * event).  register_trace_event() only takes trace_event_sem and links the type into
 * its hash, which needs no more of the kernel than this: the types are there before
 * early_trace_init() makes the ring buffer, for the first entry. */
void kp_kernel_trace_init(void)
{
	if (!kp_ntrace_events || kp_kernel_trace[KP_TR_ENTRY_SIZE] != 8
	    || kp_kernel_trace[KP_TR_EVENT_SIZE] < 0 || kp_kernel_trace[KP_TR_EVENT_SIZE] > KP_TRACE_EVENT_MAX)
		return;
	unsigned long size = kp_ntrace_events * sizeof(struct kp_trace_type);
	struct kp_trace_type *types = memblock_alloc_try_nid(size, 64, 0, 0, -1);
	if (!types) {
		_printk(KP_KERN_ERR "kprewrite: no memory for %u trace events' output types: "
			"they are written as trace_printk() lines\n", kp_ntrace_events);
		return;
	}
	unsigned int failed = 0;
	for (unsigned int i = 0; i < kp_ntrace_events; i++) {
		struct kp_trace_type *t = &types[i];
		char *event = (char *)t->event;
		t->ev = kp_trace_events[i];
		*(int *)(event + kp_kernel_trace[KP_TR_EVENT_TYPE]) = 0;	/* a dynamic type */
		*(void ***)(event + kp_kernel_trace[KP_TR_EVENT_FUNCS]) = kp_trace_funcs;
		int type = register_trace_event(event);
		t->type = type > 0 ? (unsigned int)type : 0;
		failed += !t->type;
	}
	if (failed)
		_printk(KP_KERN_ERR "kprewrite: %u of %u trace events got no output type: "
			"they are written as trace_printk() lines\n", failed, kp_ntrace_events);
	__atomic_store_n(&kp_trace_types, types, __ATOMIC_RELEASE);
}

/*
 * At the console_on_rootfs() hook (process context, initcalls done, before /init): the
 * kernel's cmdline recording, as __ftrace_event_enable_disable() starts it for an event
 * of its own being enabled (tracing_start_cmdline_record(): the sched_switch and
 * sched_wakeup probes).  Every entry's commit (__buffer_unlock_commit()) sets the CPU's
 * trace_taskinfo_save, and the next context switch on that CPU saves the tasks' names:
 * the hits save none themselves from here on.  Our events are always enabled, so it
 * runs until power-off (the kernel's runs while any of its events is enabled).
 */
void kp_kernel_trace_late(void)
{
	if (!kp_ntrace_events || __atomic_load_n(&kp_trace_cmdline_recording, __ATOMIC_RELAXED))
		return;
	tracing_start_cmdline_record();
	__atomic_store_n(&kp_trace_cmdline_recording, 1, __ATOMIC_RELEASE);
}

int kp_platform_trace_buffer(unsigned long ip, const char *body, unsigned long len)
{
	if (__atomic_load_n(&tracing_disabled, __ATOMIC_RELAXED))
		return 0;
	/* 0 written also means dropped as the kernel drops trace_printk(): tracing_on
	 * off, the trace_printk option off, a full buffer in overwrite-off mode. */
	if (__trace_puts(ip, body, (int)len))
		kp_trace_save_cmdline();
	return 1;
}

/* %pS / %ps: "sym+0xoff/0xsize" (or "0xADDR"), modules included. */
int kp_platform_symbol(char *buf, unsigned long addr, int with_offset)
{
	return with_offset ? sprint_symbol(buf, addr) : sprint_symbol_no_offset(buf, addr);
}
