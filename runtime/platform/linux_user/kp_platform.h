/*
 * Platform layer, the part the probe path inlines: thread identity.
 * A Linux user process: the thread pointer (%fs:0 on x86-64), once the C
 * library has set one up; a kernel image's platform uses its per-CPU base.
 */
#ifndef _KP_PLATFORM_H
#define _KP_PLATFORM_H
#include "../../arch/x86_64/syscall.h"

extern int kp_tls_ready;
unsigned long kp_platform_thread_key_slow(void);

/* 0: no thread identity yet (a static program before __libc_setup_tls). */
static inline unsigned long kp_platform_thread_key(void)
{
	if (__builtin_expect(kp_tls_ready, 1))
		return kp_arch_thread_pointer();
	return kp_platform_thread_key_slow();
}
/* Whether kp_platform_thread_key_fast() may be used. */
static inline int kp_platform_thread_key_ready(void)
{
	return kp_tls_ready;
}

/* Only once kp_rt.fast is set (a thread pointer exists). */
static inline unsigned long kp_platform_thread_key_fast(void)
{
	return kp_arch_thread_pointer();
}
#endif
