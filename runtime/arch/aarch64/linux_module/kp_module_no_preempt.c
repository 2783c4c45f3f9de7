/*
 * arm64: handlers run as the detour enters them, with interrupts masked (the detour masks them around
 * the dispatch, as the kernel's arm64 kprobes run their handlers from a debug exception), so not
 * preempted; no hit is counted missed (a handler that calls a probed function of the module enters
 * it again).  Included by kp_module_runtime.c.
 */

static inline int kp_enter(void) { return 1; }
static inline void kp_leave(void) { }
