/*
 * Platform layer: a Linux user process.  Output, memory, thread identity and
 * start-up; a kernel image gets its own folder next to this one.
 */
#include "kp_signal.h"

/* Set once a thread pointer exists; until then reading through it would fault
 * (a static program before __libc_setup_tls). */
int kp_tls_ready;

unsigned long kp_platform_thread_key_slow(void)
{
	unsigned long fs = 0;
	kp_arch_thread_pointer_sys(&fs);
	if (!fs)
		return 0;
	kp_tls_ready = 1;
	kp_update_fast();
	return kp_arch_thread_pointer();
}

void *kp_platform_alloc(unsigned long size)
{
	size = (size + 4095) & ~4095UL;
	long p = kp_syscall6(__NR_mmap, 0, size, 3 /* RW */, 0x22 /* PRIVATE|ANON */, -1, 0);
	return p < 0 && p > -4096 ? 0 : (void *)p;
}

void kp_platform_write(int fd, const char *buf, unsigned long len)
{
	while (len) {
		long n = kp_syscall3(__NR_write, fd, buf, len);
		if (n == -4 /* EINTR */)
			continue;
		if (n <= 0)
			return;
		buf += n;
		len -= n;
	}
}

int kp_platform_open_append(const char *path)
{
	/* 0600: trace lines and the profile hold the program's data (perf writes
	 * perf.data so).  Never called in a privileged program (kp_secure_stack()). */
	return (int)kp_sys_open(path, 01 | 0100 | 02000 | 02000000 /* WRONLY|CREAT|APPEND|CLOEXEC */, 0600);
}

void kp_platform_close(int fd)
{
	kp_syscall3(__NR_close, fd, 0, 0);
}

/* --- the binary trace file (kp_trace.c): raw calls, as the rest of the runtime --- */

int kp_platform_open_rw(const char *path)
{
	return (int)kp_sys_open(path, 02 | 0100 | 02000000 /* RDWR|CREAT|CLOEXEC */, 0600);
}

long kp_platform_file_read(int fd, void *buf, unsigned long len)
{
	long got = 0;
	while ((unsigned long)got < len) {
		long r = kp_syscall3(__NR_read, fd, (char *)buf + got, len - got);
		if (r == -4)
			continue;
		if (r <= 0)
			break;
		got += r;
	}
	return got;
}

long kp_platform_file_size(int fd)
{
	return kp_syscall3(__NR_lseek, fd, 0, 2 /* SEEK_END */);
}

/* fallocate(2) never makes a file smaller, so threads and processes that grow it at once
 * need no lock; where the file system has no fallocate (EOPNOTSUPP), ftruncate(2) when the
 * file is shorter, the size read and set under a lock: two threads that each read the old
 * size must not let the smaller ftruncate() come last (it would cut the other's window
 * off, and its next store be a SIGBUS).  Processes that share the file can still race so. */
int kp_platform_file_grow(int fd, unsigned long size)
{
	static volatile int lock;
	long r = kp_syscall6(__NR_fallocate, fd, 0, 0, (long)size, 0, 0);
	if (r == -4)
		r = kp_syscall6(__NR_fallocate, fd, 0, 0, (long)size, 0, 0);
	if (r != -95 /* EOPNOTSUPP */ && r != -38 /* ENOSYS */)
		return (int)r;
	while (__atomic_exchange_n(&lock, 1, __ATOMIC_ACQUIRE))
		cpu_relax();
	r = 0;
	if (kp_platform_file_size(fd) < (long)size)
		r = kp_syscall3(__NR_ftruncate, fd, size, 0);
	__atomic_store_n(&lock, 0, __ATOMIC_RELEASE);
	return (int)r;
}

/* The window's pages faulted in here, writable, not at the stores of the hits that fill
 * it: MADV_POPULATE_WRITE (Linux 5.14; MAP_POPULATE only read-faults a shared mapping, and
 * each page's first store would still fault for page_mkwrite).  MADV_HUGEPAGE first lets
 * the page cache use large folios for it where the file system has them (ext4 since
 * 6.16): a few faults a window, not one a 4 KiB page.  Both are advice: where refused,
 * the stores fault the pages in as before. */
void *kp_platform_map_shared(int fd, unsigned long off, unsigned long len)
{
	long p = kp_syscall6(__NR_mmap, 0, len, 3 /* RW */, 0x01 /* SHARED */, fd, (long)off);
	if (p < 0 && p > -4096)
		return 0;
	kp_syscall3(__NR_madvise, p, len, 14 /* MADV_HUGEPAGE */);
	kp_syscall3(__NR_madvise, p, len, 23 /* MADV_POPULATE_WRITE */);
	return (void *)p;
}

void kp_platform_unmap(void *p, unsigned long len)
{
	kp_syscall3(__NR_munmap, p, len, 0);
}

int kp_platform_pwrite(int fd, const void *buf, unsigned long len, unsigned long off)
{
	while (len) {
		long n = kp_syscall6(__NR_pwrite64, fd, (long)buf, (long)len, (long)off, 0, 0);
		if (n == -4)
			continue;
		if (n <= 0)
			return -1;
		buf = (const char *)buf + n;
		len -= n;
		off += n;
	}
	return 0;
}

/* MADV_WIPEONFORK (Linux 4.14): a forked child finds the per-thread state zero, so it
 * claims chunks of its own and never writes into its parent's.  qemu-user ignores the
 * advice; the trace path then notices the child by its process id (kp_tc_read()). */
void *kp_platform_alloc_wipeonfork(unsigned long size)
{
	void *p = kp_platform_alloc(size);
	if (p)
		kp_syscall3(__NR_madvise, p, (size + 4095) & ~4095UL, 18 /* MADV_WIPEONFORK */);
	return p;
}

/*
 * Set-user-ID safety, glibc's __libc_enable_secure: a program the kernel marked
 * AT_SECURE in its auxiliary vector (set-user-ID, set-group-ID, file
 * capabilities, an LSM's say) ignores every KPREWRITE_* variable, which its
 * unprivileged caller set: probes stay armed as built, trace lines go to
 * standard error, no profile file, no profile signal.
 */
#define KP_AT_NULL 0
#define KP_AT_SECURE 23
#define KP_PR_GET_AUXV 0x41555856	/* Linux 6.4 */

/* AT_SECURE's value in an auxiliary vector of n entries; -1 if it has none. */
static int kp_auxv_secure(const unsigned long *auxv, unsigned long n)
{
	for (unsigned long i = 0; i < n && auxv[2 * i] != KP_AT_NULL; i++)
		if (auxv[2 * i] == KP_AT_SECURE)
			return auxv[2 * i + 1] != 0;
	return -1;
}

/* Where the initial stack is out of reach (a shared object's init gets the C
 * library's environ, which setenv() may have moved): the kernel's copy of the
 * vector, by prctl(PR_GET_AUXV), else /proc/self/auxv; else, as glibc did before
 * AT_SECURE, whether the real, effective and saved ids differ. */
static int kp_secure_slow(void)
{
	unsigned long auxv[128];
	long n = kp_syscall6(__NR_prctl, KP_PR_GET_AUXV, (long)auxv, sizeof(auxv), 0, 0, 0);
	if (n > 0) {
		int s = kp_auxv_secure(auxv, (unsigned long)n / 16 < 64 ? (unsigned long)n / 16 : 64);
		if (s >= 0)
			return s;
	}
	long fd = kp_sys_open("/proc/self/auxv", 02000000 /* RDONLY|CLOEXEC */, 0);
	if (fd >= 0) {
		long got = 0, r;
		while (got < (long)sizeof(auxv) &&
		       ((r = kp_syscall3(__NR_read, fd, (char *)auxv + got, sizeof(auxv) - got)) > 0 || r == -4))
			if (r > 0)
				got += r;
		kp_platform_close((int)fd);
		int s = kp_auxv_secure(auxv, (unsigned long)got / 16);
		if (s >= 0)
			return s;
	}
	unsigned int u[3] = { 0, 0, 0 }, g[3] = { 0, 0, 0 };
	kp_syscall3(__NR_getresuid, &u[0], &u[1], &u[2]);
	kp_syscall3(__NR_getresgid, &g[0], &g[1], &g[2]);
	return u[0] != u[1] || u[0] != u[2] || g[0] != g[1] || g[0] != g[2];
}

/* An executable's initial stack: argc, argv[], NULL, envp[], NULL, auxv[]. */
static int kp_secure_stack(char **envp)
{
	while (*envp)
		envp++;
	int s = kp_auxv_secure((const unsigned long *)(envp + 1), ~0UL / 2);
	return s >= 0 ? s : kp_secure_slow();
}

/* The environment the process started with, for a start-up that has no pointer to
 * it (kp_user_lib_early(): the dynamic loader is still relocating the object, and
 * the C library's environ is not set yet): /proc/self/environ, the kernel's copy of
 * the initial stack's strings, read into an array of our own.  0 if unreadable
 * (no /proc): the init function's envp configures the runtime then. */
static char **kp_initial_environ(void)
{
	long fd = kp_sys_open("/proc/self/environ", 02000000 /* RDONLY|CLOEXEC */, 0);
	if (fd < 0)
		return 0;
	unsigned long cap = 1 << 16, got = 0;
	char *buf = kp_platform_alloc(cap);
	while (buf) {
		if (got + 1 >= cap) {
			char *more = kp_platform_alloc(cap * 2);
			if (more)
				memcpy(more, buf, got);
			kp_platform_unmap(buf, cap);
			buf = more;
			cap *= 2;
			continue;
		}
		long r = kp_syscall3(__NR_read, fd, buf + got, cap - 1 - got);
		if (r == -4)
			continue;
		if (r <= 0)
			break;
		got += r;
	}
	kp_platform_close((int)fd);
	if (!buf)
		return 0;
	buf[got] = 0;
	unsigned long n = 0;
	for (unsigned long i = 0; i < got; i++)
		n += !buf[i];
	char **env = kp_platform_alloc((n + 2) * sizeof(char *));
	if (!env)
		return 0;
	unsigned long k = 0;
	for (unsigned long i = 0; i < got; i += strlen(buf + i) + 1)
		env[k++] = buf + i;
	env[k] = 0;
	return env;
}

/*
 * Start-up runs once, from whichever comes first: an executable's entry stub, a
 * shared object's first IFUNC resolver (kp_user_lib_early), its init function.
 * A library that can also run as a program (libc.so.6) has all three.
 */
static int kp_configured;

static void kp_user_configure(char **envp)
{
	if (__atomic_exchange_n(&kp_configured, 1, __ATOMIC_ACQ_REL))
		return;
	kp_configure(envp);
}

/* The exit work, once: whichever of the executable's exit function, the shared
 * object's fini function (or DT_FINI of ours) runs first writes the profile.  A
 * forked child that exits writes its own (the flag is the parent's as forked). */
static int kp_exited;
static void (*kp_saved_fini)(void);

static void kp_user_exit(void)
{
	if (__atomic_exchange_n(&kp_exited, 1, __ATOMIC_ACQ_REL))
		return;
	kp_trace_flush();	/* the trace lines gathered (kp_trace.c) */
	kp_profile_note = kp_trap_check();
	kp_write_profile();
}

/* What the program's start-up would have passed on: the ELF ABI's rdx at entry
 * (a function to run at exit), run after ours. */
static void kp_user_fini(void)
{
	kp_user_exit();
	if (kp_saved_fini)
		kp_saved_fini();
}

/*
 * Executables: called by the entry stub before the program's own entry point,
 * with the initial stack (argc, argv, envp) and rdx.  Returns the rdx to pass
 * on: our fini, which __libc_start_main registers with atexit like rtld_fini.
 */
void *kp_user_start(unsigned long *sp, void (*rtld_fini)(void))
{
	kp_relocate();
	long argc = (long)sp[0];
	char **envp = (char **)(sp + 1 + argc + 1);
	kp_user_configure(kp_secure_stack(envp) ? 0 : envp);	/* no environment: as built */
	kp_platform_thread_key();
	kp_trap_install();	/* breakpoint probes: the SIGTRAP handler */
	if (!kp_rt.profile_path && !kp_trace_buffered())
		return rtld_fini;
	kp_saved_fini = rtld_fini;
	return kp_user_fini;
}

/*
 * Shared objects, before any of their code runs: called by the stub each
 * IRELATIVE relocation's resolver is chained through, while the dynamic loader
 * relocates the object (C library or not: the loader's own state only), and
 * before libc's __libc_early_init.  Raw system calls only: relocate, configure
 * from the initial environment, and install the SIGTRAP handler, so that a
 * breakpoint probe in a resolver or in the C library's own start-up traps into
 * us.  The GOT hooks (kp_sighook.c) wait for the init function: they may call
 * through the object's PLT, which is not relocated yet.
 */
void kp_user_lib_early(void)
{
	static int done;
	if (__atomic_exchange_n(&done, 1, __ATOMIC_ACQ_REL))
		return;
	kp_relocate();
	if (kp_secure_slow())
		kp_user_configure(0);
	else {
		char **env = kp_initial_environ();
		if (env)
			kp_user_configure(env);
	}
	kp_platform_thread_key();
	kp_trap_handler_install();
}

/* Shared objects: called from the first DT_INIT_ARRAY entry, which glibc
 * calls with (argc, argv, envp). */
void kp_user_lib_init(int argc, char **argv, char **envp)
{
	(void)argc;
	(void)argv;
	kp_relocate();
	if (!kp_configured)
		kp_user_configure(kp_secure_slow() ? 0 : envp);	/* no environment: as built */
	kp_platform_thread_key();
	kp_trap_install();	/* breakpoint probes: the SIGTRAP handler, the GOT hooks */
}

/* Shared objects: called from the first DT_FINI_ARRAY entry, DT_FINI, or a
 * DT_FINI of ours (a library that has neither: glibc's libc.so.6). */
void kp_user_lib_fini(void)
{
	kp_user_exit();
}
