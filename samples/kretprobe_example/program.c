/* A small program to return-probe: kernel_clone() stands in for the kernel's
 * fork path; it takes a little while and returns a "pid".  Give a thread count
 * larger than maxactive (20) to see nmissed count the calls that found no free
 * instance. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long next_pid = 1000;

__attribute__((noinline)) long kernel_clone(long flags)
{
	struct timespec ts = { 0, 1000000 * (flags + 1) };	/* (flags + 1) ms */
	nanosleep(&ts, 0);
	return __atomic_add_fetch(&next_pid, 1, __ATOMIC_RELAXED);
}

static void *worker(void *arg)
{
	return (void *)kernel_clone((long)arg);
}

int main(int argc, char **argv)
{
	int n = argc > 1 ? atoi(argv[1]) : 3;
	pthread_t t[64];
	if (n > 64)
		n = 64;
	for (int i = 0; i < n; i++)
		pthread_create(&t[i], 0, worker, (void *)(long)(n > 20 ? 50 : i));
	long sum = 0;
	for (int i = 0; i < n; i++) {
		void *r;
		pthread_join(t[i], &r);
		sum += (long)r;
	}
	printf("%d clones, pids sum = %ld\n", n, sum);
	return 0;
}
