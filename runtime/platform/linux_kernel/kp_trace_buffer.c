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
 *
 * Each event is also a trace_event_call, as register_kprobe_event() makes one
 * (trace_probe_register_event_call(): register_trace_event() at boot, then
 * trace_add_event_call() at the console_on_rootfs() hook, when tracefs is up):
 * /sys/kernel/tracing/events/kprobes/<EVENT>/ with enable, filter, trigger,
 * format, hist and id, in every instance.  Its fields are the kernel's kprobe
 * event's (kprobe_event_define_fields(), traceprobe_define_arg_fields()):
 * __probe_ip (a kretprobe's __probe_func and __probe_ret_ip), then each fetch
 * arg at its offset, packed, with the fetch type's size and name (u8..u64,
 * s8..s64, `__data_loc char[]` for strings, TYPE[N] for arrays), so an entry
 * holds them where the kernel's would: the filter, the triggers and the hist
 * trigger read them.  The record follows them (for our .trace function), then
 * the strings the __data_loc fields point at.  The events are enabled in the
 * top instance when they are registered (as `trace_event=kprobes:<EVENT>` on
 * the command line would): until then every hit goes into the top instance's
 * buffer; from then on a hit is written for each instance whose `enable` is
 * set, through trace_event_buffer_reserve()/trace_event_buffer_commit() as
 * __kprobe_trace_func() writes it (soft-disable, pid filter, filter, triggers).
 *
 * Built with KP_MODULE_EVENTS, the same code is a kernel module's event calls
 * (rewriter/targets/linux_module/x86_64/writer.py: event_calls_c() lays the calls out
 * and the module loader registers them); what only an image does is left out there:
 * the boot-hook registration, the top instance's buffer before it, the names' recording.
 *
 * Built with KP_PLACED_AT_BOOT, the same code is the part of the runtime an arm64 Image
 * places in module memory after the initcalls (rewriter/targets/linux_kernel/aarch64/
 * runtime.py), whose kallsyms name no data (no KALLSYMS_ALL): no event_mutex (the calls are
 * added under it from dyn_event_create(), which takes it), no global_trace and no
 * tracing_disabled (the calls are registered, and their hits written, before any hit is
 * passed to it: no top-instance buffer before them; __trace_puts() tests tracing_disabled
 * itself), the output types' memory from vzalloc(), and no names recorded at the hits (the
 * kernel's recording runs from the registration on, before the first hit).
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

/* The trace_event_call's side (kernel/trace/trace_events.c, trace_events_filter.c). */
int trace_add_event_call(void *call);
int trace_define_field(void *call, const char *type, const char *name, int offset, int size, int is_signed,
		       int filter_type);
int trace_set_clr_event(const char *system, const char *event, int set);
void *trace_event_buffer_reserve(void *fbuffer, void *file, unsigned long len);
void trace_event_buffer_commit(void *fbuffer);
int event_triggers_call(void *file, void *buffer, void *rec, void *event);
_Bool trace_event_ignore_this_pid(void *file);
void synchronize_rcu(void);
void mutex_lock(void *lock);
void mutex_unlock(void *lock);
extern char event_mutex[];
void *vmalloc(unsigned long size);
void *vzalloc(unsigned long size);

/* perf's side (kernel/trace/trace_event_perf.c, kernel/events/core.c): a record in the
 * CPU's perf trace buffer, handed to the perf events on the call's per-CPU list. */
void *perf_trace_buf_alloc(int size, struct pt_regs **regs, int *rctxp);
void perf_tp_event(unsigned short event_type, unsigned long long count, void *record, int entry_size,
		   struct pt_regs *regs, void *head, int rctx, void *task);
#define KP_PERF_MAX_TRACE_SIZE 8192	/* PERF_MAX_TRACE_SIZE: perf_trace_buf_alloc() warns past it */
#ifndef KP_MODULE_EVENTS
/* kernel/trace/bpf_trace.c: the BPF programs attached to a call (call->prog_array), run
 * with the probed context's registers; 0 means "filtered out" for perf. */
unsigned int trace_call_bpf(void *call, void *ctx);
#endif

/* The layouts BTF gives (rewriter/targets/linux_kernel/btf.py: _trace_layout()), -1 when
 * unknown: the output type's first, then the trace_event_call's (all known or all -1). */
enum { KP_TR_ENTRY_SIZE, KP_TR_EVENT_SIZE, KP_TR_EVENT_TYPE, KP_TR_EVENT_FUNCS, KP_TR_ITER_SEQ,
       KP_TR_ITER_ENT, KP_TR_ITER_ENT_SIZE, KP_TR_BUFFER,
       KP_TR_CALL_SIZE, KP_TR_CALL_CLASS, KP_TR_CALL_NAME, KP_TR_CALL_EVENT, KP_TR_CALL_PRINT_FMT,
       KP_TR_CLASS_SIZE, KP_TR_CLASS_SYSTEM, KP_TR_CLASS_REG, KP_TR_CLASS_FIELDS_ARRAY, KP_TR_CLASS_FIELDS,
       KP_TR_FIELDS_SIZE, KP_TR_FIELDS_DEFINE, KP_TR_FBUF_SIZE, KP_TR_FBUF_ENTRY, KP_TR_FBUF_REGS,
       KP_TR_FILE_FLAGS, KP_TR_FL_TRIGGER_MODE, KP_TR_FL_SOFT_DISABLED, KP_TR_FL_PID_FILTER,
       KP_TR_REG_REGISTER, KP_TR_REG_UNREGISTER, KP_TR_FILTER_OTHER,
       /* perf's (btf.py: _PERF_LAYOUT), each -1 on its own when unknown: perf refused */
       KP_TR_CALL_PERF_EVENTS, KP_TR_REG_PERF_REGISTER, KP_TR_REG_PERF_UNREGISTER, KP_TR_REG_PERF_OPEN,
       KP_TR_REG_PERF_CLOSE, KP_TR_REG_PERF_ADD, KP_TR_REG_PERF_DEL,
       /* BPF's (btf.py: _BPF_LAYOUT), all known or all -1: no BPF program on the events */
       KP_TR_CALL_FLAGS, KP_TR_CALL_PROG_ARRAY, KP_TR_FL_KPROBE, KP_TR_CALL_PROBES, KP_TR_N };
extern const long kp_kernel_trace[KP_TR_N];

/* An event's trace_event_call (its struct trace_event inside: the output type), its
 * trace_event_class and fields_array (our define_fields, then the end), at most these
 * sizes (BTF's, checked at boot); the trace_event_files whose `enable` is set, as the
 * kernel's tp->event->files; the event; the type number; the fields' bytes after the
 * entry's head; whether trace_add_event_call() took it. */
#define KP_CALL_MAX 256
#define KP_CLASS_MAX 128
#define KP_FIELDS_MAX 64
#define KP_FBUF_MAX 64
#define KP_EVENT_FILES 8	/* instances with the event enabled at once */
#define KP_TRACE_EVENT_MAX 64	/* struct trace_event alone (no trace_event_call in BTF) */
struct kp_trace_type {
	unsigned long call[KP_CALL_MAX / 8];		/* first: a call's address is its type's */
	unsigned long class[KP_CLASS_MAX / 8];
	unsigned long fields[2][KP_FIELDS_MAX / 8];
	void *files[KP_EVENT_FILES];
	const char **types;				/* the array args' "TYPE[N]", else 0 */
	const struct kp_trace_event *ev;
	unsigned int type;
	unsigned int fixed;
	int live;
	int perf;					/* perf's registrations (TRACE_REG_PERF_REGISTER) */
};
static struct kp_trace_type *kp_trace_types;	/* per kp_trace_events[], memblock */
/* Where the struct trace_event is in ours: in the trace_event_call, or at 0 without one. */
static long kp_trace_event_at;
static int kp_trace_calls;			/* BTF gave the trace_event_call's layout */
static int kp_trace_bpf;			/* ... and BPF's: the calls take BPF programs */

/* The entry after struct trace_entry: the kernel's kprobe_trace_entry_head's ip, or
 * kretprobe_trace_entry_head's func and ret_ip; the fields follow. */
#define KP_ENTRY_IP 8
#define KP_ENTRY_HEAD(ev) ((ev)->is_return ? 24 : 16)

#ifndef KP_MODULE_EVENTS	/* a module's events (linux_module's writer.py): the kernel records names */
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
#ifdef KP_PLACED_AT_BOOT
	return;		/* the recording runs before the first hit (above) */
#endif
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
#endif

/* struct ring_buffer_event's data (rb_event_data(): the format trace_pipe_raw readers
 * parse): after a time extend, then after the header word, or after the length word
 * when the header's type_len is 0. */
static inline char *kp_rb_event_data(unsigned int *event)
{
	if ((event[0] & 31) >= 30)		/* RINGBUF_TYPE_TIME_EXTEND, _TIME_STAMP */
		event += 2;
	return (char *)(event + ((event[0] & 31) ? 1 : 2));
}

/* --- an entry: head, the fields (the kernel's layout), the record, the strings --- */

static int kp_arg_is_string(const struct kp_probe_arg *a)
{
	return a->print == KP_PRINT_STRING;
}

/* One element's bytes in the record (kp_fetch.c's kp_val_size()) and in the fields (a
 * string's: its u32 __data_loc, as the kernel's string fetch type's size). */
static unsigned int kp_arg_val_size(const struct kp_probe_arg *a)
{
	return a->size && a->size < 8 ? a->size : 8;
}

static unsigned int kp_arg_field_size(const struct kp_probe_arg *a)
{
	return kp_arg_is_string(a) ? 4 : kp_arg_val_size(a);
}

/*
 * The fields from a hit's record, as store_trace_args() stores them: each value at its
 * offset (0 for a fault, as the kernel leaves one unset), each string NUL-terminated after
 * the record behind a __data_loc word (length << 16 | offset from the entry's start; a
 * fault's length 0).  With entry 0, only the entry's size.
 */
static unsigned long kp_entry_put(const struct kp_trace_type *t, char *entry, const unsigned char *rec,
				  unsigned long len)
{
	const struct kp_trace_event *ev = t->ev;
	unsigned long off = KP_ENTRY_HEAD(ev), dyn = off + t->fixed + 4 + len;
	const unsigned char *p = rec, *end = rec + len;
	for (unsigned int i = 0; i < ev->nargs; i++) {
		const struct kp_probe_arg *a = &ev->args[i];
		unsigned int n = a->count ? a->count : 1, fsize = kp_arg_field_size(a), vsize = kp_arg_val_size(a);
		int none = p >= end || *p == KP_REC_ARG_FAULT;
		if (p < end && *p == KP_REC_ARG_FAULT)
			p++;
		for (unsigned int k = 0; k < n; k++, off += fsize) {
			unsigned long v = 0, slen = 0;
			const unsigned char *str = 0;
			if (!none && p < end) {
				switch (*p++) {
				case KP_REC_VAL:
					if ((unsigned long)(end - p) >= vsize)
						memcpy(&v, p, vsize);
					p += vsize;
					break;
				case KP_REC_FAULT:
					break;
				case KP_REC_STR:
					if (end - p >= 2)
						slen = p[0] | (unsigned long)p[1] << 8;
					if ((unsigned long)(end - p) < 2 + slen) {
						p = end;
						break;
					}
					str = p + 2;
					p += 2 + slen;
					break;
				default:
					p = end;
				}
			}
			if (!kp_arg_is_string(a)) {
				if (entry)
					memcpy(entry + off, &v, fsize);
				continue;
			}
			unsigned int loc = (unsigned int)(str ? (slen + 1) << 16 : 0) | (unsigned int)(dyn & 0xffff);
			if (entry) {
				memcpy(entry + off, &loc, 4);
				if (str) {
					memcpy(entry + dyn, str, slen);
					entry[dyn + slen] = 0;
				}
			}
			if (str)
				dyn += slen + 1;
		}
	}
	if (entry) {
		unsigned int n = (unsigned int)len;
		memcpy(entry + off, &n, 4);
		memcpy(entry + off + 4, rec, len);
	}
	return dyn;
}

/* The entry after struct trace_entry: kprobe_trace_entry_head's ip, or
 * kretprobe_trace_entry_head's func and ret_ip; then the fields, the record, the strings. */
static void kp_entry_fill(const struct kp_trace_type *t, char *entry, unsigned long ip, unsigned long ret_addr,
			  const unsigned char *rec, unsigned long len)
{
	*(unsigned long *)(entry + KP_ENTRY_IP) = ip;
	if (t->ev->is_return)
		*(unsigned long *)(entry + 16) = ret_addr;
	kp_entry_put(t, entry, rec, len);
}

/* __kprobe_trace_func(): one instance's entry, through the event's trace_event_file. */
static void kp_trace_file(const struct kp_trace_type *t, void *file, struct pt_regs *regs, unsigned long ip,
			  unsigned long ret_addr, const unsigned char *rec, unsigned long len, unsigned long size)
{
	/* trace_trigger_soft_disabled() */
	unsigned long flags = *(volatile unsigned long *)((char *)file + kp_kernel_trace[KP_TR_FILE_FLAGS]);
	unsigned long trigger = 1UL << kp_kernel_trace[KP_TR_FL_TRIGGER_MODE];
	unsigned long soft = 1UL << kp_kernel_trace[KP_TR_FL_SOFT_DISABLED];
	unsigned long pid = 1UL << kp_kernel_trace[KP_TR_FL_PID_FILTER];
	if (flags & (trigger | soft | pid)) {
		if (flags & trigger)
			event_triggers_call(file, 0, 0, 0);
		if (flags & soft)
			return;
		if ((flags & pid) && trace_event_ignore_this_pid(file))
			return;
	}
	unsigned long fbuffer[KP_FBUF_MAX / 8];
	/* NULL: tracing_on is 0, the buffer is full (overwrite off), the pid filter, a nested
	 * reserve on this CPU in the same context: dropped, as the kernel drops its own. */
	char *entry = trace_event_buffer_reserve(fbuffer, file, size);
	if (!entry)
		return;
	*(struct pt_regs **)((char *)fbuffer + kp_kernel_trace[KP_TR_FBUF_REGS]) = regs;
	kp_entry_fill(t, entry, ip, ret_addr, rec, len);
	/* the filter (discarded if it does not match), the triggers, the commit */
	trace_event_buffer_commit(fbuffer);
}

/* kprobe_perf_func(): the entry for the perf events on this CPU's list of the call's
 * (perf_trace_event_reg() made call->perf_events before TRACE_REG_PERF_REGISTER), in
 * perf's per-CPU buffer; perf_tp_event() fills in struct trace_entry, applies each
 * event's filter and counts or samples it with the probed context's registers. */
static void kp_trace_perf(const struct kp_trace_type *t, struct pt_regs *regs, unsigned long ip,
			  unsigned long ret_addr, const unsigned char *rec, unsigned long len, unsigned long size)
{
	if (!regs)	/* never: an event's hit passes pt_regs (Rules.events_pt_regs), which perf reads */
		return;
#ifndef KP_MODULE_EVENTS
	/* bpf_prog_array_valid(): the programs first, on every hit while perf holds the
	 * event (they run whether or not a perf event is on this CPU's list); one that
	 * returns 0 keeps the hit from perf, as in kprobe_perf_func(). */
	if (kp_trace_bpf
	    && __atomic_load_n((void **)((char *)t->call + kp_kernel_trace[KP_TR_CALL_PROG_ARRAY]), __ATOMIC_RELAXED)
	    && !trace_call_bpf((void *)t->call, regs))
		return;
#endif
	void *pcpu = __atomic_load_n((void **)((char *)t->call + kp_kernel_trace[KP_TR_CALL_PERF_EVENTS]),
				     __ATOMIC_ACQUIRE);
	if (!pcpu)
		return;
	void **head = (void **)((char *)pcpu + kp_platform_this_cpu_off());
	if (!__atomic_load_n(head, __ATOMIC_RELAXED))		/* hlist_empty() */
		return;
	/* perf puts a u32 size before the record: the two end 8-aligned */
	unsigned long psize = ((size + 4 + 7) & ~7UL) - 4;
	if (psize > KP_PERF_MAX_TRACE_SIZE)
		return;
	int rctx;
	char *entry = perf_trace_buf_alloc((int)psize, 0, &rctx);
	if (!entry)		/* perf's recursion in this context */
		return;
	kp_entry_fill(t, entry, ip, ret_addr, rec, len);
	perf_tp_event((unsigned short)t->type, 1, entry, (int)psize, regs, head, rctx, 0);
}

int kp_platform_trace_wanted(const struct kp_trace_event *ev)
{
	struct kp_trace_type *types = __atomic_load_n(&kp_trace_types, __ATOMIC_ACQUIRE);
	if (!types)
		return 1;
	struct kp_trace_type *t = &types[ev->index];
	if (!__atomic_load_n(&t->live, __ATOMIC_ACQUIRE))
		return 1;
	for (unsigned int i = 0; i < KP_EVENT_FILES; i++)
		if (__atomic_load_n(&t->files[i], __ATOMIC_RELAXED))
			return 1;
	return __atomic_load_n(&t->perf, __ATOMIC_RELAXED) != 0;
}

int kp_platform_trace_record(const struct kp_trace_event *ev, struct pt_regs *regs, unsigned long ip,
			     unsigned long ret_addr, const unsigned char *rec, unsigned long len)
{
	struct kp_trace_type *types = __atomic_load_n(&kp_trace_types, __ATOMIC_ACQUIRE);
#if !defined(KP_MODULE_EVENTS) && !defined(KP_PLACED_AT_BOOT)
	if (__atomic_load_n(&tracing_disabled, __ATOMIC_RELAXED) || !types)
		return 0;
#else
	if (!types)
		return 0;
#endif
	struct kp_trace_type *t = &types[ev->index];
	unsigned int type = t->type;
	if (!type)
		return 0;
	unsigned long size = kp_entry_put(t, 0, rec, len);
	if (__atomic_load_n(&t->live, __ATOMIC_ACQUIRE)) {
		/* kprobe_trace_func(): each instance with the event enabled */
		for (unsigned int i = 0; i < KP_EVENT_FILES; i++) {
			void *file = __atomic_load_n(&t->files[i], __ATOMIC_ACQUIRE);
			if (file)
				kp_trace_file(t, file, regs, ip, ret_addr, rec, len, size);
		}
		if (__atomic_load_n(&t->perf, __ATOMIC_ACQUIRE))
			kp_trace_perf(t, regs, ip, ret_addr, rec, len, size);
		return 1;
	}
#if defined(KP_MODULE_EVENTS) || defined(KP_PLACED_AT_BOOT)
	return 0;	/* no call: the line is written (trace_printk()) */
#else
	/* Before the trace_event_call is registered: the top instance's buffer. */
	void *buffer = *(void **)(global_trace + kp_kernel_trace[KP_TR_BUFFER]);
	/* trace_event_buffer_reserve()'s context: the irq flags and the preempt count the
	 * probed code ran with (tracing_gen_ctx_dec(): our dispatch's own taken off, as the
	 * kernel takes off its kprobe handler's). */
	unsigned long flags = kp_arch_local_save_flags();
	unsigned int ctx = tracing_gen_ctx_irq_test(kp_arch_irqs_disabled_flags(flags));	/* TRACE_FLAG_IRQS_OFF */
	if (ctx & 0xf)
		ctx--;
	/* NULL: tracing_on is 0, the buffer is full (overwrite off), or a nested reserve on
	 * this CPU in the same context: dropped, as the kernel drops its own events. */
	unsigned int *event = ring_buffer_lock_reserve(buffer, size);
	if (!event)
		return 1;
	char *entry = kp_rb_event_data(event);
	/* tracing_generic_entry_update() */
	*(unsigned short *)entry = (unsigned short)type;
	entry[2] = (char)(ctx >> 16);
	entry[3] = (char)ctx;
	*(int *)(entry + 4) = kp_platform_task_pid();
	kp_entry_fill(t, entry, ip, ret_addr, rec, len);
	trace_buffer_unlock_commit_regs(global_trace, buffer, event, ctx, regs);
	kp_trace_save_cmdline();
	return 1;
#endif
}

/* trace_print_func: the line of one of our entries, when the trace is read (tracing/trace,
 * trace_pipe, ftrace_dump()): print_kprobe_event()'s text from the record. */
static int kp_trace_print(char *iter, int flags, char *event)
{
	(void)flags;
	const struct kp_trace_type *t = (const struct kp_trace_type *)(event - kp_trace_event_at);
	const struct kp_trace_event *ev = t->ev;
	char *seq = iter + kp_kernel_trace[KP_TR_ITER_SEQ];
	const unsigned char *entry = *(const unsigned char **)(iter + kp_kernel_trace[KP_TR_ITER_ENT]);
	long size = *(int *)(iter + kp_kernel_trace[KP_TR_ITER_ENT_SIZE]);
	long at = KP_ENTRY_HEAD(ev) + t->fixed;
	if (size < at + 4)
		return trace_handle_return(seq);
	unsigned int len;
	memcpy(&len, entry + at, 4);
	if ((long)len > size - at - 4)
		len = (unsigned int)(size - at - 4);
	char buf[KP_PLATFORM_TRACE_LINE];
	struct kp_line l = { buf, buf + sizeof(buf) - 1 };
	unsigned long n = kp_trace_format(&l, ev, ev->is_return ? *(const unsigned long *)(entry + 16) : 0,
					  entry + at + 4, len);
	trace_seq_putmem(seq, buf, n);
	return trace_handle_return(seq);
}

/* struct trace_event_functions: .trace ours; register_trace_event() fills the others
 * with trace_nop_print (so not const). */
static void *kp_trace_funcs[4] = { kp_trace_print };

/* --- the trace_event_call: class->reg, the fields, print_fmt --- */

#define KP_ENOSPC 28
#define KP_EOPNOTSUPP 95
#define KP_TRACE_FUNCTION_TYPE ((const char *)~0UL)

/* kprobe_register(): TRACE_REG_REGISTER/UNREGISTER add and remove an instance's
 * trace_event_file (enable_trace_kprobe(), disable_trace_kprobe(): the hits in flight
 * on other CPUs, which run with preemption off, are waited for before its file may go);
 * TRACE_REG_PERF_REGISTER/UNREGISTER count perf's users (enable_trace_kprobe(event,
 * NULL)), the other perf cases take nothing.  Where BTF did not give perf's side, perf
 * is refused: `perf record -e kprobes:<EVENT>` says so.  A BPF program attaches through
 * perf (PERF_EVENT_IOC_SET_BPF: the call is flagged TRACE_EVENT_FL_KPROBE) and runs in
 * kp_trace_perf(); not on a module's events. */
static int kp_trace_reg(void *call, int type, void *data)
{
	struct kp_trace_type *t = call;
	if (type == kp_kernel_trace[KP_TR_REG_REGISTER]) {
		for (unsigned int i = 0; i < KP_EVENT_FILES; i++)
			if (t->files[i] == data)
				return 0;
		for (unsigned int i = 0; i < KP_EVENT_FILES; i++)
			if (!t->files[i]) {
				__atomic_store_n(&t->files[i], data, __ATOMIC_RELEASE);
				return 0;
			}
		return -KP_ENOSPC;
	}
	if (type == kp_kernel_trace[KP_TR_REG_UNREGISTER]) {
		for (unsigned int i = 0; i < KP_EVENT_FILES; i++)
			if (t->files[i] == data)
				__atomic_store_n(&t->files[i], 0, __ATOMIC_RELEASE);
		synchronize_rcu();
		return 0;
	}
	if (kp_kernel_trace[KP_TR_CALL_PERF_EVENTS] < 0)
		return -KP_EOPNOTSUPP;
	if (type == kp_kernel_trace[KP_TR_REG_PERF_REGISTER]) {
		__atomic_add_fetch(&t->perf, 1, __ATOMIC_RELEASE);
		return 0;
	}
	if (type == kp_kernel_trace[KP_TR_REG_PERF_UNREGISTER]) {
		__atomic_sub_fetch(&t->perf, 1, __ATOMIC_RELEASE);
		synchronize_rcu();	/* perf frees the per-CPU lists after this */
		return 0;
	}
	if (type == kp_kernel_trace[KP_TR_REG_PERF_OPEN] || type == kp_kernel_trace[KP_TR_REG_PERF_CLOSE]
	    || type == kp_kernel_trace[KP_TR_REG_PERF_ADD] || type == kp_kernel_trace[KP_TR_REG_PERF_DEL])
		return 0;
	return -KP_EOPNOTSUPP;
}

/* The fetch type's name in `format` (trace_probe.c's probe_fetch_types[] fmttype: x and
 * char types show as the u type of their size; symbol as u64, its address). */
static const char *kp_arg_type(const struct kp_probe_arg *a, int *is_signed)
{
	static const char *const u[] = { "u8", "u16", "u32", "u64" }, *const s[] = { "s8", "s16", "s32", "s64" };
	unsigned int size = kp_arg_val_size(a), k = size == 1 ? 0 : size == 2 ? 1 : size == 4 ? 2 : 3;
	*is_signed = a->print == KP_PRINT_S || kp_arg_is_string(a);
	if (kp_arg_is_string(a))
		return "__data_loc char[]";
	return a->print == KP_PRINT_S ? s[k] : u[k];
}

/* The fetch type's print format (PRINT_TYPE_FMT_NAME()), for print_fmt. */
static const char *kp_arg_fmt(const struct kp_probe_arg *a)
{
	int wide = kp_arg_val_size(a) == 8;
	switch (a->print) {
	case KP_PRINT_S:
		return wide ? "%Ld" : "%d";
	case KP_PRINT_X:
		return wide ? "0x%Lx" : "0x%x";
	case KP_PRINT_CHAR:
		return "'%c'";
	case KP_PRINT_SYMBOL:
	case KP_PRINT_SYMSTR:
		return "%pS";
	case KP_PRINT_STRING:
		return "\\\"%s\\\"";
	default:
		return wide ? "%Lu" : "%u";
	}
}

/* kprobe_event_define_fields() / kretprobe_event_define_fields(): the entry head's
 * fields, then traceprobe_define_arg_fields()'s (types of arrays from kp_trace_names()). */

static int kp_trace_define_fields(void *call)
{
	struct kp_trace_type *t = call;
	const struct kp_trace_event *ev = t->ev;
	int other = (int)kp_kernel_trace[KP_TR_FILTER_OTHER], ret;
	if (!ev->is_return) {
		ret = trace_define_field(call, "unsigned long", "__probe_ip", 8, 8, 0, other);
	} else {
		ret = trace_define_field(call, "unsigned long", "__probe_func", 8, 8, 0, other);
		if (!ret)
			ret = trace_define_field(call, "unsigned long", "__probe_ret_ip", 16, 8, 0, other);
	}
	const char *const *types = t->types;
	int off = KP_ENTRY_HEAD(ev);
	for (unsigned int i = 0; i < ev->nargs && !ret; i++) {
		const struct kp_probe_arg *a = &ev->args[i];
		int is_signed, size = (int)(kp_arg_field_size(a) * (a->count ? a->count : 1));
		const char *type = kp_arg_type(a, &is_signed);
		if (a->count && types && types[i])
			type = types[i];
		ret = trace_define_field(call, type, a->name, off, size, is_signed, other);
		off += size;
	}
	return ret;
}

/* __set_print_fmt(): "\"(%lx) a=%u s=\\\"%s\\\"\", REC->__probe_ip, REC->a, __get_str(s)";
 * and the array fields' types "TYPE[N]" (traceprobe_parse_probe_arg_body()), after it. */
static unsigned long kp_trace_names_bound(const struct kp_trace_event *ev)
{
	unsigned long total = 128;
	for (unsigned int i = 0; i < ev->nargs; i++) {
		unsigned long n = strlen(ev->args[i].name), count = ev->args[i].count;
		total += 48 + n + (count ? count : 1) * (n + 48);
	}
	return total;
}

static void kp_trace_names(const struct kp_trace_event *ev, char *buf, unsigned long cap, const char **types)
{
	struct kp_line l = { buf, buf + cap - 1 };
	kp_line_puts(&l, ev->is_return ? "\"(%lx <- %lx)" : "\"(%lx)");
	for (unsigned int i = 0; i < ev->nargs; i++) {
		const struct kp_probe_arg *a = &ev->args[i];
		kp_line_putc(&l, ' ');
		kp_line_puts(&l, a->name);
		kp_line_putc(&l, '=');
		if (a->count)
			kp_line_putc(&l, '{');
		for (unsigned int k = 0; k < (a->count ? a->count : 1); k++) {
			if (k)
				kp_line_putc(&l, ',');
			kp_line_puts(&l, kp_arg_fmt(a));
		}
		if (a->count)
			kp_line_putc(&l, '}');
	}
	kp_line_puts(&l, ev->is_return ? "\", REC->__probe_func, REC->__probe_ret_ip" : "\", REC->__probe_ip");
	for (unsigned int i = 0; i < ev->nargs; i++) {
		const struct kp_probe_arg *a = &ev->args[i];
		for (unsigned int k = 0; k < (a->count ? a->count : 1); k++) {
			kp_line_puts(&l, kp_arg_is_string(a) ? ", __get_str(" : ", REC->");
			kp_line_puts(&l, a->name);
			if (a->count) {
				kp_line_putc(&l, '[');
				kp_line_dec(&l, k, 0, 0, 0);
				kp_line_putc(&l, ']');
			}
			if (kp_arg_is_string(a))
				kp_line_putc(&l, ')');
		}
	}
	*l.p++ = 0;		/* l.end is one before the buffer's end */
	for (unsigned int i = 0; i < ev->nargs; i++) {
		const struct kp_probe_arg *a = &ev->args[i];
		if (!a->count || l.p >= l.end)
			continue;
		int is_signed;
		types[i] = l.p;
		kp_line_puts(&l, kp_arg_type(a, &is_signed));
		kp_line_putc(&l, '[');
		kp_line_dec(&l, a->count, 0, 0, 0);
		kp_line_putc(&l, ']');
		*l.p++ = 0;
	}
}

#ifndef KP_MODULE_EVENTS	/* a module's calls are registered by the module loader */
#ifdef KP_PLACED_AT_BOOT
/* trace_add_event_call() under event_mutex, which kallsyms does not name: dyn_event_create()
 * takes it and calls its operations' create() (a struct dyn_event_operations of ours, its
 * create at kp_kernel_dyn_create: BTF), which adds the call.  Process context. */
int dyn_event_create(const char *raw_command, void *type);
extern const long kp_kernel_dyn_create;
#define KP_DYN_OPS_MAX 128
static void *kp_trace_adding;

static int kp_trace_add_locked(const char *raw_command)
{
	(void)raw_command;
	return trace_add_event_call(kp_trace_adding);
}

static int kp_trace_add_event_call(void *call)
{
	unsigned long ops[KP_DYN_OPS_MAX / 8] = { 0 };
	if (kp_kernel_dyn_create < 0 || kp_kernel_dyn_create + 8 > KP_DYN_OPS_MAX)
		return -KP_EOPNOTSUPP;
	*(void **)((char *)ops + kp_kernel_dyn_create) = (void *)kp_trace_add_locked;
	kp_trace_adding = call;
	return dyn_event_create("", ops);
}
#endif

/* trace_probe_register_event_call()'s second half, trace_add_event_call(), and the event
 * enabled in the top instance; process context, tracefs up.  0 when it did not take. */
static int kp_trace_register(struct kp_trace_type *t)
{
	const struct kp_trace_event *ev = t->ev;
	char *call = (char *)t->call;
	/* print_fmt, the array types: their size is bounded first, then they are written */
	unsigned long cap = kp_trace_names_bound(ev);
	char *mem = vmalloc(cap + (ev->nargs + 1) * sizeof(char *));
	if (!mem)
		return 0;
	const char **types = (const char **)mem;
	char *text = mem + (ev->nargs + 1) * sizeof(char *);
	for (unsigned int i = 0; i < ev->nargs; i++)
		types[i] = 0;
	kp_trace_names(ev, text, cap, types);
	t->types = types;
	*(char **)(call + kp_kernel_trace[KP_TR_CALL_PRINT_FMT]) = text;
#ifdef KP_PLACED_AT_BOOT
	int ret = kp_trace_add_event_call(call);
#else
	mutex_lock(event_mutex);
	int ret = trace_add_event_call(call);
	mutex_unlock(event_mutex);
#endif
	if (ret) {
		_printk(KP_KERN_ERR "kprewrite: trace event %s: trace_add_event_call() says %d: "
			"no events/kprobes/%s/, written to the top instance only\n", ev->name, ret, ev->name);
		return 0;
	}
	ret = trace_set_clr_event("kprobes", ev->name, 1);
	if (ret)
		_printk(KP_KERN_ERR "kprewrite: trace event %s: not enabled (%d)\n", ev->name, ret);
	__atomic_store_n(&t->live, 1, __ATOMIC_RELEASE);
	return 1;
}

/* At the setup_per_cpu_areas() hook: an output type for every event, as
 * register_kprobe_event() registers each tracefs kprobe event's (its trace_event_call's
 * event), and the rest of the trace_event_call filled in for later.  register_trace_event()
 * only takes trace_event_sem and links the type into its hash, which needs no more of the
 * kernel than this: the types are there before early_trace_init() makes the ring buffer,
 * for the first entry. */
void kp_kernel_trace_init(void)
{
	if (!kp_ntrace_events || kp_kernel_trace[KP_TR_ENTRY_SIZE] != 8
	    || kp_kernel_trace[KP_TR_EVENT_SIZE] < 0 || kp_kernel_trace[KP_TR_EVENT_SIZE] > KP_TRACE_EVENT_MAX)
		return;
	kp_trace_calls = kp_kernel_trace[KP_TR_CALL_SIZE] > 0 && kp_kernel_trace[KP_TR_CALL_SIZE] <= KP_CALL_MAX
			 && kp_kernel_trace[KP_TR_CLASS_SIZE] <= KP_CLASS_MAX
			 && kp_kernel_trace[KP_TR_FIELDS_SIZE] <= KP_FIELDS_MAX
			 && kp_kernel_trace[KP_TR_FIELDS_SIZE] >= 16
			 && kp_kernel_trace[KP_TR_FBUF_SIZE] <= KP_FBUF_MAX
			 && kp_kernel_trace[KP_TR_CALL_EVENT] + kp_kernel_trace[KP_TR_EVENT_SIZE] <= KP_CALL_MAX;
	kp_trace_event_at = kp_trace_calls ? kp_kernel_trace[KP_TR_CALL_EVENT] : 0;
#ifndef KP_MODULE_EVENTS
	kp_trace_bpf = kp_trace_calls && kp_kernel_trace[KP_TR_CALL_PERF_EVENTS] >= 0
		       && kp_kernel_trace[KP_TR_CALL_PROBES] >= kp_kernel_trace[KP_TR_CALL_SIZE]
		       && kp_kernel_trace[KP_TR_CALL_PROBES] + 16 <= KP_CALL_MAX
		       && kp_kernel_trace[KP_TR_CALL_PROG_ARRAY] + 8 <= KP_CALL_MAX;
#endif
	unsigned long size = kp_ntrace_events * sizeof(struct kp_trace_type);
#ifdef KP_PLACED_AT_BOOT
	struct kp_trace_type *types = vzalloc(size);	/* after the initcalls: no memblock */
#else
	struct kp_trace_type *types = memblock_alloc_try_nid(size, 64, 0, 0, -1);
#endif
	if (!types) {
		_printk(KP_KERN_ERR "kprewrite: no memory for %u trace events' output types: "
			"they are written as trace_printk() lines\n", kp_ntrace_events);
		return;
	}
	unsigned int failed = 0;
	for (unsigned int i = 0; i < kp_ntrace_events; i++) {
		struct kp_trace_type *t = &types[i];
		char *call = (char *)t->call;
		char *event = call + kp_trace_event_at;
		t->ev = kp_trace_events[i];
		*(int *)(event + kp_kernel_trace[KP_TR_EVENT_TYPE]) = 0;	/* a dynamic type */
		*(void ***)(event + kp_kernel_trace[KP_TR_EVENT_FUNCS]) = kp_trace_funcs;
		unsigned int fixed = 0;
		for (unsigned int k = 0; k < t->ev->nargs; k++) {
			const struct kp_probe_arg *a = &t->ev->args[k];
			fixed += kp_arg_field_size(a) * (a->count ? a->count : 1);
		}
		t->fixed = fixed;
		if (kp_trace_calls) {
			/* trace_probe_init(), init_trace_event_call(): the class (system "kprobes",
			 * its reg, the fields_array with our define_fields), the call's name */
			char *class = (char *)t->class, *fields = (char *)t->fields[0];
			*(const char **)(class + kp_kernel_trace[KP_TR_CLASS_SYSTEM]) = "kprobes";
			*(void **)(class + kp_kernel_trace[KP_TR_CLASS_REG]) = (void *)kp_trace_reg;
			*(void **)(class + kp_kernel_trace[KP_TR_CLASS_FIELDS_ARRAY]) = fields;
			char *head = class + kp_kernel_trace[KP_TR_CLASS_FIELDS];	/* INIT_LIST_HEAD() */
			((void **)head)[0] = head;
			((void **)head)[1] = head;
			*(const char **)fields = KP_TRACE_FUNCTION_TYPE;
			*(void **)(fields + kp_kernel_trace[KP_TR_FIELDS_DEFINE]) = (void *)kp_trace_define_fields;
			*(char **)(call + kp_kernel_trace[KP_TR_CALL_CLASS]) = class;
			*(const char **)(call + kp_kernel_trace[KP_TR_CALL_NAME]) = t->ev->name;
			if (kp_trace_bpf) {
				/* a kprobe event's flag (BPF_PROG_TYPE_KPROBE programs attach), and
				 * where the kernel would find a trace_probe_event's probes: empty */
				*(int *)(call + kp_kernel_trace[KP_TR_CALL_FLAGS]) |= (int)kp_kernel_trace[KP_TR_FL_KPROBE];
				char *probes = call + kp_kernel_trace[KP_TR_CALL_PROBES];
				((void **)probes)[0] = probes;
				((void **)probes)[1] = probes;
			}
		}
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
 * At the console_on_rootfs() hook (process context, initcalls done, tracefs up, before
 * /init): each event's trace_event_call registered and enabled in the top instance
 * (kp_trace_register()).  Enabling starts the kernel's cmdline recording for it, as for
 * any event (__ftrace_event_enable_disable(): tracing_start_cmdline_record(), the
 * sched_switch and sched_wakeup probes: every entry's commit sets the CPU's
 * trace_taskinfo_save, and the next context switch saves the tasks' names).  Events
 * without a trace_event_call stay always enabled: the recording is started for them here
 * and runs until power-off; the hits save none themselves from here on.
 */
void kp_kernel_trace_late(void)
{
	if (!kp_ntrace_events || __atomic_load_n(&kp_trace_cmdline_recording, __ATOMIC_RELAXED))
		return;
	unsigned int live = 0;
	struct kp_trace_type *types = __atomic_load_n(&kp_trace_types, __ATOMIC_ACQUIRE);
	if (types && kp_trace_calls)
		for (unsigned int i = 0; i < kp_ntrace_events; i++)
			if (types[i].type)
				live += (unsigned int)kp_trace_register(&types[i]);
	if (live < kp_ntrace_events)
		tracing_start_cmdline_record();
	__atomic_store_n(&kp_trace_cmdline_recording, 1, __ATOMIC_RELEASE);
}

int kp_platform_trace_buffer(unsigned long ip, const char *body, unsigned long len)
{
#ifdef KP_PLACED_AT_BOOT
	__trace_puts(ip, body, (int)len);	/* which tests tracing_disabled */
	return 1;
#else
	if (__atomic_load_n(&tracing_disabled, __ATOMIC_RELAXED))
		return 0;
	/* 0 written also means dropped as the kernel drops trace_printk(): tracing_on
	 * off, the trace_printk option off, a full buffer in overwrite-off mode. */
	if (__trace_puts(ip, body, (int)len))
		kp_trace_save_cmdline();
	return 1;
#endif
}

/* %pS / %ps: "sym+0xoff/0xsize" (or "0xADDR"), modules included. */
int kp_platform_symbol(char *buf, unsigned long addr, int with_offset)
{
	return with_offset ? sprint_symbol(buf, addr) : sprint_symbol_no_offset(buf, addr);
}
#endif
