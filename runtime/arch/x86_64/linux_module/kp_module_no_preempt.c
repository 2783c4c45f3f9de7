/*
 * Without the kernel's CRCs (no Module.symvers): handlers run as the detour enters them, preemptible, and no
 * hit is missed.
 * Read as text by rewriter/targets/linux_module/x86_64/writer.py (module_source()), from the line after
 * this comment; not compiled alone.
 */

static inline int kp_enter(void) { return 1; }
static inline void kp_leave(void) { }
