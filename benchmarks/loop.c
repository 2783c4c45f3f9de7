/* The seeds' overhead measurement: a tight loop calling a trivial function. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

__attribute__((noinline)) long target(long x)
{
	__asm__ volatile("" : "+r"(x));
	return x + 1;
}

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 100000000;
	struct timespec a, b;
	long s = 0;
	clock_gettime(CLOCK_MONOTONIC, &a);
	for (long i = 0; i < n; i++)
		s += target(i);
	clock_gettime(CLOCK_MONOTONIC, &b);
	double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
	printf("%.3f %ld\n", ns, s);
	return 0;
}
