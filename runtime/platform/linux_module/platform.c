/*
 * A kernel module's platform functions for its trace events (kp_platform.h): a
 * hit's line goes to the ftrace ring buffer as trace_printk() writes it, when the
 * event has no trace_event_call of its own (without the kernel's BTF, whose layouts
 * it needs; with it, the event calls are the kernel image's kp_trace_buffer.c,
 * built for the module with kp_module_event_calls.c).
 */
#include "kp_internal.h"

/* kp_fetch.c reads kp_rt.bias for @SYM, which a module refuses (writer.py). */
struct kp_runtime kp_rt;

int kp_platform_trace_buffer(unsigned long ip, const char *body, unsigned long len)
{
	/* 0 written means dropped as the kernel drops trace_printk(): tracing_on off,
	 * the trace_printk option off, a full buffer in overwrite-off mode. */
	__trace_puts(ip, body, (int)len);
	return 1;
}

int kp_platform_symbol(char *buf, unsigned long addr, int with_offset)
{
	return with_offset ? sprint_symbol(buf, addr) : sprint_symbol_no_offset(buf, addr);
}

void kp_platform_write(int fd, const char *buf, unsigned long len)
{
	(void)fd;
	_printk(KP_KERN_INFO "%.*s", (int)len, buf);
}

int kp_platform_open_append(const char *path)
{
	(void)path;
	return -1;
}

void kp_profile_signal_configure(const char *value)
{
	(void)value;
}
