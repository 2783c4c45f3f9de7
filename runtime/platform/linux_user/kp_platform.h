/*
 * The platform half of the runtime's interface, included by the generic core
 * (kp_internal.h): a Linux user process.  A kernel image's platform folder
 * provides the same functions (its per-CPU base for the thread key,
 * copy_from_kernel_nofault(), current->comm, smp_processor_id(), ...).
 *
 * What the probe and trace paths call is defined here, as raw system calls
 * (the arch's kp_arch_platform.h: runtime/arch/<arch>/linux_user/); the rest is
 * in this folder's .c files.
 */
#ifndef _KP_PLATFORM_H
#define _KP_PLATFORM_H
#include <kp_arch_platform.h>
#pragma GCC visibility push(hidden)

/* --- thread identity: the thread pointer, once the C library has set one up --- */

extern int kp_tls_ready;
unsigned long kp_platform_thread_key_slow(void);

/* 0: no thread identity yet (a static program before __libc_setup_tls). */
static inline unsigned long kp_platform_thread_key(void)
{
	if (__builtin_expect(kp_tls_ready, 1))
		return kp_arch_thread_pointer();
	return kp_platform_thread_key_slow();
}
/* Whether kp_platform_thread_key_fast() may be used. */
static inline int kp_platform_thread_key_ready(void)
{
	return kp_tls_ready;
}

/* Only once kp_rt.fast is set (a thread pointer exists). */
static inline unsigned long kp_platform_thread_key_fast(void)
{
	return kp_arch_thread_pointer();
}

/* Around each optimized-probe dispatch: nothing in a user process, where the
 * thread key cannot change under the dispatch (the kernel platform disables
 * preemption here, as optimized_callback() does). */
static inline void kp_platform_dispatch_begin(void) { }
static inline void kp_platform_dispatch_end(void) { }

/* --- memory, output, time (platform.c, clock_cpus.c) --- */

void *kp_platform_alloc(unsigned long size);	/* zeroed, page granular; NULL on failure */
void kp_platform_write(int fd, const char *buf, unsigned long len);
int kp_platform_open_append(const char *path);
void kp_platform_close(int fd);
unsigned long kp_platform_ncpus(void);		/* CPUs this process may run on */
long long kp_platform_ktime(void);		/* monotonic clock, ns */

/* GOT slots of the rewritten object's sigaction & co., which kp_sighook.c
 * hooks (generated in the probe table, rewriter/sighook.py). */
struct kp_got_hook { unsigned long got; unsigned long kind; };
extern struct kp_got_hook kp_got_hooks[];
extern const unsigned int kp_ngot_hooks;
extern const unsigned long kp_relro_start, kp_relro_end;
extern const unsigned long kp_plt_start, kp_plt_end;	/* link-time .plt/.plt.sec */

/* The runtime's tables that are constant once it has relocated itself (the
 * linker script's page-aligned [__kp_ro_start, __kp_ro_end)) made read-only,
 * at the end of kp_relocate(): RELRO for the probe tables. */
static inline void kp_platform_protect_tables(void *start, void *end)
{
	if (end > start)
		kp_syscall3(__NR_mprotect, start, (char *)end - (char *)start, 1 /* PROT_READ */);
}

/* --- the current task, for trace lines --- */

#define KP_TASK_COMM_LEN 16

/* The thread's name (TASK_COMM_LEN bytes, NUL-terminated unless it fills them). */
static inline void kp_platform_task_comm(char *comm)
{
	kp_syscall3(__NR_prctl, 16 /* PR_GET_NAME */, comm, 0);
}

/* The thread id (the kernel's task_pid_nr(current)). */
static inline int kp_platform_task_pid(void)
{
	return (int)kp_syscall3(__NR_gettid, 0, 0, 0);
}

/* The CPU we run on: as the vDSO reads it, else getcpu(2) (QEMU). */
static inline unsigned int kp_platform_cpu(void)
{
	unsigned int limit = 0, cpu = 0;
	if (kp_arch_vgetcpu(&limit))
		return limit & 0xfff;
	kp_syscall3(__NR_getcpu, &cpu, 0, 0);
	return cpu;
}

/* A trace line's time stamp: the monotonic clock, read with the raw system call
 * (the vDSO is not ours to call from a detour: it may use SSE state the detour does
 * not save), printed to the nanosecond: a call graph (`kprewrite trace --format
 * graph`) times functions shorter than the kernel's microsecond. */
#define KP_PLATFORM_TRACE_NS 1
struct kp_timespec { long sec, nsec; };

/* kp_trace.c's user-program path: a line's context from a per-thread cache and the
 * CPU's counter, lines to a file gathered and written in blocks; the gathered
 * lines are written at exit by the fini (platform.c). */
#define KP_PLATFORM_TRACE_FAST 1
int kp_trace_buffered(void);
void kp_trace_flush(void);

/* Binary records (KPREWRITE_TRACE_FORMAT=binary, kp_trace.c): a file mapped shared, in
 * windows, grown as chunks are claimed; what was written outlives the process. */
#define KP_PLATFORM_TRACE_BINARY 1
int kp_platform_open_rw(const char *path);		/* O_RDWR|O_CREAT, 0600 */
long kp_platform_file_read(int fd, void *buf, unsigned long len);	/* from where fd is; bytes read */
int kp_platform_file_grow(int fd, unsigned long size);	/* to at least size, never smaller; 0 or -errno */
long kp_platform_file_size(int fd);			/* or -errno */
void *kp_platform_map_shared(int fd, unsigned long off, unsigned long len);	/* NULL on failure */
void kp_platform_unmap(void *p, unsigned long len);
int kp_platform_pwrite(int fd, const void *buf, unsigned long len, unsigned long off);	/* 0 or -1 */
void *kp_platform_alloc_wipeonfork(unsigned long size);	/* kp_platform_alloc(), zero in a forked child */
static inline void kp_platform_trace_clock(struct kp_timespec *ts)
{
	kp_syscall3(__NR_clock_gettime, 1 /* CLOCK_MONOTONIC */, ts, 0);
}

/*
 * --- reading memory that may not be mapped (the kernel's copy_from_kernel_nofault()) ---
 *
 * A bad pointer must print "(fault)" and never crash the probed program, so
 * memory is never read directly: process_vm_readv(2) on our own thread fails
 * with EFAULT instead of faulting.  Where that system call does not exist
 * (qemu-user), the bytes go through a pipe: write(2) also reports EFAULT for
 * an unreadable buffer.  Defined here for its one caller, the fetch engine
 * (kp_fetch.c), whose object holds the function and the pipe's state; static
 * and not inline, so it stays one call, as the kernel's is.
 */
#define KP_EFAULT 14

struct kp_iovec { void *base; unsigned long len; };

static int kp_mem_use_pipe __attribute__((unused));
static int kp_mem_pipe[2] __attribute__((unused)) = { -1, -1 };
static long kp_mem_pipe_pid __attribute__((unused));	/* the process that made the pipe: a forked child makes its own */
static int kp_mem_lock __attribute__((unused));

static inline int kp_mem_read_pipe(void *dst, unsigned long addr, unsigned long len)
{
	int ret = 0;
	while (__atomic_exchange_n(&kp_mem_lock, 1, __ATOMIC_ACQUIRE))
		cpu_relax();
	long pid = kp_syscall3(__NR_getpid, 0, 0, 0);
	if (kp_mem_pipe[0] >= 0 && pid != kp_mem_pipe_pid) {
		kp_platform_close(kp_mem_pipe[0]);
		kp_platform_close(kp_mem_pipe[1]);
		kp_mem_pipe[0] = kp_mem_pipe[1] = -1;
	}
	if (kp_mem_pipe[0] < 0) {
		if (kp_syscall3(__NR_pipe2, kp_mem_pipe, 02000000 | 04000 /* O_CLOEXEC|O_NONBLOCK */, 0) < 0)
			ret = -KP_EFAULT;
		kp_mem_pipe_pid = pid;
	}
	while (!ret && len) {
		unsigned long chunk = len > 4096 ? 4096 : len;
		long n = kp_syscall3(__NR_write, kp_mem_pipe[1], addr, chunk);
		if (n <= 0) {
			ret = -KP_EFAULT;
			break;
		}
		for (long got = 0; got < n;) {
			long r = kp_syscall3(__NR_read, kp_mem_pipe[0], (char *)dst + got, n - got);
			if (r <= 0)
				break;
			got += r;
		}
		if ((unsigned long)n < chunk)
			ret = -KP_EFAULT;
		dst = (char *)dst + n;
		addr += n;
		len -= n;
	}
	__atomic_store_n(&kp_mem_lock, 0, __ATOMIC_RELEASE);
	return ret;
}

/* 0, or -EFAULT if any byte of [addr, addr + len) cannot be read; tid is
 * kp_platform_task_pid()'s, which the caller has at hand. */
static __attribute__((unused)) int
kp_platform_copy_nofault(void *dst, unsigned long addr, unsigned long len, int tid)
{
	if (!len)
		return 0;
	if (addr + len < addr || addr < 4096)
		return -KP_EFAULT;
	if (!kp_mem_use_pipe) {
		struct kp_iovec local = { dst, len }, remote = { (void *)addr, len };
		long n = kp_syscall6(__NR_process_vm_readv, tid, (long)&local, 1, (long)&remote, 1, 0);
		if (n >= 0)
			return (unsigned long)n == len ? 0 : -KP_EFAULT;
		if (n == -KP_EFAULT)
			return -KP_EFAULT;
		kp_mem_use_pipe = 1;	/* ENOSYS (qemu-user), EPERM (seccomp)... */
	}
	return kp_mem_read_pipe(dst, addr, len);
}

/* The kernel's copy_from_user_nofault(): in a process, the same memory. */
static inline int kp_platform_copy_user_nofault(void *dst, unsigned long addr, unsigned long len, int tid)
{
	return kp_platform_copy_nofault(dst, addr, len, tid);
}

/* No ring buffer of our own: every trace line is written whole (kp_platform_write()). */
static inline int kp_platform_trace_buffer(unsigned long ip, const char *body, unsigned long len)
{
	(void)ip, (void)body, (void)len;
	return 0;
}

#pragma GCC visibility pop

/* KPREWRITE_PROFILE_SIGNAL: kprobe_profile on a signal (profile_signal.c).
 * Declared without the pragma, as before the headers were split, which keeps
 * the compiled code as it was. */
void kp_profile_signal_configure(const char *value);
#endif
