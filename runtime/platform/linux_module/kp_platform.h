/*
 * The platform half of the runtime for a kernel module (.ko), the part a module's
 * trace events need (kp_fetch.c, kp_trace.c, and with the kernel's BTF the image's
 * kp_trace_buffer.c for its event calls): the module is linked with `ld -r`
 * (rewriter/targets/linux_module/x86_64/writer.py) and relocated by the module
 * loader, so the kernel is reached through its exported symbols only (each with
 * the CRC the kernel's Module.symvers gives it, added to the module's __versions).
 * The probes, detours and dispatch are the module's own (kp_module_runtime.c, on
 * the probes' facts writer.py generates), not kp_core.c's: nothing of the thread
 * tables below is used.
 */
#ifndef _KP_PLATFORM_H
#define _KP_PLATFORM_H
#pragma GCC visibility push(hidden)

#include <kp_arch_module.h>	/* the CPU's half: runtime/arch/<arch>/linux_module/ */

#define KP_PLATFORM_NO_STARTUP 1

/* --- the kernel's own functions, exported to modules --- */

int _printk(const char *fmt, ...);
long copy_from_kernel_nofault(void *dst, const void *src, unsigned long size);
long copy_from_user_nofault(void *dst, const void *src, unsigned long size);
int sprint_symbol(char *buffer, unsigned long address);
int sprint_symbol_no_offset(char *buffer, unsigned long address);
int __trace_puts(unsigned long ip, const char *str, int size);
char *__get_task_comm(char *to, unsigned long len, void *tsk);

#define KP_KERN_INFO "\001" "6"
#define KP_KERN_ERR "\001" "3"

/* --- thread identity: unused (the module's dispatch is generated) --- */

static inline unsigned long kp_platform_thread_key_fast(void) { return 0; }
static inline unsigned long kp_platform_thread_key(void) { return 0; }
static inline int kp_platform_thread_key_ready(void) { return 1; }

/* --- output, for lines written whole: never (the ring buffer exists once modules load) --- */

void kp_platform_write(int fd, const char *buf, unsigned long len);
int kp_platform_open_append(const char *path);

/* --- the current task --- */

#define KP_TASK_COMM_LEN 16

static inline void kp_platform_task_comm(char *comm)
{
	__get_task_comm(comm, KP_TASK_COMM_LEN, kp_arch_module_current());
}

/* The pid is the ring buffer's (trace_print_context()): not read here. */
static inline int kp_platform_task_pid(void)
{
	return 0;
}

static inline unsigned int kp_platform_cpu(void)
{
	return 0;
}

/* this_cpu_ptr()'s offset, for the kernel's per-CPU data (perf's lists). */
static inline unsigned long kp_platform_this_cpu_off(void)
{
	return kp_arch_module_this_cpu_off();
}

struct kp_timespec { long sec, nsec; };
static inline void kp_platform_trace_clock(struct kp_timespec *ts)
{
	ts->sec = ts->nsec = 0;
}

static inline int kp_platform_copy_nofault(void *dst, unsigned long addr, unsigned long len, int tid)
{
	(void)tid;
	return len ? (int)copy_from_kernel_nofault(dst, (const void *)addr, len) : 0;
}

static inline int kp_platform_copy_user_nofault(void *dst, unsigned long addr, unsigned long len, int tid)
{
	(void)tid;
	return len ? (int)copy_from_user_nofault(dst, (const void *)addr, len) : 0;
}

/* As in a kernel image: symbols from the running kernel's kallsyms (modules included). */
#define KP_PLATFORM_KALLSYMS 1
#define KP_PLATFORM_TRACE_LINE 1024
#define KP_PLATFORM_TRACE_REC 1536
#define KP_PLATFORM_SYM_LEN 768		/* >= KSYM_SYMBOL_LEN */
int kp_platform_symbol(char *buf, unsigned long addr, int with_offset);

/* A line's body into the ftrace ring buffer as trace_printk() writes it (__trace_puts():
 * a TRACE_PRINT entry behind the probed address): always 1. */
int kp_platform_trace_buffer(unsigned long ip, const char *body, unsigned long len);

#ifdef KP_MODULE_EVENTS
/* With the kernel's BTF (rewriter/targets/linux_module/kernel_btf.py): each event is the
 * kernel's own event call, registered from the module's _ftrace_events by the module
 * loader (kp_module_event_calls.c, on the kernel image's kp_trace_buffer.c): a hit's
 * record goes into each instance that has the event enabled, 1 when it was taken or
 * dropped as the kernel drops its own, 0 when the event has no call (then the line is
 * written as above); nothing is fetched while every instance has it disabled. */
#define KP_PLATFORM_TRACE_RECORD 1
struct kp_trace_event;
struct pt_regs;
int kp_platform_trace_record(const struct kp_trace_event *ev, struct pt_regs *regs, unsigned long ip,
			     unsigned long ret_addr, const unsigned char *rec, unsigned long len);
#define KP_PLATFORM_TRACE_WANTED 1
int kp_platform_trace_wanted(const struct kp_trace_event *ev);
#endif

#pragma GCC visibility pop

void kp_profile_signal_configure(const char *value);
#endif
