/* The seeds' overhead measurement: a tight loop calling a trivial function. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

__attribute__((noinline)) long target(long x)
{
	__asm__ volatile("" : "+r"(x));
	return x + 1;
}

/* Row "k": a function whose first instruction the kernel cannot boost
 * (movups, 0f 10), so a breakpoint probe single-steps it. */
__asm__(".text\n.globl target_ss\n.type target_ss,@function\ntarget_ss:\n"
	"  movups %xmm0,%xmm1\n  lea 1(%rdi),%rax\n  ret\n.size target_ss,.-target_ss\n");
long target_ss(long x);

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 100000000;
	struct timespec a, b;
	long s = 0;
	clock_gettime(CLOCK_MONOTONIC, &a);
	if (argc > 2)		/* "ss": the single-step row's function */
		for (long i = 0; i < n; i++)
			s += target_ss(i);
	else
		for (long i = 0; i < n; i++)
			s += target(i);
	clock_gettime(CLOCK_MONOTONIC, &b);
	double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
	printf("%.3f %ld\n", ns, s);
	return 0;
}
