/*
 * printk and vsnprintf: the kernel's format subset (%d %i %u %x %X %p %s %c %%
 * with l, ll, z and width/zero-pad/left-align), freestanding.  Each printk is
 * one write, so lines from concurrent threads never interleave mid-line.
 */
#include "kp_internal.h"

struct kp_buf { char *p; size_t left; int len; };

static void put(struct kp_buf *b, char c)
{
	if (b->left > 1) {
		*b->p++ = c;
		b->left--;
	}
	b->len++;
}

static void put_num(struct kp_buf *b, unsigned long long v, int neg, unsigned base, int upper,
		    int width, int zero, int left)
{
	char tmp[24];
	const char *digits = upper ? "0123456789ABCDEF" : "0123456789abcdef";
	int n = 0;
	do {
		tmp[n++] = digits[v % base];
		v /= base;
	} while (v);
	int len = n + neg;
	if (!left && !zero)
		for (; width > len; width--)
			put(b, ' ');
	if (neg)
		put(b, '-');
	if (!left && zero)
		for (; width > len; width--)
			put(b, '0');
	while (n)
		put(b, tmp[--n]);
	if (left)
		for (; width > len; width--)
			put(b, ' ');
}

int vsnprintf(char *buf, size_t size, const char *fmt, va_list ap)
{
	struct kp_buf b = { buf, size, 0 };
	for (; *fmt; fmt++) {
		if (*fmt != '%') {
			put(&b, *fmt);
			continue;
		}
		fmt++;
		int zero = 0, left = 0, width = 0, lng = 0;
		for (;; fmt++) {
			if (*fmt == '0')
				zero = 1;
			else if (*fmt == '-')
				left = 1;
			else if (*fmt == '+' || *fmt == ' ' || *fmt == '#')
				;
			else
				break;
		}
		if (*fmt == '*') {
			width = va_arg(ap, int);
			fmt++;
		}
		while (*fmt >= '0' && *fmt <= '9')
			width = width * 10 + (*fmt++ - '0');
		for (;; fmt++) {
			if (*fmt == 'l')
				lng++;
			else if (*fmt == 'z' || *fmt == 't' || *fmt == 'j')
				lng = 2;
			else if (*fmt == 'h')
				;
			else
				break;
		}
		switch (*fmt) {
		case 'd':
		case 'i': {
			long long v = lng ? va_arg(ap, long long) : va_arg(ap, int);
			unsigned long long u = v < 0 ? -(unsigned long long)v : (unsigned long long)v;
			put_num(&b, u, v < 0, 10, 0, width, zero, left);
			break;
		}
		case 'u':
		case 'x':
		case 'X': {
			unsigned long long v = lng ? va_arg(ap, unsigned long long) : va_arg(ap, unsigned int);
			put_num(&b, v, 0, *fmt == 'u' ? 10 : 16, *fmt == 'X', width, zero, left);
			break;
		}
		case 'p': {
			/* The kernel prints hashed pointers without 0x; we print them raw, 16 digits. */
			unsigned long v = (unsigned long)va_arg(ap, void *);
			while (fmt[1] >= 'A' && fmt[1] <= 'z' && (fmt[1] == 'S' || fmt[1] == 's' || fmt[1] == 'F' || fmt[1] == 'f' || fmt[1] == 'K' || fmt[1] == 'x'))
				fmt++;	/* %pS, %px ...: plain address */
			put_num(&b, v, 0, 16, 0, width ? width : 16, 1, left);
			break;
		}
		case 's': {
			const char *s = va_arg(ap, const char *);
			if (!s)
				s = "(null)";
			int len = (int)strlen(s);
			if (!left)
				for (int w = width; w > len; w--)
					put(&b, ' ');
			while (*s)
				put(&b, *s++);
			if (left)
				for (int w = width; w > len; w--)
					put(&b, ' ');
			break;
		}
		case 'c':
			put(&b, (char)va_arg(ap, int));
			break;
		case '%':
			put(&b, '%');
			break;
		case 0:
			fmt--;
			break;
		default:
			put(&b, '%');
			put(&b, *fmt);
		}
	}
	if (size)
		*b.p = 0;
	return b.len;
}

int snprintf(char *buf, size_t size, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(buf, size, fmt, ap);
	va_end(ap);
	return n;
}

int vprintk(const char *fmt, va_list ap)
{
	char line[1024];
	int n = vsnprintf(line, sizeof(line), fmt, ap);
	if (n > (int)sizeof(line) - 1)
		n = sizeof(line) - 1;
	kp_platform_write(2, line, n);
	return n;
}

int printk(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int n = vprintk(fmt, ap);
	va_end(ap);
	return n;
}
