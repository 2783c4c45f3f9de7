/*
 * Platform layer for breakpoint probes in a Linux user process: the SIGTRAP
 * handler is the user-space stand-in for the kernel's #BP/#DB entries.
 *
 * Installed at start-up with a raw rt_sigaction and our own restorer (no libc):
 *  - SA_SIGINFO, for the machine context;
 *  - SA_NODEFER, and SIGTRAP never blocked: a synchronous SIGTRAP that arrives
 *    while blocked makes the kernel reset the handler to SIG_DFL and kill the
 *    process, and a handler may hit another probe (counted in nmissed);
 *  - sa_mask blocks every other asynchronous signal while handlers run, so a
 *    program's signal handler cannot interleave with ours on this thread (it
 *    runs after, at the out-of-line copy or the resume address); the synchronous
 *    faults (SEGV BUS ILL FPE) stay unblocked for the same reason as SIGTRAP;
 *  - no SA_ONSTACK: the trap runs on the probed thread's stack below its red
 *    zone, like the program's own code would, and leaves a program's
 *    sigaltstack to the program;
 *  - SA_RESTART, so a trap never makes a system call fail with EINTR.
 * Traps that are not ours (sent with kill/raise, or a breakpoint of the
 * program's own) go to the disposition that was there before us, or the one the program
 * set since through the hooks in kp_sighook.c.
 */
#include "kp_signal.h"


__attribute__((visibility("hidden"), used)) void kp_sigtrap(int sig, struct kp_siginfo *info, void *uc);

/*
 * The handler's address as installed: an entry that starts with a `jmp` (on
 * AArch64 `bti c; b`) over 8 bytes every kprewrite runtime's has
 * (kp_trap_is_a_runtime(); the arch's KP_ARCH_TAGGED_ENTRY_ASM()), so
 * that a runtime that finds another's handler installed over its own at exit
 * knows it was chained (two rewritten libraries), not replaced by the program.
 */
__asm__(KP_ARCH_TAGGED_ENTRY_ASM("kp_sigtrap", "kprwSIGT"));
void kp_sigtrap_entry(int sig, struct kp_siginfo *info, void *uc);
#define KP_SIGTRAP_ENTRY kp_sigtrap_entry
#define kp_trap_is_a_runtime(h) kp_arch_is_tagged_entry((unsigned long)(h), "kprwSIGT")

struct kp_ksigaction kp_trap_chain;
static int kp_trap_installed;	/* the handler is ours: a sigaction(SIGTRAP) is recorded, not made */
static long kp_trap_pid;	/* the process whose kp_trap_chain this memory holds */

/*
 * Whether a sigaction(SIGTRAP) made now is to be recorded in kp_trap_chain:
 * not in a child that shares its parent's memory (vfork(), posix_spawn()'s
 * and CPython's children resetting every handler before exec), whose record
 * would change the parent's chain.  There it is answered from the chain and
 * dropped: made, it would take our handler from the child, whose breakpoint
 * probes still fire until exec (which resets every handler anyway).  A forked
 * child has memory of its own: it records, and takes the chain as its own.
 */
int kp_trap_record_here(void)
{
	long pid = kp_syscall3(__NR_getpid, 0, 0, 0);
	if (pid == __atomic_load_n(&kp_trap_pid, __ATOMIC_RELAXED))
		return 1;
	long ppid = kp_syscall3(__NR_getppid, 0, 0, 0);
	if (kp_syscall6(__NR_kcmp, pid, ppid, 1 /* KCMP_VM */, 0, 0, 0) == 0)
		return 0;
	__atomic_store_n(&kp_trap_pid, pid, __ATOMIC_RELAXED);
	return 1;
}

/* The SIGTRAP handler alone: what an early start-up can do (kp_user_lib_early()). */
void kp_trap_handler_install(void)
{
	static int done;
	if (!kp_nbreakpoints || __atomic_exchange_n(&done, 1, __ATOMIC_ACQ_REL))
		return;
	struct kp_ksigaction sa = {
		.handler = (void *)KP_SIGTRAP_ENTRY,
		.flags = KP_SA_SIGINFO | KP_SA_RESTORER | KP_SA_NODEFER | KP_SA_RESTART,
		.restorer = kp_arch_sigreturn,
		.mask = ~(KP_SIGBIT(KP_SIGTRAP) | KP_SIGBIT(11) | KP_SIGBIT(7) | KP_SIGBIT(4) | KP_SIGBIT(8)),
	};
	kp_syscall6(__NR_rt_sigaction, KP_SIGTRAP, (long)&sa, (long)&kp_trap_chain, 8, 0, 0);
	if (kp_trap_chain.handler == (void *)KP_SIGTRAP_ENTRY)	/* never chain to ourselves */
		kp_trap_chain.handler = 0;
	kp_trap_pid = kp_syscall3(__NR_getpid, 0, 0, 0);
	__atomic_store_n(&kp_trap_installed, 1, __ATOMIC_RELEASE);
}

/* Deliver a SIGTRAP that is not ours as the kernel would have without us. */
static void kp_trap_forward(int sig, struct kp_siginfo *info, void *uc)
{
	void *h = kp_trap_chain.handler;
	/* A trap the CPU raised cannot be ignored: the kernel forces it to the
	 * default action (force_sig); a sent SIGTRAP can. */
	if (h == KP_SIG_IGN && info->si_code <= 0)
		return;
	if (h == KP_SIG_DFL || h == KP_SIG_IGN) {
		/* Terminate with a core dump, as the default action: drop our
		 * handler, and send it again to this thread; it is delivered as
		 * soon as this handler returns (SIGTRAP is not blocked). */
		struct kp_ksigaction dfl = { 0 };
		kp_syscall6(__NR_rt_sigaction, KP_SIGTRAP, (long)&dfl, 0, 8, 0, 0);
		kp_syscall3(__NR_tgkill, kp_syscall3(__NR_getpid, 0, 0, 0), kp_syscall3(__NR_gettid, 0, 0, 0), KP_SIGTRAP);
		return;
	}
	/* Another rewritten object's runtime (installed before us): its handler
	 * keeps the mask as ours does, no system call needed around it. */
	if (kp_trap_is_a_runtime(h)) {
		((void (*)(int, struct kp_siginfo *, void *))h)(sig, info, uc);
		return;
	}
	/* The program's handler, under its sa_mask (SIGTRAP itself stays
	 * deliverable, see above); SA_RESETHAND is honoured. */
	unsigned long *ucmask = (unsigned long *)((char *)uc + KP_UC_SIGMASK);
	unsigned long mask = (*ucmask | kp_trap_chain.mask) & ~KP_SIGBIT(KP_SIGTRAP), old;
	unsigned long flags = kp_trap_chain.flags;
	if (flags & KP_SA_RESETHAND)
		kp_trap_chain.handler = KP_SIG_DFL;
	kp_syscall6(__NR_rt_sigprocmask, 2 /* SIG_SETMASK */, (long)&mask, (long)&old, 8, 0, 0);
	if (flags & KP_SA_SIGINFO)
		((void (*)(int, struct kp_siginfo *, void *))h)(sig, info, uc);
	else
		((void (*)(int))h)(sig);
	kp_syscall6(__NR_rt_sigprocmask, 2, (long)&old, 0, 8, 0, 0);
}

void kp_sigtrap(int sig, struct kp_siginfo *info, void *uc)
{
	kp_arch_signal_entry();
	/* si_code > 0: raised by the CPU (x86-64: SI_KERNEL for int3, TRAP_TRACE or,
	 * under QEMU, TRAP_BRKPT for the single-step); <= 0: sent by a process. */
	if (info->si_code > 0 && kp_breakpoint_sigtrap(uc))
		return;
	kp_trap_forward(sig, info, uc);
}

/*
 * The rewritten image's own rt_sigprocmask and rt_sigaction system calls, sent
 * here by the stubs its `syscall` instructions jump to (the rewriter's
 * Rules.signal_syscalls, where the image has breakpoint sites): what the GOT
 * hooks (kp_sighook.c) do for calls through the GOT, for the calls a C library
 * makes itself (glibc's pthread_create() and posix_spawn() block every signal
 * with a raw system call; a rewritten libc.so.6 or a static program's libc
 * implements sigaction() itself):
 *  - a mask set loses the SIGTRAP bit (blocked, a breakpoint would kill the process);
 *  - sigaction(SIGTRAP) only records the program's handler once ours is
 *    installed (traps that are not ours go to it: kp_trap_forward()), and reports
 *    the program's own view back; another signal's sa_mask loses SIGTRAP.
 * Called with the system call's arguments and number; returns its result.
 */
long kp_signal_syscall(long a0, long a1, long a2, long a3, long nr)
{
	unsigned long mask;
	struct kp_ksigaction copy;
	if (nr == __NR_rt_sigprocmask) {
		const unsigned long *set = (const unsigned long *)a1;
		if (set && a0 != 1 /* SIG_UNBLOCK */ && a3 == 8 && (set[0] & KP_SIGBIT(KP_SIGTRAP))) {
			mask = set[0] & ~KP_SIGBIT(KP_SIGTRAP);
			a1 = (long)&mask;
		}
	} else if (nr == __NR_rt_sigaction) {
		const struct kp_ksigaction *act = (const struct kp_ksigaction *)a1;
		if (a0 == KP_SIGTRAP && a3 == 8 && __atomic_load_n(&kp_trap_installed, __ATOMIC_ACQUIRE)) {
			struct kp_ksigaction prev = kp_trap_chain;
			if (act && kp_trap_record_here())
				kp_trap_chain = *act;
			if (a2)
				*(struct kp_ksigaction *)a2 = prev;
			return 0;
		}
		if (act && a3 == 8 && (act->mask & KP_SIGBIT(KP_SIGTRAP))) {
			copy = *act;
			copy.mask &= ~KP_SIGBIT(KP_SIGTRAP);
			a1 = (long)&copy;
		}
	}
	return kp_syscall6(nr, a0, a1, a2, a3, 0, 0);
}

/*
 * At exit: whether the program replaced our SIGTRAP handler behind the runtime's
 * back (a sigaction the hooks did not see: made in an object that is not
 * rewritten and not hooked, a library dlopen()ed later, a raw system call).  Its
 * handler then got the traps of our breakpoint probes, which did not fire, and
 * the program may have run wrong.  Says so once on standard error; returns the
 * line for the profile, or 0.
 */
const char *kp_trap_check(void)
{
	static const char line[] = "kprewrite: the program replaced the SIGTRAP handler of the breakpoint probes "
				   "(a sigaction the runtime did not see): their traps went to its handler\n";
	static int said;
	if (!__atomic_load_n(&kp_trap_installed, __ATOMIC_ACQUIRE))
		return 0;
	struct kp_ksigaction cur;
	if (kp_syscall6(__NR_rt_sigaction, KP_SIGTRAP, 0, (long)&cur, 8, 0, 0) != 0 || kp_trap_is_a_runtime(cur.handler))
		return 0;
	if (!__atomic_exchange_n(&said, 1, __ATOMIC_ACQ_REL))
		kp_syscall3(__NR_write, 2, line, sizeof(line) - 1);
	return line;
}
