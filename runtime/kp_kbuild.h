/*
 * The kernel's include/linux/kbuild.h, for the kp_asm_offsets.c files: each
 * DEFINE leaves a "->NAME value" line in the compiler's assembly output,
 * which rewriter/link/runtime.py reads (they are compiled with -S, never linked).
 */
#ifndef _KP_KBUILD_H
#define _KP_KBUILD_H

#define DEFINE(sym, val) \
	__asm__ volatile("\n.ascii \"->" #sym " %0\"" : : "i" (val))

#define OFFSET(sym, str, mem) \
	DEFINE(sym, __builtin_offsetof(struct str, mem))

#endif
