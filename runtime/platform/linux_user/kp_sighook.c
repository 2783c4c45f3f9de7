/*
 * Keeping our SIGTRAP handler installed in a program that manages signals
 * itself (see rewriter/targets/linux_user/sighook.py).  At start-up, the GOT slots of sigaction,
 * signal, sigprocmask and pthread_sigmask in the rewritten object are pointed
 * at the hooks below:
 *  - sigaction/signal on SIGTRAP never reach the kernel: the program's handler
 *    is recorded in kp_trap_chain, which gets every SIGTRAP that is not one of
 *    our traps, and the old disposition reported is the program's own view;
 *  - any other call loses the SIGTRAP bit from the masks it sets (sa_mask,
 *    SIG_BLOCK/SIG_SETMASK sets): a blocked SIGTRAP raised by an int3 makes the
 *    kernel reset it to SIG_DFL and kill the process.
 * The functions themselves are the program's own (libc's), called through the
 * address the slot held; with lazy binding the dynamic linker overwrites the
 * slot on that first call, so the hook re-arms itself afterwards.
 */
#include "kp_signal.h"


enum { KP_HOOK_SIGACTION = 1, KP_HOOK_SIGNAL, KP_HOOK_SIGPROCMASK, KP_HOOK_PTHREAD_SIGMASK, KP_HOOK_MAX };

/* The C library's struct sigaction: the arch's (kp_arch_platform.h). */

static void *kp_real[KP_HOOK_MAX];

static int kp_hook_sigaction(int sig, const struct kp_libc_sigaction *act, struct kp_libc_sigaction *oact);
static void *kp_hook_signal(int sig, void *handler);
static int kp_hook_sigprocmask(int how, const unsigned long *set, unsigned long *old);
static int kp_hook_pthread_sigmask(int how, const unsigned long *set, unsigned long *old);

static void *kp_hook_fn(unsigned long kind)
{
	switch (kind) {
	case KP_HOOK_SIGACTION: return (void *)kp_hook_sigaction;
	case KP_HOOK_SIGNAL: return (void *)kp_hook_signal;
	case KP_HOOK_SIGPROCMASK: return (void *)kp_hook_sigprocmask;
	default: return (void *)kp_hook_pthread_sigmask;
	}
}

static void kp_set_slot(unsigned long *slot, void *fn, int relro)
{
	unsigned long page = (unsigned long)slot & ~4095UL;
	if (relro)
		kp_syscall3(__NR_mprotect, page, 4096, 3 /* RW */);
	__atomic_store_n(slot, (unsigned long)fn, __ATOMIC_RELEASE);
	if (relro)
		kp_syscall3(__NR_mprotect, page, 4096, 1 /* R */);
}

/*
 * A slot still holding its PLT stub (lazy binding) is resolved now, by a call
 * with no effect through the stub: resolved later from a hook, the dynamic
 * linker would write the real address into the slot before the hook could
 * re-arm it, and another thread calling in that window (pthread_sigmask
 * blocking everything, say) would bypass the hook and die at its next trap.
 */
static void kp_resolve_lazy(unsigned long kind, unsigned long *slot)
{
	unsigned long v = *slot, bias = kp_rt.bias;
	if (v < kp_plt_start + bias || v >= kp_plt_end + bias)
		return;
	unsigned long old[16];
	struct kp_libc_sigaction sa;
	/* Through the arch, which enters the slot's value as the PLT entry would
	 * (kp_arch_platform.h: on AArch64 it is PLT0 itself). */
	switch (kind) {
	case KP_HOOK_SIGACTION:		/* a query */
		kp_arch_call_lazy_slot(v, slot, KP_SIGTRAP, 0, (long)&sa);
		break;
	case KP_HOOK_SIGNAL:		/* SIGKILL cannot be caught: EINVAL, nothing changes */
		kp_arch_call_lazy_slot(v, slot, 9, (long)KP_SIG_DFL, 0);
		break;
	default:			/* SIG_BLOCK with no set: a query */
		kp_arch_call_lazy_slot(v, slot, 0, 0, (long)old);
		break;
	}
}

void kp_sighook_install(void)
{
	unsigned long bias = kp_rt.bias;
	for (unsigned int i = 0; i < kp_ngot_hooks; i++) {
		struct kp_got_hook *h = &kp_got_hooks[i];
		unsigned long *slot = (unsigned long *)(h->got + bias);
		kp_resolve_lazy(h->kind, slot);
		if (!kp_real[h->kind])
			kp_real[h->kind] = (void *)*slot;
		kp_set_slot(slot, kp_hook_fn(h->kind), h->got >= kp_relro_start && h->got < kp_relro_end);
	}
}

/* After a call through the real function: lazy binding may have replaced our
 * hook with the resolved address; keep that as the real one, and re-arm. */
static void kp_rearm(unsigned long kind)
{
	unsigned long bias = kp_rt.bias;
	void *fn = kp_hook_fn(kind);
	for (unsigned int i = 0; i < kp_ngot_hooks; i++) {
		struct kp_got_hook *h = &kp_got_hooks[i];
		unsigned long *slot = (unsigned long *)(h->got + bias);
		unsigned long cur = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
		if (h->kind != kind || cur == (unsigned long)fn)
			continue;
		kp_real[kind] = (void *)cur;
		kp_set_slot(slot, fn, h->got >= kp_relro_start && h->got < kp_relro_end);
	}
}

static int kp_hook_sigaction(int sig, const struct kp_libc_sigaction *act, struct kp_libc_sigaction *oact)
{
	if (sig == KP_SIGTRAP) {
		struct kp_ksigaction prev = kp_trap_chain;
		if (act) {
			kp_trap_chain.handler = act->handler;
			kp_trap_chain.mask = act->mask[0];
			kp_trap_chain.flags = (unsigned int)act->flags;
			kp_trap_chain.restorer = act->restorer;
		}
		if (oact) {
			memset(oact, 0, sizeof(*oact));
			oact->handler = prev.handler;
			oact->mask[0] = prev.mask;
			oact->flags = (int)prev.flags;
			oact->restorer = prev.restorer;
		}
		return 0;
	}
	struct kp_libc_sigaction copy;
	if (act && (act->mask[0] & KP_SIGBIT(KP_SIGTRAP))) {
		copy = *act;
		copy.mask[0] &= ~KP_SIGBIT(KP_SIGTRAP);
		act = &copy;
	}
	int r = ((int (*)(int, const struct kp_libc_sigaction *, struct kp_libc_sigaction *))
		 kp_real[KP_HOOK_SIGACTION])(sig, act, oact);
	kp_rearm(KP_HOOK_SIGACTION);
	return r;
}

static void *kp_hook_signal(int sig, void *handler)
{
	if (sig == KP_SIGTRAP) {
		void *old = kp_trap_chain.handler;
		kp_trap_chain.handler = handler;
		kp_trap_chain.mask = 0;
		kp_trap_chain.flags = KP_SA_RESTART;	/* glibc's signal(): BSD semantics */
		return old;
	}
	void *r = ((void *(*)(int, void *))kp_real[KP_HOOK_SIGNAL])(sig, handler);
	kp_rearm(KP_HOOK_SIGNAL);
	return r;
}

static const unsigned long *kp_unblock_trap(int how, const unsigned long *set, unsigned long *copy)
{
	if (!set || how == 1 /* SIG_UNBLOCK */ || !(set[0] & KP_SIGBIT(KP_SIGTRAP)))
		return set;
	memcpy(copy, set, 128);
	copy[0] &= ~KP_SIGBIT(KP_SIGTRAP);
	return copy;
}

static int kp_hook_sigprocmask(int how, const unsigned long *set, unsigned long *old)
{
	unsigned long copy[16];
	int r = ((int (*)(int, const unsigned long *, unsigned long *))kp_real[KP_HOOK_SIGPROCMASK])
		(how, kp_unblock_trap(how, set, copy), old);
	kp_rearm(KP_HOOK_SIGPROCMASK);
	return r;
}

static int kp_hook_pthread_sigmask(int how, const unsigned long *set, unsigned long *old)
{
	unsigned long copy[16];
	int r = ((int (*)(int, const unsigned long *, unsigned long *))kp_real[KP_HOOK_PTHREAD_SIGMASK])
		(how, kp_unblock_trap(how, set, copy), old);
	kp_rearm(KP_HOOK_PTHREAD_SIGMASK);
	return r;
}
