/*
 * The freestanding libc pieces (kp_lib.c): the few functions gcc may call even
 * in freestanding code, and the runtime's own string helpers.
 */
#ifndef _KP_LIB_H
#define _KP_LIB_H
#include <stddef.h>
#pragma GCC visibility push(hidden)

void *memcpy(void *d, const void *s, size_t n);
void *memset(void *d, int c, size_t n);
void *memmove(void *d, const void *s, size_t n);
int memcmp(const void *a, const void *b, size_t n);
size_t strlen(const char *s);
int strcmp(const char *a, const char *b);
int strncmp(const char *a, const char *b, size_t n);
const char *kp_getenv(char **envp, const char *name);

#pragma GCC visibility pop
#endif
