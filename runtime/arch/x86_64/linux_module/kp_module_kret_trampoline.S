/*
 * The kretprobe trampoline of a module: the probed function returns here, kp_kret_return() gives the real
 * return address.
 * Read as text by rewriter/targets/linux_module/x86_64/writer.py (module_source()), from the line after
 * this comment; not compiled alone.
 */

	.section .text.kprewrite,"ax",@progbits
	.globl kp_kret_trampoline
	.type kp_kret_trampoline,@function
kp_kret_trampoline:			/* the probed function returned here: %rsp = its slot + 8 */
	pushq $0			/* the slot again: the real return address goes here */
	sub $0x28, %rsp
	pushq $-1
	push %rdi; push %rsi; push %rdx; push %rcx; push %rax
	push %r8; push %r9; push %r10; push %r11
	push %rbx; push %rbp; push %r12; push %r13; push %r14; push %r15
	leaq kp_kret_trampoline(%rip), %rax
	mov %rax, 0x80(%rsp)
	movq $0x10, 0x88(%rsp)
	pushfq
	pop %rax
	mov %rax, 0x90(%rsp)
	lea 0xb0(%rsp), %rax		/* sp after the return */
	mov %rax, 0x98(%rsp)
	movq $0x18, 0xa0(%rsp)
	mov %rsp, %rdi
	call kp_kret_return
	mov %rax, 0xa8(%rsp)
	pop %r15; pop %r14; pop %r13; pop %r12; pop %rbp; pop %rbx
	pop %r11; pop %r10; pop %r9; pop %r8
	pop %rax; pop %rcx; pop %rdx; pop %rsi; pop %rdi
	add $0x30, %rsp
	jmp __x86_return_thunk
	.size kp_kret_trampoline, .-kp_kret_trampoline
