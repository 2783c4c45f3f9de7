/*
 * The start of a module's runtime (kp_module_runtime.c includes it first): the handler API, the kernel's
 * exported printk under the handlers' printk().
 */

#include <kprewrite/kprobes.h>
#pragma GCC visibility push(hidden)

/* The kernel's, exported: the module loader resolves them. */
struct va_format { const char *fmt; va_list *va; };
extern int _printk(const char *fmt, ...);
extern int init_module(void);
extern void cleanup_module(void);

static volatile int kp_armed;

/* printk for handlers: the kernel's, the level kept in front (%pV prints the rest). */
int printk(const char *fmt, ...)
{
	struct va_format vaf;
	va_list ap;
	int r;
	char level[3] = "";
	if (fmt[0] == '\001' && fmt[1]) {
		level[0] = fmt[0];
		level[1] = fmt[1];
		fmt += 2;
	}
	va_start(ap, fmt);
	vaf.fmt = fmt;
	vaf.va = &ap;
	r = level[0] ? _printk("%c%c%pV", level[0], level[1], &vaf) : _printk("%pV", &vaf);
	va_end(ap);
	return r;
}
