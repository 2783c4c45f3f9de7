/* kprewrite shim: linux/preempt.h.  In a user process a handler runs in a thread
 * the OS may preempt at any time: the count is 0.  A kernel image's own version
 * (the kernel target's handler headers) reads the CPU's __preempt_count. */
#ifndef _KPREWRITE_LINUX_PREEMPT_H
#define _KPREWRITE_LINUX_PREEMPT_H
static inline int preempt_count(void)
{
	return 0;
}
#define preemptible() 1
#endif
