#include <stdio.h>
#include <stdlib.h>

__attribute__((noinline)) long work(long x) { return x * x + 1; }

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 5, s = 0;
    for (long i = 0; i < n; i++)
        s += work(i);
    printf("sum = %ld\n", s);
    return 0;
}
