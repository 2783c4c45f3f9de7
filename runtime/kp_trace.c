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

/* kp_line_put()/kp_line_puts() a word at a time (the runtime's memcpy() and
 * kp_line_puts() go a byte at a time): every trace line is made of them. */
static inline void kp_trace_copy(char *dst, const char *src, unsigned long n)
{
	for (; n >= 8; n -= 8, dst += 8, src += 8) {
		unsigned long w;
		__builtin_memcpy(&w, src, 8);
		__builtin_memcpy(dst, &w, 8);
	}
	while (n--)
		*dst++ = *src++;
}

#ifdef KP_PLATFORM_TRACE_FAST
#define KP_TB_SIZE (1UL << 20)
static int kp_tb_on, kp_tb_owner;	/* lines to a file gathered (below); by this process */
static char *kp_tb;			/* KP_TB_SIZE bytes, mapped when tracing to a file */
#endif

#ifdef KP_PLATFORM_TRACE_BINARY
static int kp_bt_open(const char *path);
#endif

/* Start-up: where trace lines go; kprobe_profile on a signal. */
void kp_trace_configure(char **envp)
{
	kp_profile_signal_configure(kp_getenv(envp, "KPREWRITE_PROFILE_SIGNAL"));
	const char *path = kp_getenv(envp, "KPREWRITE_TRACE");
#ifdef KP_PLATFORM_TRACE_BINARY
	const char *format = kp_getenv(envp, "KPREWRITE_TRACE_FORMAT");
	int to_file = path && *path && strcmp(path, "-") && strcmp(path, "stderr");
	if (format && *format && strcmp(format, "text")) {
		static const char unknown[] = "kprewrite: KPREWRITE_TRACE_FORMAT: not text or binary; text lines\n";
		static const char nofile[] = "kprewrite: KPREWRITE_TRACE_FORMAT=binary needs KPREWRITE_TRACE=FILE; text lines\n";
		if (strcmp(format, "binary")) {
			kp_platform_write(2, unknown, sizeof(unknown) - 1);
		} else if (!to_file) {
			kp_platform_write(2, nofile, sizeof(nofile) - 1);
		} else {
			kp_bt_open(path);	/* or it said why: text lines to standard error */
			return;
		}
	}
#endif
	if (!path || !*path || !strcmp(path, "-") || !strcmp(path, "stderr"))
		return;
	int fd = kp_platform_open_append(path);
	if (fd >= 0) {
		kp_trace_fd = fd;
#ifdef KP_PLATFORM_TRACE_FAST
		/* Gathering is asked for: a process that dies or hangs in a burst
		 * would keep the burst's end, the lines that tell why. */
		const char *gather = kp_getenv(envp, "KPREWRITE_TRACE_BUFFER");
		if (gather && *gather && strcmp(gather, "0")) {
			kp_tb_owner = (int)kp_syscall3(__NR_getpid, 0, 0, 0);
			kp_tb = kp_platform_alloc(KP_TB_SIZE);
			kp_tb_on = kp_tb != 0;	/* lines are gathered (kp_tb_put()) */
		}
#endif
		return;
	}
	static const char msg[] = "kprewrite: KPREWRITE_TRACE: cannot open the file; tracing to standard error\n";
	kp_platform_write(2, msg, sizeof(msg) - 1);
}

/* trace_print_context(): "%16s-%-7d [%03d] %5lu.%06lu: " (or %09lu: KP_PLATFORM_TRACE_NS),
 * for lines written whole. */
static void kp_trace_context_who(struct kp_line *l, const char *comm, int tid, unsigned int cpu)
{
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
}

static void kp_trace_context_at(struct kp_line *l, const char *comm, int tid, unsigned int cpu,
				struct kp_timespec ts)
{
	kp_trace_context_who(l, comm, tid, cpu);
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

static void kp_trace_context(struct kp_line *l, const char *comm, int tid)
{
	struct kp_timespec ts = { 0, 0 };
	unsigned int cpu = kp_platform_cpu();
	kp_platform_trace_clock(&ts);
	kp_trace_context_at(l, comm, tid, cpu, ts);
}

#ifdef KP_PLATFORM_TRACE_FAST
/*
 * A user program's hot path (KP_PLATFORM_TRACE_FAST): a line's context without a
 * system call in the common case.  A trace line used to cost four (prctl for the
 * name, gettid, clock_gettime, write), some microseconds on a virtual machine:
 * too much for a call graph of every function ([[function_graph]]).
 *
 * - The thread's name, id and process id, and (where vgetcpu cannot be read) its
 *   CPU, are kept per thread pointer (kp_tc[]) and read again, with the clock
 *   (clock_gettime(2)), whenever the thread's previous line is more than
 *   KP_TC_GAP_NS old or its clock reading more than KP_TC_ANCHOR_NS: a thread
 *   that exited and one created later on the same thread pointer (a C library
 *   reuses them), a forked child, a renamed thread, all run for longer than that
 *   between two lines, and at most one set of system calls per KP_TC_GAP_NS of a
 *   thread's time is what this costs.
 * - Between two readings the time is the clock's at the last reading plus the
 *   CPU's counter (kp_arch_counter(): x86-64's TSC, arm64's virtual count) since,
 *   scaled by the rate measured against clock_gettime from the first reading on
 *   (kp_tc_mult, refined at each reading); a thread's times never go backwards.
 *   Until the rate is known (the first millisecond) every line reads the clock.
 * - Tracing to a file (KPREWRITE_TRACE=FILE) with KPREWRITE_TRACE_BUFFER=1
 *   (otherwise each line is one write), whole lines are gathered in
 *   kp_tb[] under a lock while they come in a burst, and written KP_TB_SIZE at a
 *   time, when the oldest is KP_TB_AGE_NS old, with a line that comes after a
 *   pause (so sparse lines are written as they come), and at exit
 *   (kp_trace_flush(), from the platform's fini).  What a process that leaves
 *   without exit() (execve, _exit, a fatal signal) had gathered is lost: at most
 *   the end of its last burst.  A forked child writes its own lines directly and
 *   never the parent's it inherited (kp_tb_owner).  Standard error is never
 *   gathered: its lines keep their place among the program's own output.
 */
#define KP_TC_SLOTS 1024
#define KP_TC_PROBES 8
#define KP_TC_GAP_NS 5000LL
#define KP_TC_ANCHOR_NS 1000000LL
#define KP_TC_CALIBRATE_NS 1000000LL
#define KP_TC_SHIFT 24
#define KP_TB_AGE_NS 10000000LL

struct kp_tc {
	unsigned long key;		/* thread pointer; 0: free */
	int tid, pid;
	unsigned int cpu;
	int fresh;			/* read again at its next line */
	int gap;			/* this line came after a pause: write the gathered lines */
	int changed;			/* identity read again and different: a binary context record */
	unsigned long anchor_c, last_c;	/* counter at the last clock reading, at the last line */
	long long anchor_ns, last_ns;
	char comm[KP_TASK_COMM_LEN + 1];
	unsigned int prefix_len;
	char prefix[48];		/* the context up to the time: "%16s-%-7d [%03d] " */
	unsigned long sec;		/* the seconds of sec_text ("%5lu"); ~0: none */
	unsigned int sec_len;
	char sec_text[24];
};

static const char kp_tc_pairs[] =
	"00010203040506070809101112131415161718192021222324252627282930313233343536373839"
	"40414243444546474849505152535455565758596061626364656667686970717273747576777879"
	"8081828384858687888990919293949596979899";
static struct kp_tc kp_tc[KP_TC_SLOTS];
static volatile int kp_tc_t0_state;	/* 0 none, 1 being set, 2 set */
static unsigned long kp_tc_c0;
static long long kp_tc_t0;
static volatile unsigned long kp_tc_mult;	/* ns per count << KP_TC_SHIFT; 0: not measured yet */
static volatile unsigned long kp_tc_gap_c, kp_tc_anchor_c;	/* the two limits in counts */

static volatile int kp_tb_lock;
static unsigned long kp_tb_len;
static long long kp_tb_first_ns;

static long long kp_tc_clock(void)
{
	struct kp_timespec ts = { 0, 0 };
	kp_platform_trace_clock(&ts);
	return ts.sec * 1000000000LL + ts.nsec;
}

/* The thread's slot (claimed at its first line), or 0: no thread pointer yet, or
 * the table full around its hash (the line is then made as before). */
static struct kp_tc *kp_tc_slot(void)
{
	unsigned long key = kp_platform_thread_key();
	if (!key)
		return 0;
	unsigned long h = (key >> 12 ^ key >> 22) & (KP_TC_SLOTS - 1);
	for (unsigned int i = 0; i < KP_TC_PROBES; i++) {
		struct kp_tc *t = &kp_tc[(h + i) & (KP_TC_SLOTS - 1)];
		unsigned long k = __atomic_load_n(&t->key, __ATOMIC_ACQUIRE);
		if (k == key)
			return t;
		if (!k && __atomic_compare_exchange_n(&t->key, &k, key, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
			t->fresh = 1;
			t->sec = ~0UL;
			return t;
		}
		if (k == key)		/* lost the race to ourselves: cannot happen, but harmless */
			return t;
	}
	return 0;
}

/* Read the thread's identity and the clock again; refine the counter's rate. */
static void kp_tc_read(struct kp_tc *t)
{
	int tid = t->tid, pid = t->pid;
	unsigned int cpu = t->cpu;
	char comm[KP_TASK_COMM_LEN + 1];
	__builtin_memcpy(comm, t->comm, sizeof(comm));
	t->tid = kp_platform_task_pid();
	t->pid = (int)kp_syscall3(__NR_getpid, 0, 0, 0);
	t->cpu = kp_platform_cpu();
	kp_platform_task_comm(t->comm);
	t->comm[KP_TASK_COMM_LEN] = 0;
	if (tid != t->tid || pid != t->pid || cpu != t->cpu || memcmp(comm, t->comm, sizeof(comm)))
		t->changed = 1;
	struct kp_line l = { t->prefix, t->prefix + sizeof(t->prefix) };
	kp_trace_context_who(&l, t->comm, t->tid, t->cpu);
	t->prefix_len = l.p - t->prefix;
	long long ns = kp_tc_clock();
	unsigned long c = kp_arch_counter();
	t->anchor_ns = ns;
	t->anchor_c = c;
	t->fresh = 0;
	int state = __atomic_load_n(&kp_tc_t0_state, __ATOMIC_ACQUIRE);
	if (state == 0) {
		if (__atomic_compare_exchange_n(&kp_tc_t0_state, &state, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
			kp_tc_t0 = ns;
			kp_tc_c0 = c;
			__atomic_store_n(&kp_tc_t0_state, 2, __ATOMIC_RELEASE);
		}
	} else if (state == 2) {
		long long dt = ns - kp_tc_t0;
		unsigned long dc = c - kp_tc_c0;
		/* dt << 24 fits 64 bits below 2^39 ns (some nine minutes): the rate is
		 * measured well enough by then. */
		if (dt >= KP_TC_CALIBRATE_NS && dt < (1LL << 39) && dc && (long)dc > 0) {
			unsigned long mult = ((unsigned long)dt << KP_TC_SHIFT) / dc;
			if (mult) {
				kp_tc_gap_c = ((unsigned long)KP_TC_GAP_NS << KP_TC_SHIFT) / mult;
				kp_tc_anchor_c = ((unsigned long)KP_TC_ANCHOR_NS << KP_TC_SHIFT) / mult;
				__atomic_store_n(&kp_tc_mult, mult, __ATOMIC_RELEASE);
			}
		}
	}
}

/* The line's time (ns) and the thread's identity in t. */
static long long kp_tc_now(struct kp_tc *t)
{
	unsigned long mult = __atomic_load_n(&kp_tc_mult, __ATOMIC_ACQUIRE);
	unsigned long c = kp_arch_counter();
	long long ns;
	t->gap = t->fresh || !mult || c - t->last_c >= kp_tc_gap_c;
	if (!t->gap && c - t->anchor_c < kp_tc_anchor_c) {
		ns = t->anchor_ns + (long long)((c - t->anchor_c) * mult >> KP_TC_SHIFT);
	} else {
		kp_tc_read(t);
		ns = t->anchor_ns;
		c = t->anchor_c;
	}
	if (ns < t->last_ns)
		ns = t->last_ns;
	t->last_ns = ns;
	t->last_c = c;
	return ns;
}

static void kp_tb_write_locked(void)
{
	if (kp_tb_len)
		kp_platform_write(kp_trace_fd, kp_tb, kp_tb_len);
	kp_tb_len = 0;
}

/* A whole line into the buffer (written when full or old), or to the file
 * directly where the buffer is not ours (a forked child) or is off. */
static void kp_tb_put(const struct kp_tc *t, const char *line, unsigned long n, long long ns)
{
	if (!kp_tb_on || t->pid != kp_tb_owner || n > KP_TB_SIZE) {
		kp_platform_write(kp_trace_fd, line, n);
		return;
	}
	while (__atomic_exchange_n(&kp_tb_lock, 1, __ATOMIC_ACQUIRE))
		cpu_relax();
	if (!kp_tb_on) {		/* flushed for exit meanwhile */
		__atomic_store_n(&kp_tb_lock, 0, __ATOMIC_RELEASE);
		kp_platform_write(kp_trace_fd, line, n);
		return;
	}
	if (kp_tb_len + n > KP_TB_SIZE)
		kp_tb_write_locked();
	if (!kp_tb_len)
		kp_tb_first_ns = ns;
	kp_trace_copy(kp_tb + kp_tb_len, line, n);
	kp_tb_len += n;
	if (t->gap || ns - kp_tb_first_ns > KP_TB_AGE_NS)
		kp_tb_write_locked();
	__atomic_store_n(&kp_tb_lock, 0, __ATOMIC_RELEASE);
}

int kp_trace_buffered(void)
{
	return kp_tb_on;
}

/* At exit (the platform's fini): the gathered lines written, and every later line
 * written directly.  Only by the process that gathered them. */
void kp_trace_flush(void)
{
	if (!kp_tb_on || (int)kp_syscall3(__NR_getpid, 0, 0, 0) != kp_tb_owner)
		return;
	while (__atomic_exchange_n(&kp_tb_lock, 1, __ATOMIC_ACQUIRE))
		cpu_relax();
	kp_tb_write_locked();
	kp_tb_on = 0;
	__atomic_store_n(&kp_tb_lock, 0, __ATOMIC_RELEASE);
}

/*
 * Binary records (KPREWRITE_TRACE_FORMAT=binary with KPREWRITE_TRACE=FILE): the kernel's
 * shape, where a hit puts its record into the ftrace ring buffer and kp_trace_format()
 * prints it only when the trace is read.  Here the buffer is FILE itself, mapped shared:
 * what was recorded is in the page cache as soon as it is stored, and outlives a process
 * that crashes or hangs; `kprewrite trace`/`report` format it (rewriter/trace/binary.py).
 *
 * FILE is a sequence of KP_BT_CHUNK-byte chunks.  Chunk 0 is the file's header
 * (struct kp_bt_file: the magic, the sizes, `next`, the next chunk to claim).  An image
 * (a process's rewritten program or library) claims consecutive chunks for its
 * descriptor at start-up (KP_BT_IMAGE: its events with their fetch-arg layouts, its
 * symbols, the load bias, the time base), written with pwrite(2).  Each thread claims a
 * KP_BT_RECORDS chunk of its own with one atomic add on `next` (in the shared header, so
 * the processes that write one file, forked or not, never claim the same chunk) and fills
 * it without a lock; the file is grown (fallocate(2), which never shrinks it) and mapped
 * KP_BT_WINDOW bytes at a time as claims reach the next window.
 *
 * A records chunk is 8-byte words: a record's first word is (ns << 16 | id): ns since the
 * image's time base (48 bits: 78 hours), id the event's index + 1, or KP_BT_CTX for a
 * context record (tid | pid << 32, cpu, comm[16]: who writes the records that follow; at
 * the start of a chunk and whenever the thread's identity was read again and differs).  A
 * return event adds the address returned to (the caller of `<- FUNC`); an event with
 * fetch args the record's length in bytes and the record (kp_trace.h), padded to a word.
 * The first word is stored last, so a record is there whole or not at all; a zero word
 * ends the chunk.  A forked child finds its per-thread state zero (MADV_WIPEONFORK) and
 * claims chunks of its own.
 */
#define KP_BT_CHUNK (64UL << 10)
#define KP_BT_WINDOW (4UL << 20)
#define KP_BT_CPW (KP_BT_WINDOW / KP_BT_CHUNK)
#define KP_BT_WINDOWS 16384		/* 64 GiB of records */
#define KP_BT_CTX 0xffffUL
#define KP_BT_VERSION 1
enum { KP_BT_IMAGE = 1, KP_BT_RECORDS = 2 };

static const char kp_bt_magic[8] = "KPTRACEB";

struct kp_bt_file {
	char magic[8];
	unsigned int version;
	unsigned int state;		/* 0 new, 1 being set up, 2 ready */
	unsigned int chunk, window;	/* KP_BT_CHUNK, KP_BT_WINDOW */
	unsigned int endian;		/* 0x01020304 as the writer stores it */
	unsigned int reserved;
	unsigned long next;		/* the next chunk to claim */
};

struct kp_bt_chunk {
	unsigned int kind;		/* KP_BT_IMAGE, KP_BT_RECORDS; 0: not (yet) written */
	unsigned int image;		/* the chunk of the image's descriptor */
	unsigned long len;		/* KP_BT_IMAGE: bytes of the descriptor after this header */
};

struct kp_bt_slot { unsigned long *p, *end; long pid; };

struct kp_bt_state {			/* zero in a forked child (kp_platform_alloc_wipeonfork()) */
	struct kp_bt_slot slots[KP_TC_SLOTS];
	struct kp_bt_slot slow;		/* hits with no kp_tc slot, under kp_bt_lock */
	char *win[KP_BT_WINDOWS];
};

static int kp_bt_on, kp_bt_fd = -1;
static int kp_bt_full;			/* the file could not grow: no more claims (and system calls) */
static struct kp_bt_file *kp_bt_hdr;
static struct kp_bt_state *kp_bt;
static unsigned int kp_bt_image;
static long long kp_bt_base;
static volatile int kp_bt_lock;
static struct kp_tc kp_bt_slow_tc;

static unsigned long kp_bt_put_bytes(unsigned char *out, unsigned long n, const void *v, unsigned long len)
{
	if (out)
		memcpy(out + n, v, len);
	return n + len;
}

static unsigned long kp_bt_put_str(unsigned char *out, unsigned long n, const char *str)
{
	unsigned short len = str ? (unsigned short)strlen(str) : 0;
	n = kp_bt_put_bytes(out, n, &len, 2);
	return kp_bt_put_bytes(out, n, str, len);
}

/* The descriptor of this image (out == 0: its length). */
static unsigned long kp_bt_descriptor(unsigned char *out, int pid)
{
	unsigned long symnames = 0;
	for (unsigned int i = 0; i < kp_nsyms; i++) {
		unsigned long end = kp_syms[i].name + strlen(kp_symnames + kp_syms[i].name) + 1;
		if (end > symnames)
			symnames = end;
	}
	unsigned long head[2] = { (unsigned long)kp_bt_base, kp_rt.bias };
	unsigned int counts[4] = { (unsigned int)pid, kp_ntrace_events, kp_nsyms, (unsigned int)symnames };
	unsigned long n = kp_bt_put_bytes(out, 0, head, sizeof(head));
	n = kp_bt_put_bytes(out, n, counts, sizeof(counts));
	for (unsigned int i = 0; i < kp_ntrace_events; i++) {
		const struct kp_trace_event *ev = kp_trace_events[i];
		unsigned short h[2] = { (unsigned short)ev->is_return, (unsigned short)ev->nargs };
		n = kp_bt_put_bytes(out, n, h, sizeof(h));
		n = kp_bt_put_str(out, n, ev->name);
		n = kp_bt_put_str(out, n, ev->where);
		for (unsigned int j = 0; j < ev->nargs; j++) {
			const struct kp_probe_arg *a = &ev->args[j];
			unsigned char ps[2] = { a->print, a->size };
			n = kp_bt_put_str(out, n, a->name);
			n = kp_bt_put_bytes(out, n, ps, 2);
			n = kp_bt_put_bytes(out, n, &a->count, 2);
		}
	}
	for (unsigned int i = 0; i < kp_nsyms; i++) {
		unsigned long as[2] = { kp_syms[i].addr, kp_syms[i].size };
		n = kp_bt_put_bytes(out, n, as, sizeof(as));
		n = kp_bt_put_bytes(out, n, &kp_syms[i].name, 4);
	}
	return kp_bt_put_bytes(out, n, kp_symnames, symnames);
}

/* Window w of the file, mapped (and the file grown to hold it) at its first use. */
static char *kp_bt_window(unsigned long w)
{
	if (w >= KP_BT_WINDOWS)
		return 0;
	char *m = __atomic_load_n(&kp_bt->win[w], __ATOMIC_ACQUIRE);
	if (m)
		return m;
	if (kp_platform_file_grow(kp_bt_fd, (w + 1) * KP_BT_WINDOW))
		return 0;
	m = kp_platform_map_shared(kp_bt_fd, w * KP_BT_WINDOW, KP_BT_WINDOW);
	if (!m)
		return 0;
	char *none = 0;
	if (!__atomic_compare_exchange_n(&kp_bt->win[w], &none, m, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
		kp_platform_unmap(m, KP_BT_WINDOW);	/* another thread mapped it first */
		m = none;
	}
	return m;
}

/* A records chunk of the thread's own; 0 when the file cannot grow (the hit is lost, and
 * every later one: a hit that tried again would make a system call and use up a chunk
 * index each time, and a window grown later would allocate all those before it). */
static int kp_bt_claim(struct kp_bt_slot *s, long pid)
{
	s->p = s->end = 0;
	if (__atomic_load_n(&kp_bt_full, __ATOMIC_RELAXED))
		return 0;
	unsigned long idx = __atomic_fetch_add(&kp_bt_hdr->next, 1, __ATOMIC_RELAXED);
	char *w = kp_bt_window(idx / KP_BT_CPW);
	if (!w) {
		__atomic_store_n(&kp_bt_full, 1, __ATOMIC_RELAXED);
		return 0;
	}
	struct kp_bt_chunk *c = (struct kp_bt_chunk *)(w + idx % KP_BT_CPW * KP_BT_CHUNK);
	c->image = kp_bt_image;
	c->len = 0;
	__atomic_store_n(&c->kind, KP_BT_RECORDS, __ATOMIC_RELEASE);
	s->p = (unsigned long *)(c + 1);
	s->end = (unsigned long *)((char *)c + KP_BT_CHUNK);
	s->pid = pid;
	return 1;
}

#define KP_BT_CTX_WORDS 5

/* A hit's record into the thread's chunk (a new chunk when it is full or was claimed by
 * another process). */
static void kp_bt_put(struct kp_tc *t, struct kp_bt_slot *s, const struct kp_trace_event *ev, long long ns,
		      unsigned long ret_addr, const unsigned char *rec, unsigned long len)
{
	unsigned long words = 1 + (ev->is_return != 0) + (ev->nargs ? 1 + (len + 7) / 8 : 0);
	int ctx = t->changed;
	if (!s->p || (ctx && s->pid != t->pid) ||
	    (unsigned long)(s->end - s->p) < words + (ctx ? KP_BT_CTX_WORDS : 0)) {
		if (!kp_bt_claim(s, t->pid))
			return;
		ctx = 1;
	}
	/* ns before the time base: a thread's clock anchored before start-up, extrapolated */
	unsigned long rel = ns > kp_bt_base ? ((unsigned long)(ns - kp_bt_base) & ((1UL << 48) - 1)) << 16 : 0;
	unsigned long *q = s->p;
	if (ctx) {
		q[1] = (unsigned int)t->tid | (unsigned long)(unsigned int)t->pid << 32;
		q[2] = t->cpu;
		__builtin_memcpy(q + 3, t->comm, 16);
		__atomic_store_n(q, rel | KP_BT_CTX, __ATOMIC_RELEASE);
		q += KP_BT_CTX_WORDS;
		t->changed = 0;
	}
	unsigned long *r = q++;
	if (ev->is_return)
		*q++ = ret_addr;
	if (ev->nargs) {
		*q++ = len;
		if (len & 7)
			q[len / 8] = 0;	/* the pad of the last word */
		kp_trace_copy((char *)q, (const char *)rec, len);
		q += (len + 7) / 8;
	}
	__atomic_store_n(r, rel | (ev->index + 1), __ATOMIC_RELEASE);
	s->p = q;
}

/* A hit's record: from the thread's slot, or (no thread pointer yet, the table full)
 * under a lock, with its context read for it. */
static void kp_bt_hit(struct kp_tc *t, const struct kp_trace_event *ev, long long ns,
		      unsigned long ret_addr, const unsigned char *rec, unsigned long len)
{
	if (t) {
		kp_bt_put(t, &kp_bt->slots[t - kp_tc], ev, ns, ret_addr, rec, len);
		return;
	}
	while (__atomic_exchange_n(&kp_bt_lock, 1, __ATOMIC_ACQUIRE))
		cpu_relax();
	kp_tc_read(&kp_bt_slow_tc);
	kp_bt_slow_tc.changed = 1;
	kp_bt_put(&kp_bt_slow_tc, &kp_bt->slow, ev, kp_bt_slow_tc.anchor_ns, ret_addr, rec, len);
	__atomic_store_n(&kp_bt_lock, 0, __ATOMIC_RELEASE);
}

/* The common hit of an event without fetch args (a [[function_graph]]'s), stored here with
 * no call: the thread's kp_tc slot at its hash, a chunk with room, its previous hit less
 * than KP_TC_GAP_NS and its clock reading less than KP_TC_ANCHOR_NS ago, its identity
 * unchanged.  0: anything else, which kp_trace_hit() does as before (kp_tc_now() reads
 * the counter again). */
static __attribute__((always_inline)) inline int kp_bt_fast(const struct kp_trace_event *ev, unsigned long ret_addr)
{
	if (!kp_bt_on || ev->nargs || !kp_platform_thread_key_ready())
		return 0;
	unsigned long key = kp_platform_thread_key_fast();
	unsigned long h = (key >> 12 ^ key >> 22) & (KP_TC_SLOTS - 1), words = 1 + (ev->is_return != 0);
	struct kp_tc *t = &kp_tc[h];
	struct kp_bt_slot *s = &kp_bt->slots[h];
	if (!key || __atomic_load_n(&t->key, __ATOMIC_ACQUIRE) != key || t->fresh || t->changed ||
	    (unsigned long)(s->end - s->p) < words)
		return 0;
	unsigned long mult = __atomic_load_n(&kp_tc_mult, __ATOMIC_ACQUIRE);
	unsigned long c = kp_arch_counter();
	if (!mult || c - t->last_c >= kp_tc_gap_c || c - t->anchor_c >= kp_tc_anchor_c)
		return 0;
	long long ns = t->anchor_ns + (long long)((c - t->anchor_c) * mult >> KP_TC_SHIFT);
	if (ns < t->last_ns)
		ns = t->last_ns;
	t->last_ns = ns;
	t->last_c = c;
	unsigned long rel = ns > kp_bt_base ? ((unsigned long)(ns - kp_bt_base) & ((1UL << 48) - 1)) << 16 : 0;
	unsigned long *q = s->p;
	if (ev->is_return)
		q[1] = ret_addr;
	__atomic_store_n(q, rel | (ev->index + 1), __ATOMIC_RELEASE);
	s->p = q + words;
	return 1;
}

/* Start-up: FILE opened (created) and joined, this image's descriptor written.  A message
 * and 0 when it cannot be (the caller traces text to standard error). */
static int kp_bt_open(const char *path)
{
	static const char bad[] = "kprewrite: KPREWRITE_TRACE: cannot use the file for binary records; tracing to standard error\n";
	static const char foreign[] = "kprewrite: KPREWRITE_TRACE: the file is not a binary trace (KPREWRITE_TRACE_FORMAT=binary); tracing to standard error\n";
	if (kp_ntrace_events >= KP_BT_CTX - 1)
		goto fail;
	int fd = kp_platform_open_rw(path);
	if (fd < 0)
		goto fail;
	char head[64];
	long n = kp_platform_file_read(fd, head, sizeof(head));	/* before anything moves the offset */
	/* Found empty: this process may set the header up (as may another that found it so).
	 * Found not empty: ours, or being set up by another process (its head zero but for
	 * `state`, and the file already one window long), never text lines or another file;
	 * such a file is neither grown nor set up here, and is refused if its header is not
	 * ready soon (a file of zeros). */
	int joining = n > 0;
	if (joining) {
		int zero = 1;
		for (long i = 0; i < n; i++)
			zero &= !head[i] || (i >= 12 && i < 16);
		if ((!zero && (n < 8 || memcmp(head, kp_bt_magic, 8))) ||
		    kp_platform_file_size(fd) < (long)KP_BT_WINDOW)
			goto foreign_fd;
	}
	struct kp_bt_file *h;
	if ((!joining && kp_platform_file_grow(fd, KP_BT_WINDOW)) || !(h = kp_platform_map_shared(fd, 0, KP_BT_WINDOW)))
		goto fail_fd;
	unsigned int state = 0;
	if (!joining && __atomic_compare_exchange_n(&h->state, &state, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
		h->version = KP_BT_VERSION;
		h->chunk = KP_BT_CHUNK;
		h->window = KP_BT_WINDOW;
		h->endian = 0x01020304;
		h->next = 1;
		__builtin_memcpy(h->magic, kp_bt_magic, 8);
		__atomic_store_n(&h->state, 2, __ATOMIC_RELEASE);
	} else {
		for (unsigned long spin = 0; __atomic_load_n(&h->state, __ATOMIC_ACQUIRE) != 2; spin++)
			if (spin > 100000000UL) {
				kp_platform_unmap(h, KP_BT_WINDOW);
				goto foreign_fd;
			}
	}
	if (memcmp(h->magic, kp_bt_magic, 8) || h->version != KP_BT_VERSION || h->chunk != KP_BT_CHUNK ||
	    h->window != KP_BT_WINDOW || h->endian != 0x01020304)
		goto fail_map;
	kp_bt = kp_platform_alloc_wipeonfork(sizeof(*kp_bt));
	if (!kp_bt)
		goto fail_map;
	kp_bt->win[0] = (char *)h;
	kp_bt_fd = fd;
	kp_bt_hdr = h;
	kp_bt_base = kp_tc_clock();
	int pid = (int)kp_syscall3(__NR_getpid, 0, 0, 0);
	unsigned long len = kp_bt_descriptor(0, pid);
	unsigned long nchunks = (sizeof(struct kp_bt_chunk) + len + KP_BT_CHUNK - 1) / KP_BT_CHUNK;
	unsigned char *d = kp_platform_alloc(sizeof(struct kp_bt_chunk) + len);
	if (!d)
		goto fail_map;
	unsigned long idx = __atomic_fetch_add(&h->next, nchunks, __ATOMIC_RELAXED);
	struct kp_bt_chunk c = { KP_BT_IMAGE, (unsigned int)idx, len };
	kp_bt_descriptor(d + sizeof(c), pid);
	/* the descriptor first, its header (kind) after: a reader never sees half of one */
	if (kp_platform_file_grow(fd, (idx + nchunks) * KP_BT_CHUNK) ||
	    kp_platform_pwrite(fd, d + sizeof(c), len, idx * KP_BT_CHUNK + sizeof(c)) ||
	    kp_platform_pwrite(fd, &c, sizeof(c), idx * KP_BT_CHUNK))
		goto fail_map;
	kp_platform_unmap(d, sizeof(struct kp_bt_chunk) + len);
	kp_bt_image = (unsigned int)idx;
	kp_bt_on = 1;
	return 1;
fail_map:
	kp_platform_unmap(h, KP_BT_WINDOW);
	goto fail_fd;
foreign_fd:
	kp_platform_close(fd);
	kp_platform_write(2, foreign, sizeof(foreign) - 1);
	return 0;
fail_fd:
	kp_platform_close(fd);
fail:
	kp_bt_fd = -1;
	kp_platform_write(2, bad, sizeof(bad) - 1);
	return 0;
}
#endif

static inline void kp_trace_put(struct kp_line *l, const char *s, unsigned long n)
{
	if (n > (unsigned long)(l->end - l->p))
		n = l->end - l->p;
	kp_trace_copy(l->p, s, n);
	l->p += n;
}

static inline void kp_trace_puts(struct kp_line *l, const char *s)
{
	kp_trace_put(l, s, strlen(s));
}

/* The body of a line from a hit's record: print_kprobe_event() or print_kretprobe_event(). */
unsigned long kp_trace_format(struct kp_line *l, const struct kp_trace_event *ev, unsigned long ret_addr,
			      const unsigned char *rec, unsigned long len)
{
	char *start = l->p;
	if (!ev->is_return) {
		kp_trace_put(l, ev->head, ev->head_len);
	} else {
		kp_trace_puts(l, ev->name);
		kp_trace_put(l, ": (", 3);
		kp_line_sym(l, ret_addr, 1);
		kp_trace_put(l, " <- ", 4);
		kp_trace_puts(l, ev->where);
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

struct kp_tc;

static __attribute__((noinline)) void kp_trace_write(const struct kp_trace_event *ev, struct kp_fetch_ctx *c,
						     unsigned long ip, unsigned long ret_addr,
						     const unsigned char *rec, unsigned long len,
						     struct kp_tc *t, long long ns)
{
	char buf[KP_TRACE_LINE];
	char *body = buf + KP_TRACE_CONTEXT;
	struct kp_line l = { body, buf + sizeof(buf) - 1 };
	len = kp_trace_format(&l, ev, ret_addr, rec, len);
	if (kp_platform_trace_buffer(ip, body, len))
		return;
	char ctx[KP_TRACE_CONTEXT];
	struct kp_line h = { ctx, ctx + sizeof(ctx) };
#ifdef KP_PLATFORM_TRACE_FAST
	if (t) {
		/* "%5lu.%09lu: " after the thread's cached context: the time's digits
		 * right to left into tsb, then both in front of the body. */
		char tsb[40];
		char *q = tsb + sizeof(tsb);
		unsigned long sec = (unsigned long)ns / 1000000000UL;
		unsigned int frac = (unsigned int)((unsigned long)ns % 1000000000UL);
		*--q = ' ';
		*--q = ':';
		for (int i = 0; i < 4; i++, frac /= 100) {
			q -= 2;
			__builtin_memcpy(q, kp_tc_pairs + 2 * (frac % 100), 2);
		}
		*--q = '0' + frac;
		*--q = '.';
		if (sec != t->sec) {		/* the seconds' digits, once a second */
			char tmp[24], *e = tmp + sizeof(tmp), *b = e;
			unsigned long v = sec;
			do {
				*--b = '0' + v % 10;
				v /= 10;
			} while (v);
			while (e - b < 5)
				*--b = ' ';
			t->sec_len = e - b;
			t->sec = sec;
			kp_trace_copy(t->sec_text, b, t->sec_len);
		}
		q -= t->sec_len;
		kp_trace_copy(q, t->sec_text, t->sec_len);
		unsigned long tn = tsb + sizeof(tsb) - q, n = t->prefix_len + tn;
		kp_trace_copy(body - n, t->prefix, t->prefix_len);
		kp_trace_copy(body - tn, q, tn);
		kp_tb_put(t, body - n, len + n, ns);
		return;
	}
#endif
	(void)t;
	(void)ns;
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
	struct kp_tc *t = 0;
	long long ns = 0;
#ifdef KP_PLATFORM_TRACE_FAST
	/* The thread's id from its slot; the time taken here, before the args are
	 * fetched, as the line's (the record's place in the kernel's ring buffer). */
	t = kp_tc_slot();
	if (t) {
#ifdef KP_PLATFORM_TRACE_BINARY
		/* no chunk yet, or a forked child's first hit: who we are, read again (not
		 * when no chunk can be had: that would be system calls at every hit) */
		if (kp_bt_on && !kp_bt->slots[t - kp_tc].p && !__atomic_load_n(&kp_bt_full, __ATOMIC_RELAXED))
			t->fresh = 1;
#endif
		ns = kp_tc_now(t);
	}
	int tid = t ? t->tid : kp_platform_task_pid();
#else
	int tid = kp_platform_task_pid();
#endif
	struct kp_fetch_ctx c = { regs, comm, tid, 0 };
	for (unsigned int i = 0; i < ev->nargs && !r.full; i++)
		kp_fetch_arg(&r, &ev->args[i], &c);
#ifdef KP_PLATFORM_TRACE_RECORD
	if (kp_platform_trace_record(ev, regs, ip, ret_addr, rec, r.p - rec))
		return;
#endif
#ifdef KP_PLATFORM_TRACE_BINARY
	if (kp_bt_on) {
		kp_bt_hit(t, ev, ns, ret_addr, rec, r.p - rec);
		return;
	}
#endif
	kp_trace_write(ev, &c, ip, ret_addr, rec, r.p - rec, t, ns);
}

void kp_trace_kprobe(const struct kp_trace_event *ev, struct pt_regs *regs, unsigned long addr)
{
#ifdef KP_PLATFORM_TRACE_BINARY
	if (kp_bt_fast(ev, 0))
		return;
#endif
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
#ifdef KP_PLATFORM_TRACE_BINARY
	if (kp_bt_fast(ev, ret_addr))
		return;
#endif
	kp_trace_hit(ev, regs, func_addr, ret_addr);
}
