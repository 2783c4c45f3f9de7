/* The signal restorer (SA_RESTORER) for the runtime's own signal handlers:
 * rt_sigreturn, as the C library's __restore_rt. */
#include <kp_uapi.h>
	.text
	.globl kp_arch_sigreturn
	.hidden kp_arch_sigreturn
	.type kp_arch_sigreturn, @function
kp_arch_sigreturn:
	mov $__NR_rt_sigreturn, %eax
	syscall
	hlt
	.size kp_arch_sigreturn, . - kp_arch_sigreturn
	.section .note.GNU-stack, "", @progbits
