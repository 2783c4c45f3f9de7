/* kprewrite shim: the kernel header a kprobes sample includes.  In a user
 * process every thread has an address space, so current->mm is never NULL. */
#include <kprewrite/kprobes.h>
#ifndef _KPREWRITE_SCHED_H
#define _KPREWRITE_SCHED_H
struct mm_struct;
struct task_struct { struct mm_struct *mm; };
static struct task_struct kp_current_task __attribute__((unused)) = { (struct mm_struct *)1 };
#define current (&kp_current_task)
#endif
