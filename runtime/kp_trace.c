/*
 * Trace output: one line per hit of a trace event, in the format of the
 * kernel's tracing/trace file (kernel/trace/trace_output.c and
 * print_kprobe_event()/print_kretprobe_event() of trace_kprobe.c):
 *
 *     COMM-PID [CPU] SECONDS.FRACTION: EVENT: (SYM+off/size) name=value ...
 *     COMM-PID [CPU] SECONDS.FRACTION: EVENT: (CALLER+off/size <- FUNC) name=value ...
 *
 * A hit fetches its args into a binary record (kp_trace.h); the line is printed
 * from it into a buffer on the stack and written in one piece
 * (kp_platform_write()), so lines of concurrent threads never interleave.
 * COMM, PID (the thread id), CPU and the time stamp are the platform's
 * (kp_platform.h).  Output goes to standard error, or to the file named by
 * KPREWRITE_TRACE (opened for appending at start-up; "-" is standard error).
 * In a kernel the record itself goes into the ftrace ring buffer
 * (kp_platform_trace_record()), printed by kp_trace_format() only when the
 * trace is read, with the kernel's context.
 *
 * FRACTION is the kernel's six digits (microseconds), or nine (nanoseconds, as
 * `trace-cmd report -t` and `perf script --ns` print the same clock) where the
 * platform says KP_PLATFORM_TRACE_NS: a user program, whose lines are read back
 * by `kprewrite trace`/`report`, where a call graph of functions that run for
 * less than a microsecond needs the clock's full resolution.
 */
#include "kp_trace.h"

#ifdef KP_PLATFORM_TRACE_LINE
#define KP_TRACE_LINE KP_PLATFORM_TRACE_LINE
#else
#define KP_TRACE_LINE 2048
#endif
/* A hit's record (kp_trace.h): the values take more bytes than their text at most some
 * 2.25 times ("a=0 " against a tag and 8 bytes); a line of a longer record ends in "...". */
#ifdef KP_PLATFORM_TRACE_REC
#define KP_TRACE_REC KP_PLATFORM_TRACE_REC
#else
#define KP_TRACE_REC 2048
#endif

static int kp_trace_fd = 2;

static const char *kp_trace_getenv(char **envp, const char *name)
{
	size_t n = strlen(name);
	for (; envp && *envp; envp++)
		if (!strncmp(*envp, name, n) && (*envp)[n] == '=')
			return *envp + n + 1;
	return 0;
}

/* Start-up: where trace lines go; kprobe_profile on a signal. */
void kp_trace_configure(char **envp)
{
	kp_profile_signal_configure(kp_trace_getenv(envp, "KPREWRITE_PROFILE_SIGNAL"));
	const char *path = kp_trace_getenv(envp, "KPREWRITE_TRACE");
	if (!path || !*path || !strcmp(path, "-") || !strcmp(path, "stderr"))
		return;
	int fd = kp_platform_open_append(path);
	if (fd >= 0) {
		kp_trace_fd = fd;
		return;
	}
	static const char msg[] = "kprewrite: KPREWRITE_TRACE: cannot open the file; tracing to standard error\n";
	kp_platform_write(2, msg, sizeof(msg) - 1);
}

/* trace_print_context(): "%16s-%-7d [%03d] %5lu.%06lu: " (or %09lu: KP_PLATFORM_TRACE_NS),
 * for lines written whole. */
static void kp_trace_context(struct kp_line *l, const char *comm, int tid)
{
	struct kp_timespec ts = { 0, 0 };
	unsigned int cpu = kp_platform_cpu();
	kp_platform_trace_clock(&ts);
	int n = (int)strlen(comm);
	for (int i = n; i < 16; i++)
		kp_line_putc(l, ' ');
	kp_line_puts(l, comm);
	kp_line_putc(l, '-');
	kp_line_dec(l, tid, 0, 7, 1);
	kp_line_puts(l, " [");
	kp_line_dec(l, cpu / 100 % 10, 0, 0, 0);
	kp_line_dec(l, cpu / 10 % 10, 0, 0, 0);
	kp_line_dec(l, cpu % 10, 0, 0, 0);
	kp_line_puts(l, "] ");
	kp_line_dec(l, ts.sec, 0, 5, 0);
	kp_line_putc(l, '.');
#ifdef KP_PLATFORM_TRACE_NS
	unsigned long frac = ts.nsec, top = 100000000;
#else
	unsigned long frac = ts.nsec / 1000, top = 100000;
#endif
	for (unsigned long d = top; d; d /= 10)
		kp_line_putc(l, '0' + frac / d % 10);
	kp_line_puts(l, ": ");
}

/* The body of a line from a hit's record: print_kprobe_event() or print_kretprobe_event(). */
unsigned long kp_trace_format(struct kp_line *l, const struct kp_trace_event *ev, unsigned long ret_addr,
			      const unsigned char *rec, unsigned long len)
{
	char *start = l->p;
	if (!ev->is_return) {
		kp_line_put(l, ev->head, ev->head_len);
	} else {
		kp_line_puts(l, ev->name);
		kp_line_puts(l, ": (");
		kp_line_sym(l, ret_addr, 1);
		kp_line_puts(l, " <- ");
		kp_line_puts(l, ev->where);
		kp_line_putc(l, ')');
	}
	const unsigned char *p = rec, *end = rec + len;
	int cut = 0;
	for (unsigned int i = 0; i < ev->nargs && !cut; i++) {
		kp_line_putc(l, ' ');
		kp_line_puts(l, ev->args[i].name);
		kp_line_putc(l, '=');
		cut = !kp_print_arg(l, &ev->args[i], &p, end);
	}
	if (cut || l->p >= l->end) {	/* truncated: still one line */
		if (l->end - start < 3)
			return 0;
		if (l->p > l->end - 3)
			l->p = l->end - 3;
		kp_line_puts(l, "...");
		l->p = l->end;
	}
	*l->p++ = '\n';		/* l->end is one before the buffer's end */
	return l->p - start;
}

/* The body (print_kprobe_event(): "EVENT: (SYM+off/size) name=value ...") is
 * built after room for the context; the context is put in front and the whole line
 * written. */
#define KP_TRACE_CONTEXT 64	/* >= the longest context: 16 + 1 + 7 + 7 + 20 + 1 + 9 + 2 */

static __attribute__((noinline)) void kp_trace_write(const struct kp_trace_event *ev, struct kp_fetch_ctx *c,
						     unsigned long ip, unsigned long ret_addr,
						     const unsigned char *rec, unsigned long len)
{
	char buf[KP_TRACE_LINE];
	char *body = buf + KP_TRACE_CONTEXT;
	struct kp_line l = { body, buf + sizeof(buf) - 1 };
	len = kp_trace_format(&l, ev, ret_addr, rec, len);
	if (kp_platform_trace_buffer(ip, body, len))
		return;
	char ctx[KP_TRACE_CONTEXT];
	struct kp_line h = { ctx, ctx + sizeof(ctx) };
	kp_trace_context(&h, kp_fetch_comm(c), c->tid);
	unsigned long n = h.p - ctx;
	memcpy(body - n, ctx, n);
	kp_platform_write(kp_trace_fd, body - n, len + n);
}

/* A hit: the args fetched into a record; a platform with a trace buffer of its own (a
 * kernel's ftrace ring buffer) stores the record and prints it when the trace is read,
 * else the line is printed now and written whole. */
static void kp_trace_hit(const struct kp_trace_event *ev, struct pt_regs *regs,
			 unsigned long ip, unsigned long ret_addr)
{
#ifdef KP_PLATFORM_TRACE_WANTED
	if (!kp_platform_trace_wanted(ev))	/* a kernel's event disabled in every instance */
		return;
#endif
	unsigned char rec[KP_TRACE_REC];
	char comm[KP_TASK_COMM_LEN + 1];
	struct kp_rec r = { rec, rec + sizeof(rec), 0 };
	struct kp_fetch_ctx c = { regs, comm, kp_platform_task_pid(), 0 };
	for (unsigned int i = 0; i < ev->nargs && !r.full; i++)
		kp_fetch_arg(&r, &ev->args[i], &c);
#ifdef KP_PLATFORM_TRACE_RECORD
	if (kp_platform_trace_record(ev, regs, ip, ret_addr, rec, r.p - rec))
		return;
#endif
	kp_trace_write(ev, &c, ip, ret_addr, rec, r.p - rec);
}

void kp_trace_kprobe(const struct kp_trace_event *ev, struct pt_regs *regs, unsigned long addr)
{
	kp_trace_hit(ev, regs, addr, 0);
}

/*
 * The kretprobe side: called by a return handler with pt_regs at the return
 * (ax holds $retval), the address returned to (ri->ret_addr) and the probed
 * function's address.  FUNC is printed from the event, like the kernel's
 * "%ps" of tk->rp.kp.addr.
 */
void kp_trace_kretprobe(const struct kp_trace_event *ev, struct pt_regs *regs,
			unsigned long ret_addr, unsigned long func_addr)
{
	kp_trace_hit(ev, regs, func_addr, ret_addr);
}
