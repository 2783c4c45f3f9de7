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
	return (int)kp_sys_open(path, 01 | 0100 | 02000 | 02000000 /* WRONLY|CREAT|APPEND|CLOEXEC */, 0644);
}

void kp_platform_close(int fd)
{
	kp_syscall3(__NR_close, fd, 0, 0);
}

/* What the program's start-up would have passed on: the ELF ABI's rdx at entry
 * (a function to run at exit), or a shared object's first fini function. */
static void (*kp_saved_fini)(void);

static void kp_user_fini(void)
{
	kp_write_profile();
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
	kp_configure(envp);
	kp_platform_thread_key();
	kp_trap_install();	/* breakpoint probes: the SIGTRAP handler */
	if (!kp_rt.profile_path)
		return rtld_fini;
	kp_saved_fini = rtld_fini;
	return kp_user_fini;
}

/* Shared objects: called from the first DT_INIT_ARRAY entry, which glibc
 * calls with (argc, argv, envp). */
void kp_user_lib_init(int argc, char **argv, char **envp)
{
	(void)argc;
	(void)argv;
	kp_relocate();
	kp_configure(envp);
	kp_platform_thread_key();
	kp_trap_install();	/* breakpoint probes: the SIGTRAP handler */
}

/* Shared objects: called from the first DT_FINI_ARRAY entry. */
void kp_user_lib_fini(void)
{
	kp_write_profile();
}
