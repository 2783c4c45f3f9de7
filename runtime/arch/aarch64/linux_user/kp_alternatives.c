/*
 * The light detours' increment chosen at start-up, as the kernel's alternatives
 * choose LSE atomics (ARM64_HAS_LSE_ATOMICS): kprewrite writes each light detour
 * (rewriter/arch/aarch64/emit.py, light_detour()) with an LDXR/STXR increment, which
 * every ARMv8.0 CPU runs, reached by the two words
 *
 *	cbnz wV, tail		(kp_fast: 1 when armed, the increment)
 *	b slow
 *
 * at kp_light_alt[i] (link-time addresses, sorted: emit.light_alternatives_c()).  Where the
 * CPU has LSE atomics (AT_HWCAP's HWCAP_ATOMICS, ARMv8.1) they become
 *
 *	cbz wV, slow
 *	stadd xV, [xA]		(A: the register the tail's LDXR reads)
 *
 * so a hit runs no LDXR/STXR loop and saves no third register.  Called once, from
 * kp_relocate(), before kprobes are armed (kp_fast is 0 until then, so no detour
 * runs past the first word yet), while start-up runs on one thread.  Each page is
 * never writable and executable at once, nor ever not executable (this code may
 * share a page with the detours): a copy is made in a fresh writable page,
 * patched, made read-only and executable, then moved over the original with
 * mremap(MREMAP_FIXED), which replaces the mapping in one step.  Any failure (no
 * /proc/self/auxv to read, pages other than 4 KiB, a word not as expected, a system
 * call refused) leaves the LDXR/STXR words, which are right on every CPU, only slower.
 *
 * Compiled as one unit with kp_brk_signal.c (the linux_user recipe's arch file).
 */
#define KP_AT_HWCAP 16
#define KP_HWCAP_ATOMICS (1UL << 8)
#define KP_AT_PAGESZ 6
#define KP_AT_HWCAP2 26
#define KP_HWCAP2_BTI (1UL << 17)

/* Where the image has no light site, emit/tables.py writes no table: none to patch. */
__attribute__((weak)) const unsigned long kp_light_alt[1];
__attribute__((weak)) const unsigned int kp_nlight_alt;
/* The image's code pages are BTI-guarded (its property note): the copies stay so. */
__attribute__((weak)) const unsigned int kp_light_alt_bti;

/* kp_light_alt, through a pointer whose bounds the compiler cannot see: the weak
 * definition above is one element long, and GCC would take it that no loop reads
 * past it; the table emit/tables.py writes is longer. */
static const unsigned long *kp_alt_table(void)
{
	const unsigned long *t = kp_light_alt;
	__asm__("" : "+r"(t));
	return t;
}

/* AT_HWCAP, AT_HWCAP2 and AT_PAGESZ from /proc/self/auxv (an executable's initial stack is not
 * at hand in kp_relocate(), nor a shared object's; prctl(PR_GET_AUXV) is not asked:
 * Linux has it from 6.4 only, and QEMU 7.2's user mode refuses it).  0 when unreadable. */
static unsigned long kp_alt_auxv(unsigned long *hwcap2, unsigned long *pagesz)
{
	unsigned long auxv[128], hwcap = 0;
	long fd = kp_sys_open("/proc/self/auxv", 02000000 /* RDONLY|CLOEXEC */, 0), got = 0, r;
	if (fd < 0)
		return 0;
	while (got < (long)sizeof(auxv) &&
	       ((r = kp_syscall3(__NR_read, fd, (char *)auxv + got, sizeof(auxv) - got)) > 0 || r == -4))
		if (r > 0)
			got += r;
	kp_syscall3(__NR_close, fd, 0, 0);
	for (long i = 0; i < got / 16 && auxv[2 * i]; i++) {
		if (auxv[2 * i] == KP_AT_HWCAP)
			hwcap = auxv[2 * i + 1];
		else if (auxv[2 * i] == KP_AT_HWCAP2)
			*hwcap2 = auxv[2 * i + 1];
		else if (auxv[2 * i] == KP_AT_PAGESZ)
			*pagesz = auxv[2 * i + 1];
	}
	return hwcap;
}

/* The LSE words for the pair at `at` (run-time address), from the LDXR/STXR ones
 * there; 0 if they are not what light_detour() writes. */
static int kp_alt_words(const unsigned int *at, unsigned int out[2])
{
	unsigned int w0 = at[0], w1 = at[1];
	if ((w0 & 0xFF000000u) != 0x35000000u || (w1 & 0xFC000000u) != 0x14000000u)
		return 0;	/* cbnz wV, tail; b slow */
	unsigned int v = w0 & 31;
	long tail = (long)((int)(w0 << 8) >> 13);	/* imm19, in words */
	long slow = 1 + (long)((int)(w1 << 6) >> 6);	/* imm26, from at[0] */
	const unsigned int *t = at + tail;
	/* The tail: str xS, [sp, #-16]!; ldxr xV, [xA]. */
	if ((t[0] & 0xFFFFFFE0u) != 0xF81F0FE0u || (t[1] & 0xFFFFFC1Fu) != (0xC85F7C00u | v))
		return 0;
	unsigned int a = (t[1] >> 5) & 31;
	if (slow < -(1L << 18) || slow >= (1L << 18))
		return 0;
	out[0] = 0x34000000u | (((unsigned int)slow & 0x7FFFFu) << 5) | v;	/* cbz wV, slow */
	out[1] = 0xF820001Fu | (v << 16) | (a << 5);				/* stadd xV, [xA] */
	return 1;
}

/* Pairs [i, j), on the page at `page`: patched in a copy moved over it.  A pair across
 * the page's end (none: a light detour starts a 64-byte line) is left as it is. */
static int kp_alt_page(const unsigned long *alt, unsigned long page, unsigned long size, unsigned long bias,
		       long prot, const unsigned int (*words)[2], unsigned int i, unsigned int j)
{
	char *tmp = (char *)kp_syscall6(__NR_mmap, 0, size, 3 /* RW */, 0x22 /* PRIVATE|ANONYMOUS */, -1, 0);
	if ((unsigned long)tmp >= -4096UL)
		return 0;
	memcpy(tmp, (const void *)page, size);
	for (; i < j; i++) {
		unsigned long off = alt[i] + bias - page;
		if (off > size - 8)
			continue;
		unsigned int *p = (unsigned int *)(tmp + off);
		p[0] = words[i][0];
		p[1] = words[i][1];
		/* To the point of unification, the old instructions dropped (both words lie in
		 * one 64-byte line). */
		__asm__ volatile("dc cvau, %0\n\tdsb ish\n\tic ivau, %0\n\tdsb ish" :: "r"(p) : "memory");
	}
	if (kp_syscall3(__NR_mprotect, tmp, size, prot) < 0 ||
	    kp_syscall6(__NR_mremap, (long)tmp, size, size, 3 /* MAYMOVE|FIXED */, page, 0) != (long)page) {
		kp_syscall3(__NR_munmap, tmp, size, 0);
		return 0;
	}
	__asm__ volatile("isb" ::: "memory");
	return 1;
}

void kp_arch_text_alternatives(unsigned long bias)
{
	unsigned int n = kp_nlight_alt;
	const unsigned long *alt = kp_alt_table();
	if (!n)
		return;
	unsigned long pagesz = 0, hwcap2 = 0;
	/* 4 KiB pages only: the new segments are laid out 4 KiB-aligned, so a larger
	 * page could hold another segment's data too. */
	if (!(kp_alt_auxv(&hwcap2, &pagesz) & KP_HWCAP_ATOMICS) || pagesz != 4096)
		return;
	/* R|X, and PROT_BTI where the loader guarded the image's pages: its property note
	 * claims BTI and the CPU has it. */
	long prot = 5 | (kp_light_alt_bti && (hwcap2 & KP_HWCAP2_BTI) ? 0x10 : 0);
	/* Every pair checked before any is patched: none if one is not as written.  A
	 * page that cannot be replaced keeps its LDXR/STXR words. */
	unsigned int (*words)[2] = kp_platform_alloc(n * sizeof(*words));
	if (!words)
		return;
	for (unsigned int i = 0; i < n; i++)
		if (!kp_alt_words((const unsigned int *)(alt[i] + bias), words[i]))
			goto out;
	/* The table is sorted (emit/tables.py): one copy a page. */
	for (unsigned int i = 0, j; i < n; i = j) {
		unsigned long page = (alt[i] + bias) & -pagesz;
		for (j = i + 1; j < n && ((alt[j] + bias) & -pagesz) == page; j++)
			;
		kp_alt_page(alt, page, pagesz, bias, prot, (const unsigned int (*)[2])words, i, j);
	}
out:
	kp_syscall3(__NR_munmap, words, (n * sizeof(*words) + 4095) & -4096UL, 0);
}
