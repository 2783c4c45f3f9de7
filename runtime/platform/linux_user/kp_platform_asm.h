/* The platform's constants for the arch's assembly (kp_regs.h): a user process. */
#ifndef _KP_PLATFORM_ASM_H
#define _KP_PLATFORM_ASM_H
#define KP_PT_CS 0x33		/* __USER_CS */
#define KP_PT_SS 0x2b		/* __USER_DS */
#define KP_RET ret
/* KP_STACK_ALIGN8 unset: the SysV ABI wants %rsp 16-byte aligned at a call. */
#endif
