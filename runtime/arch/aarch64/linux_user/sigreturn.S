/* The signal restorer (SA_RESTORER) for the runtime's own signal handlers:
 * rt_sigreturn, as the vDSO's __kernel_rt_sigreturn (the kernel returns to
 * sa_restorer when SA_RESTORER is set, arch/arm64/kernel/signal.c setup_return()). */
#include <kp_uapi.h>
	.text
	.globl kp_arch_sigreturn
	.hidden kp_arch_sigreturn
	.type kp_arch_sigreturn, %function
	.p2align 2
kp_arch_sigreturn:
	mov	x8, #__NR_rt_sigreturn
	svc	#0
	brk	#0x3e8			/* never reached */
	.size kp_arch_sigreturn, . - kp_arch_sigreturn
	.section .note.GNU-stack, "", %progbits
