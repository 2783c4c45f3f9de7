/* The platform's constants for the arch's assembly (kp_regs.h): a kernel image. */
#ifndef _KP_PLATFORM_ASM_H
#define _KP_PLATFORM_ASM_H
#define KP_PT_CS 0x10		/* __KERNEL_CS */
#define KP_PT_SS 0x18		/* __KERNEL_DS */
#define KP_PT_REAL_FLAGS 1	/* regs->flags by pushfq: IF is not always set in a kernel */
#define KP_RET jmp __x86_return_thunk	/* the image's return thunk (CONFIG_RETHUNK), as its own code returns */
/* C is compiled as the kernel's own (-mpreferred-stack-boundary=3, no SSE): a
 * call needs the stack 8-byte aligned only, which it always is. */
#define KP_STACK_ALIGN8 1
/* kretprobes' entries may take the clean call (kp_kretprobe_task.c). */
#define KP_KRET_CLEAN_ENTRY 1
/* No red zone (-mno-red-zone): detours take the short stubs (optprobe_entry.S). */
#define KP_SHORT_STUBS 1
#endif
