/*
 * Platform layer, Linux user process: CPU count (for kretprobe's default
 * maxactive, the kernel's num_possible_cpus()) and the monotonic clock behind
 * ktime_get().  Raw system calls only.
 */
#include "kp_internal.h"

#define CLOCK_MONOTONIC 1

unsigned long kp_platform_ncpus(void)
{
	unsigned long mask[16];		/* 1024 CPUs */
	long n = kp_syscall3(__NR_sched_getaffinity, 0, sizeof(mask), mask);
	if (n <= 0)
		return 1;
	unsigned long cpus = 0;
	for (long i = 0; i < n / 8; i++)
		for (unsigned long m = mask[i]; m; m &= m - 1)
			cpus++;
	return cpus ? cpus : 1;
}

long long kp_platform_ktime(void)
{
	struct { long sec, nsec; } ts = { 0, 0 };
	kp_syscall3(__NR_clock_gettime, CLOCK_MONOTONIC, &ts, 0);
	return ts.sec * 1000000000LL + ts.nsec;
}

ktime_t ktime_get(void)
{
	return kp_platform_ktime();
}
