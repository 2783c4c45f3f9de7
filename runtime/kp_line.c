/*
 * One line of text being built (struct kp_line, kp_line.h): characters, strings, decimal
 * and hex numbers, and %pS symbols, each cut at the line's end.  What the trace events
 * (kp_trace.c, the kernel's kp_trace_buffer.c) and the fetch engine's print functions
 * (kp_fetch.c) write with; the kernel's seq_buf/trace_seq.
 */
#include "kp_trace.h"

void kp_line_putc(struct kp_line *l, char ch)
{
	if (l->p < l->end)
		*l->p++ = ch;
}

/* n bytes in one copy (a precomputed part of the line). */
void kp_line_put(struct kp_line *l, const char *s, unsigned long n)
{
	if (n > (unsigned long)(l->end - l->p))
		n = l->end - l->p;
	memcpy(l->p, s, n);
	l->p += n;
}

void kp_line_puts(struct kp_line *l, const char *s)
{
	while (*s && l->p < l->end)
		*l->p++ = *s++;
}

void kp_line_dec(struct kp_line *l, unsigned long v, int neg, int width, int left)
{
	char tmp[24];
	int n = 0;
	do {
		tmp[n++] = '0' + v % 10;
		v /= 10;
	} while (v);
	if (neg)
		tmp[n++] = '-';
	int pad = width > n ? width - n : 0;
	if (!left)
		while (pad-- > 0)
			kp_line_putc(l, ' ');
	while (n)
		kp_line_putc(l, tmp[--n]);
	if (left)
		while (pad-- > 0)
			kp_line_putc(l, ' ');
}

void kp_line_hex(struct kp_line *l, unsigned long v, int width)
{
	char tmp[16];
	int n = 0;
	do {
		tmp[n++] = "0123456789abcdef"[v & 15];
		v >>= 4;
	} while (v);
	while (width-- > n)
		kp_line_putc(l, '0');
	while (n)
		kp_line_putc(l, tmp[--n]);
}

/* %pS: "sym+0xoff/0xsize" from the compiled symbol table (or the platform's
 * kallsyms), else the address. */
void kp_line_sym(struct kp_line *l, unsigned long addr, int with_offset)
{
#ifdef KP_PLATFORM_KALLSYMS
	char name[KP_PLATFORM_SYM_LEN];
	name[0] = 0;
	kp_platform_symbol(name, addr, with_offset);
	kp_line_puts(l, name);
	return;
#endif
	unsigned long a = addr - kp_rt.bias;
	unsigned int lo = 0, hi = kp_nsyms;
	while (lo < hi) {
		unsigned int mid = (lo + hi) / 2;
		if (kp_syms[mid].addr <= a)
			lo = mid + 1;
		else
			hi = mid;
	}
	if (lo && a - kp_syms[lo - 1].addr < kp_syms[lo - 1].size) {
		const struct kp_sym *s = &kp_syms[lo - 1];
		kp_line_puts(l, kp_symnames + s->name);
		if (with_offset) {
			kp_line_puts(l, "+0x");
			kp_line_hex(l, a - s->addr, 0);
			kp_line_puts(l, "/0x");
			kp_line_hex(l, s->size, 0);
		}
		return;
	}
	kp_line_puts(l, "0x");
	kp_line_hex(l, addr, 0);
}
