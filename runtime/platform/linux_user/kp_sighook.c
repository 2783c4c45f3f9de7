/*
 * Keeping our SIGTRAP handler installed in a program that manages signals
 * itself (see rewriter/targets/linux_user/sighook.py).  At start-up, the GOT slots of sigaction,
 * signal, sigprocmask and pthread_sigmask in the rewritten object are pointed
 * at the hooks below:
 *  - sigaction/signal on SIGTRAP never reach the kernel: the program's handler
 *    is recorded in kp_trap_chain, which gets every SIGTRAP that is not one of
 *    our traps, and the old disposition reported is the program's own view;
 *  - any other call loses the SIGTRAP bit from the masks it sets (sa_mask,
 *    SIG_BLOCK/SIG_SETMASK sets): a blocked SIGTRAP raised by a breakpoint makes the
 *    kernel reset it to SIG_DFL and kill the process.
 * The functions themselves are the program's own (libc's), called through the
 * address the slot held; with lazy binding the dynamic linker overwrites the
 * slot on that first call, so the hook re-arms itself afterwards.  The other
 * loaded objects' slots get the same hooks (kp_sighook_install_others()); on
 * x86-64 the C library's own system calls go through kp_signal_syscall()
 * (kp_signal.c).
 */
#include "kp_signal.h"


enum { KP_HOOK_SIGACTION = 1, KP_HOOK_SIGNAL, KP_HOOK_SIGPROCMASK, KP_HOOK_PTHREAD_SIGMASK, KP_HOOK_DLOPEN, KP_HOOK_MAX };

/* The C library's struct sigaction: the arch's (kp_arch_platform.h). */

static void *kp_real[KP_HOOK_MAX];

static int kp_hook_sigaction(int sig, const struct kp_libc_sigaction *act, struct kp_libc_sigaction *oact);
static void *kp_hook_signal(int sig, void *handler);
static int kp_hook_sigprocmask(int how, const unsigned long *set, unsigned long *old);
static int kp_hook_pthread_sigmask(int how, const unsigned long *set, unsigned long *old);

/* Each hook's entry, with the tag every runtime's hooks carry (the arch's
 * KP_ARCH_TAGGED_ENTRY_ASM(), kp_arch_platform.h): a slot of an object neither rewrote that
 * holds another runtime's hook is left to it (kp_sighook_install_others()). */
#define KP_HOOK_ENTRY(name) __asm__(KP_ARCH_TAGGED_ENTRY_ASM(#name, "kprwHOOK")); void name##_entry(void);
__attribute__((used)) static int kp_hook_sigaction(int sig, const struct kp_libc_sigaction *act, struct kp_libc_sigaction *oact);
__attribute__((used)) static void *kp_hook_signal(int sig, void *handler);
__attribute__((used)) static int kp_hook_sigprocmask(int how, const unsigned long *set, unsigned long *old);
__attribute__((used)) static int kp_hook_pthread_sigmask(int how, const unsigned long *set, unsigned long *old);
__attribute__((used)) static void *kp_hook_dlopen(const char *file, int mode);
KP_HOOK_ENTRY(kp_hook_sigaction)
KP_HOOK_ENTRY(kp_hook_signal)
KP_HOOK_ENTRY(kp_hook_sigprocmask)
KP_HOOK_ENTRY(kp_hook_pthread_sigmask)
KP_HOOK_ENTRY(kp_hook_dlopen)
#define KP_ENTRY(name) ((void *)name##_entry)

static void *kp_hook_fn(unsigned long kind)
{
	switch (kind) {
	case KP_HOOK_SIGACTION: return KP_ENTRY(kp_hook_sigaction);
	case KP_HOOK_SIGNAL: return KP_ENTRY(kp_hook_signal);
	case KP_HOOK_SIGPROCMASK: return KP_ENTRY(kp_hook_sigprocmask);
	case KP_HOOK_DLOPEN: return KP_ENTRY(kp_hook_dlopen);
	default: return KP_ENTRY(kp_hook_pthread_sigmask);
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

static void kp_sighook_install_others(void);

/* A query through the slot, whatever it holds (its PLT stub, or the function):
 * resolved by the dynamic linker if lazy. */
__attribute__((unused)) static void kp_resolve_any(unsigned long kind, unsigned long *slot)
{
	unsigned long old[16], v = *slot;
	struct kp_libc_sigaction sa;
	switch (kind) {
	case KP_HOOK_SIGACTION:
		kp_arch_call_lazy_slot(v, slot, KP_SIGTRAP, 0, (long)&sa);
		break;
	case KP_HOOK_SIGNAL:
		kp_arch_call_lazy_slot(v, slot, 9, (long)KP_SIG_DFL, 0);
		break;
	case KP_HOOK_DLOPEN:		/* the program itself, RTLD_LAZY|RTLD_NOLOAD: loads nothing */
		kp_arch_call_lazy_slot(v, slot, 0, 5, 0);
		break;
	default:
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
	kp_sighook_install_others();
}

/* The SIGTRAP handler (kp_signal.c), then the GOT hooks that keep it: what the start-up
 * calls when the image has breakpoint sites. */
void kp_trap_install(void)
{
	static int done;
	if (!kp_nbreakpoints || done)
		return;
	done = 1;
	kp_trap_handler_install();
	kp_sighook_install();
}

#define KP_R_GLOB_DAT KP_ARCH_R_GLOB_DAT
#define KP_R_JUMP_SLOT KP_ARCH_R_JUMP_SLOT
/*
 * The same hooks in the GOT of every other object loaded with the program (the
 * executable, when only a library is rewritten, and the other libraries), so
 * that their sigaction(SIGTRAP) & co. do not replace the handler our breakpoint
 * probes need: found in the dynamic loader's list of loaded objects (struct
 * r_debug, which it points the executable's DT_DEBUG at), their relocations
 * read from their dynamic sections; again after each dlopen() made through a
 * hooked slot, for the objects it brought in.  A slot is resolved first by a
 * call with no effect through it (lazy binding), and one that holds another
 * runtime's hook already is left to it.  What still replaces the handler (a raw
 * system call, a dlopen() through an object not hooked) kp_trap_check() reports
 * at exit.
 */
#define KP_AT_PHDR 3
#define KP_AT_PHNUM 5
#define KP_PT_DYNAMIC 2
#define KP_PT_PHDR 6
#define KP_PT_GNU_RELRO 0x6474e552
#define KP_DT_DEBUG 21

struct kp_phdr { unsigned int type, flags; unsigned long offset, vaddr, paddr, filesz, memsz, align; };
struct kp_dyn { long tag; unsigned long val; };
struct kp_sym { unsigned int name; unsigned char info, other; unsigned short shndx; unsigned long value, size; };
struct kp_rela { unsigned long offset, info; long addend; };
struct kp_link_map { unsigned long l_addr; char *l_name; struct kp_dyn *l_ld; struct kp_link_map *l_next, *l_prev; };
struct kp_r_debug { int r_version; struct kp_link_map *r_map; };

static unsigned long kp_auxv_value(unsigned long type)
{
	unsigned long auxv[128];
	long n = kp_syscall6(__NR_prctl, 0x41555856 /* PR_GET_AUXV */, (long)auxv, sizeof(auxv), 0, 0, 0);
	if (n <= 0) {
		long fd = kp_sys_open("/proc/self/auxv", 02000000, 0), r;
		n = 0;
		if (fd < 0)
			return 0;
		while (n < (long)sizeof(auxv) && ((r = kp_syscall3(__NR_read, fd, (char *)auxv + n, sizeof(auxv) - n)) > 0 || r == -4))
			if (r > 0)
				n += r;
		kp_syscall3(__NR_close, fd, 0, 0);
	}
	if (n > (long)sizeof(auxv))		/* PR_GET_AUXV: the whole vector's size */
		n = sizeof(auxv);
	for (long i = 0; i + 1 < n / 8 && auxv[i]; i += 2)
		if (auxv[i] == type)
			return auxv[i + 1];
	return 0;
}

static int kp_hook_kind(const char *name)
{
	static const struct { const char *name; int kind; } names[] = {
		{ "sigaction", KP_HOOK_SIGACTION }, { "__sigaction", KP_HOOK_SIGACTION },
		{ "signal", KP_HOOK_SIGNAL }, { "sysv_signal", KP_HOOK_SIGNAL }, { "__sysv_signal", KP_HOOK_SIGNAL },
		{ "bsd_signal", KP_HOOK_SIGNAL }, { "sigprocmask", KP_HOOK_SIGPROCMASK },
		{ "pthread_sigmask", KP_HOOK_PTHREAD_SIGMASK }, { "dlopen", KP_HOOK_DLOPEN },
	};
	for (unsigned int i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (!strcmp(name, names[i].name))
			return names[i].kind;
	return 0;
}

/* The RELRO range of the object whose program headers are at ph (n of them), load bias b. */
static void kp_relro_of(const struct kp_phdr *ph, unsigned long n, unsigned long b, unsigned long *lo, unsigned long *hi)
{
	*lo = *hi = 0;
	for (unsigned long i = 0; ph && i < n; i++)
		if (ph[i].type == KP_PT_GNU_RELRO) {
			*lo = b + ph[i].vaddr;
			*hi = *lo + ph[i].memsz;
		}
}

static int kp_real_lazy;	/* kp_real[KP_HOOK_DLOPEN] is a PLT stub still */

static void kp_hook_object(struct kp_link_map *l, const struct kp_phdr *ph, unsigned long phnum)
{
	unsigned long b = l->l_addr, symtab = 0, strtab = 0, tabs[2][2] = { { 0, 0 }, { 0, 0 } };
	for (struct kp_dyn *d = l->l_ld; d && d->tag; d++) {
		unsigned long v = d->val;
		if (b && v < b)		/* a read-only dynamic section (the vDSO's) is not relocated */
			v += b;
		switch (d->tag) {
		case 6: symtab = v; break;		/* DT_SYMTAB */
		case 5: strtab = v; break;		/* DT_STRTAB */
		case 23: tabs[0][0] = v; break;		/* DT_JMPREL */
		case 2: tabs[0][1] = d->val; break;	/* DT_PLTRELSZ */
		case 7: tabs[1][0] = v; break;		/* DT_RELA */
		case 8: tabs[1][1] = d->val; break;	/* DT_RELASZ */
		}
	}
	if (!symtab || !strtab)
		return;
	if (!ph) {		/* a library: its ELF header is at its load bias */
		const unsigned char *e = (const unsigned char *)b;
		if (b && e[0] == 0x7f && e[1] == 'E' && e[2] == 'L' && e[3] == 'F') {
			ph = (const struct kp_phdr *)(b + *(const unsigned long *)(e + 32));
			phnum = *(const unsigned short *)(e + 56);
		}
	}
	if (!ph)		/* its RELRO unknown: a slot there could not be written */
		return;
	unsigned long rlo, rhi, lo = ~0UL, hi = 0;
	kp_relro_of(ph, phnum, b, &rlo, &rhi);
	for (unsigned long i = 0; ph && i < phnum; i++)
		if (ph[i].type == 1 /* PT_LOAD */) {
			lo = b + ph[i].vaddr < lo ? b + ph[i].vaddr : lo;
			hi = b + ph[i].vaddr + ph[i].memsz > hi ? b + ph[i].vaddr + ph[i].memsz : hi;
		}
	for (int t = 0; t < 2; t++) {
		const struct kp_rela *r = (const struct kp_rela *)tabs[t][0];
		for (unsigned long i = 0; r && i < tabs[t][1] / sizeof(*r); i++) {
			unsigned int type = (unsigned int)r[i].info, si = (unsigned int)(r[i].info >> 32);
			if ((type != KP_R_GLOB_DAT && type != KP_R_JUMP_SLOT) || !si)
				continue;
			const struct kp_sym *sym = (const struct kp_sym *)symtab + si;
			int kind = sym->shndx ? 0 : kp_hook_kind((const char *)strtab + sym->name);
			if (!kind)
				continue;
			unsigned long *slot = (unsigned long *)(b + r[i].offset);
			if (!*slot || kp_arch_is_tagged_entry(*slot, "kprwHOOK"))
				continue;
			/* Still the object's own PLT stub (lazy binding): resolved by a call
			 * with no effect (counted by probes on it in a rewritten libc); on
			 * x86-64 not dlopen(), whose query would run much of the dynamic
			 * loader. */
			if (lo <= *slot && *slot < hi) {
				if (kind == KP_HOOK_DLOPEN) {
					/* Called through the stub: the dynamic linker resolves it over
					 * our hook, which the hook's scan after the call puts back
					 * (x86-64: AArch64's lazy slots all hold PLT0, which needs
					 * the slot's address in x16). */
#ifdef KP_ARCH_LAZY_SLOTS_HOLD_PLT0
					kp_resolve_any(kind, slot);	/* dlopen(NULL, RTLD_LAZY|RTLD_NOLOAD) */
#else
					if (!kp_real[kind])
						kp_real[kind] = (void *)*slot, kp_real_lazy = 1;
					kp_set_slot(slot, kp_hook_fn(kind), (unsigned long)slot >= rlo && (unsigned long)slot < rhi);
					continue;
#endif
				} else {
					kp_resolve_any(kind, slot);
				}
			}
			if (kind == KP_HOOK_DLOPEN && kp_real_lazy)
				kp_real[kind] = 0, kp_real_lazy = 0;
			if (!kp_real[kind])
				kp_real[kind] = (void *)*slot;
			kp_set_slot(slot, kp_hook_fn(kind), (unsigned long)slot >= rlo && (unsigned long)slot < rhi);
		}
	}
}

/* dlopen(): the objects it loaded get the hooks too. */
static void *kp_hook_dlopen(const char *file, int mode)
{
	void *r = ((void *(*)(const char *, int))kp_real[KP_HOOK_DLOPEN])(file, mode);
	if (r)
		kp_sighook_install_others();
	return r;
}

static void kp_sighook_install_others(void)
{
	const struct kp_phdr *ph = (const struct kp_phdr *)kp_auxv_value(KP_AT_PHDR);
	unsigned long phnum = kp_auxv_value(KP_AT_PHNUM), bias = 0, dyn = 0;
	int phdr = 0, interp = 0;
	for (unsigned long i = 0; ph && i < phnum; i++)
		if (ph[i].type == KP_PT_PHDR) {
			bias = (unsigned long)ph - ph[i].vaddr;
			phdr = 1;
		} else if (ph[i].type == 3 /* PT_INTERP */) {
			interp = 1;
		}
	/* No dynamic loader (a static program, static-PIE too): no other object; no
	 * PT_PHDR: the program's load bias, so its dynamic section, unknown. */
	if (!phdr || !interp)
		return;
	for (unsigned long i = 0; ph && i < phnum; i++)
		if (ph[i].type == KP_PT_DYNAMIC)
			dyn = bias + ph[i].vaddr;
	struct kp_r_debug *r = 0;
	for (struct kp_dyn *d = (struct kp_dyn *)dyn; d && d->tag; d++)
		if (d->tag == KP_DT_DEBUG)
			r = (struct kp_r_debug *)d->val;
	/* The objects hooked already, by load bias and dynamic section: a scan after
	 * dlopen() reads only the new ones (CPython loads dozens of modules). */
	static struct { unsigned long addr; void *ld; } seen[256];
	static unsigned int nseen;
	static int busy;	/* two threads' dlopen() */
	while (__atomic_exchange_n(&busy, 1, __ATOMIC_ACQUIRE))
		kp_syscall3(__NR_sched_yield, 0, 0, 0);	/* a dlopen() in another thread */
	for (struct kp_link_map *l = r ? r->r_map : 0; l; l = l->l_next) {
		if (l->l_addr == kp_rt.bias)	/* our own object: its slots are hooked above */
			continue;
		unsigned int i = 0;
		while (i < nseen && (seen[i].addr != l->l_addr || seen[i].ld != l->l_ld))
			i++;
		if (i < nseen)
			continue;
		kp_hook_object(l, l == r->r_map ? ph : 0, l == r->r_map ? phnum : 0);
		if (nseen < sizeof(seen) / sizeof(seen[0])) {
			seen[nseen].addr = l->l_addr;
			seen[nseen].ld = l->l_ld;
			nseen++;
		}
	}
	__atomic_store_n(&busy, 0, __ATOMIC_RELEASE);
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
		if (act && kp_trap_record_here()) {
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
		if (kp_trap_record_here()) {	/* not in a vfork() child (kp_signal.c) */
			kp_trap_chain.handler = handler;
			kp_trap_chain.mask = 0;
			kp_trap_chain.flags = KP_SA_RESTART;	/* glibc's signal(): BSD semantics */
		}
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
