/* The signal restorer (SA_RESTORER) for the runtime's own signal handlers:
 * rt_sigreturn, as the C library's __restore_rt. */
#include <kp_uapi.h>
	.text
	.globl kp_arch_sigreturn
	.hidden kp_arch_sigreturn
	.type kp_arch_sigreturn, @function
kp_arch_sigreturn:
	/* mov $15, %rax; syscall: the bytes libgcc's unwinder recognises as a signal
	 * return (MD_FALLBACK_FRAME_STATE_FOR), so a backtrace in a breakpoint probe's
	 * handler goes on into the interrupted code. */
	mov $__NR_rt_sigreturn, %rax
	syscall
	hlt
	.size kp_arch_sigreturn, . - kp_arch_sigreturn
	.section .note.GNU-stack, "", @progbits
