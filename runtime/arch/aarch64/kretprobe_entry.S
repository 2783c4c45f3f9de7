/*
 * kretprobes on AArch64: not implemented yet (rewriter/arch/aarch64/retprobe.py
 * refuses them with an error).  The core names the trampoline
 * (kp_kretprobe.c); nothing returns to it, so it stops loudly if anything does.
 */
	.text
	.globl kp_kretprobe_trampoline
	.hidden kp_kretprobe_trampoline
	.type kp_kretprobe_trampoline, @function
kp_kretprobe_trampoline:
	udf	#0
	.size kp_kretprobe_trampoline, .-kp_kretprobe_trampoline

	.section .note.GNU-stack,"",@progbits
