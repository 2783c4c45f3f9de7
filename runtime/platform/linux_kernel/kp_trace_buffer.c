/*
 * Trace events in a kernel: lines into the kernel's own ftrace ring buffer,
 * symbols from the running kernel's kallsyms.
 *
 * A kprobe_events event the kernel defines writes a struct kprobe_trace_entry
 * of its own type, printed by print_kprobe_event().  Ours have no registered
 * type, so each hit writes its text as trace_printk() does, through
 * __trace_puts() (a TRACE_PRINT entry: the ip and the string), with the ip the
 * probe's address.  `cat /sys/kernel/tracing/trace` then shows it in the
 * kernel's context format, between the kernel's own events, as
 *
 *     init-1  [001] ...1.  5.123456: do_sys_openat2: kp_open: (do_sys_openat2+0x0/0x1a0) file="/etc/passwd"
 *
 * (trace_print_print(): "%ps: %s"), and trace_pipe, the snapshot and
 * instances' tracing_on apply to it as to trace_printk().  Before
 * early_trace_init() has allocated the buffer (from setup_per_cpu_areas(), when
 * the tables are built, until a little later in start_kernel()), the line goes
 * to printk whole, with the context kp_trace.c prints for user space.
 */
#include "kp_internal.h"

int __trace_puts(unsigned long ip, const char *str, int size);
void tracing_record_cmdline(void *task);
int sprint_symbol(char *buffer, unsigned long address);
int sprint_symbol_no_offset(char *buffer, unsigned long address);
/* kernel/trace/trace.c: 1 until tracer_alloc_buffers() (early_trace_init()) has
 * made global_trace's ring buffer, or for good when that failed. */
extern int tracing_disabled;

/* The task (pointer, pid, name) each CPU saved last, and the lines since: saving costs
 * some 170 instructions a hit (a third of the line's cost), so the same task with the
 * same name hitting again on the same CPU is saved again only every KP_COMM_RESAVE
 * lines (other tasks' names may have pushed it out of saved_cmdlines meanwhile). */
#define KP_COMM_CPUS 64
#define KP_COMM_RESAVE 256
static struct {
	void *task;
	unsigned long comm[2];		/* TASK_COMM_LEN bytes */
	int pid;
	unsigned int lines;
} __attribute__((aligned(64))) kp_comm_saved[KP_COMM_CPUS];

int kp_platform_trace_buffer(unsigned long ip, const char *body, unsigned long len)
{
	if (__atomic_load_n(&tracing_disabled, __ATOMIC_RELAXED))
		return 0;
	/* 0 written also means dropped as the kernel drops trace_printk(): tracing_on
	 * off, the trace_printk option off, a full buffer in overwrite-off mode. */
	if (!__trace_puts(ip, body, (int)len))
		return 1;
	/* The task's name for the trace file's COMM-PID column (else "<...>"), saved as
	 * the kernel's sched_switch probe saves it after an event when cmdline recording
	 * is on (it is only while some event is enabled).  The dispatch runs with
	 * preemption off, so this CPU's slot is ours. */
	char *task = kp_kernel_current();
	unsigned int cpu = kp_platform_cpu();
	if (cpu < KP_COMM_CPUS && kp_kernel_task_comm >= 0) {
		int pid = kp_platform_task_pid();
		unsigned long c0, c1;
		__builtin_memcpy(&c0, task + kp_kernel_task_comm, 8);
		__builtin_memcpy(&c1, task + kp_kernel_task_comm + 8, 8);
		typeof(kp_comm_saved[0]) *saved = &kp_comm_saved[cpu];
		if (saved->task == task && saved->pid == pid && saved->comm[0] == c0 && saved->comm[1] == c1
		    && ++saved->lines < KP_COMM_RESAVE)
			return 1;
		saved->task = task;
		saved->pid = pid;
		saved->comm[0] = c0;
		saved->comm[1] = c1;
		saved->lines = 0;
	}
	tracing_record_cmdline(task);
	return 1;
}

/* %pS / %ps: "sym+0xoff/0xsize" (or "0xADDR"), modules included. */
int kp_platform_symbol(char *buf, unsigned long addr, int with_offset)
{
	return with_offset ? sprint_symbol(buf, addr) : sprint_symbol_no_offset(buf, addr);
}
