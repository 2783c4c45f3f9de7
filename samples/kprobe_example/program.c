/* A small program to probe: kernel_clone() stands in for the kernel's fork path. */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noinline)) long kernel_clone(long flags)
{
	return flags * 2 + 1;
}

int main(int argc, char **argv)
{
	int n = argc > 1 ? atoi(argv[1]) : 3;
	long sum = 0;
	for (int i = 0; i < n; i++)
		sum += kernel_clone(i);
	printf("sum = %ld\n", sum);
	return 0;
}
