/* The platform's constants for the arch's assembly (kp_regs.h): a user process. */
#ifndef _KP_PLATFORM_ASM_H
#define _KP_PLATFORM_ASM_H
#include <kp_uapi.h>
#define KP_PT_CS KP_USER_CS
#define KP_PT_SS KP_USER_DS
#define KP_RET ret
/* kp_kretprobe_clean_entry (optprobe_entry.S), for kp_kretprobe.c's callback: a site with a
 * kretprobe whose handlers never read regs, saved as a clean call (Rules.kretprobe_clean_entry). */
#define KP_KRET_CLEAN_ENTRY 1
/* Call frame information for the entries (.eh_frame: a backtrace in a handler goes
 * on into the detour and the probed function; rewriter/targets/linux_user/unwind.py). */
#define KP_CFI(...) __VA_ARGS__
/* KP_STACK_ALIGN8 unset: the SysV ABI wants %rsp 16-byte aligned at a call. */
#endif
