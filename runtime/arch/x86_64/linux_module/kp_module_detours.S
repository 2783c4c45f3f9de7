/*
 * Templates of the module's detours and slots, x86-64 (writer.py: DETOURS, read by parts): each part
 * follows its line `@NAME` (in a comment); {i} is the site's number, {site} and {back} placeholder references
 * (optprobe.py), filled in per site, and each is annotated with ORC entries line by line (orc.py).
 * Read as text by rewriter/targets/linux_module/x86_64/writer.py (module_parts()); not assembled alone.
 *
 * ftrace: a probe at a function's ftrace site, entered by the `call __fentry__` made to call it
 * (the return address the probed address + 5), as kprobe_ftrace_handler() builds its pt_regs.
 *
 * opt_head, opt_tail: an optimized (jump) probe's detour, entered by the `jmp` at the probed
 * address (no return address on the stack; the probed code's flags live): arch/x86/kernel/
 * kprobes/opt.c's optprobe_template: pt_regs built with ip the probed address + 1 (as
 * optimized_callback() sets it) and the flags saved first, the dispatch called, every register
 * restored (a handler's changes to them kept, as the kernel's; a pre_handler's return value
 * ignored, as opt_pre_handler() does), then (between the two parts) the region's copy, and the
 * jump back to the region's end.
 *
 * slot_head, slot_ss_end, slot_tail: a breakpoint site's out-of-line slot (int3_slot()): the
 * copy (between head and the rest), the closing int3 where the kernel would single-step, the
 * jump back.
 *
 * int3_table, int3_at, int3_ss, int3_target: kp_int3_at[] (int3_table()), the module's table of
 * its breakpoints for kp_module_int3.c's notifier, as the kernel's kprobe_table is its data:
 * each site's address as a 32-bit distance from its entry ({site}: a placeholder the writer
 * points at the site's section, applied by the module loader), then each single-stepped slot's
 * closing int3 (kp_ss_{i}); and an emulated branch's target (kp_int3_target_{i}), the same way.
 */
/* @ftrace */
	.section .text.kprewrite,"ax",@progbits
	.globl kp_detour_{i}
	.type kp_detour_{i},@function
kp_detour_{i}:
	sub $0x28, %rsp			/* ip, cs, flags, sp, ss */
	pushq $-1			/* orig_ax */
	push %rdi; push %rsi; push %rdx; push %rcx; push %rax
	push %r8; push %r9; push %r10; push %r11
	push %rbx; push %rbp; push %r12; push %r13; push %r14; push %r15
	mov 0xa8(%rsp), %rax		/* the return address: the probed address + 5 */
	sub $4, %rax			/* ip: after the (virtual) int3, as the kernel's ftrace kprobes */
	mov %rax, 0x80(%rsp)
	movq $0x10, 0x88(%rsp)		/* __KERNEL_CS */
	pushfq
	pop %rax
	mov %rax, 0x90(%rsp)
	lea 0xb0(%rsp), %rax		/* sp at the probed address */
	mov %rax, 0x98(%rsp)
	movq $0x18, 0xa0(%rsp)		/* __KERNEL_DS */
	mov %rsp, %rdi
	call kp_dispatch_{i}
	test %rax, %rax			/* a pre_handler that returned 1 chose where to resume */
	jz 1f
	mov %rax, 0xa8(%rsp)
1:	pop %r15; pop %r14; pop %r13; pop %r12; pop %rbp; pop %rbx
	pop %r11; pop %r10; pop %r9; pop %r8
	pop %rax; pop %rcx; pop %rdx; pop %rsi; pop %rdi
	add $0x30, %rsp
	jmp __x86_return_thunk
	.size kp_detour_{i}, .-kp_detour_{i}
/* @opt_head */
	.section .text.kprewrite,"ax",@progbits
	.globl kp_detour_{i}
	.type kp_detour_{i},@function
kp_detour_{i}:
	lea -0x10(%rsp), %rsp		/* ss, sp: no flags changed before they are saved */
	pushfq
	lea -0x10(%rsp), %rsp		/* cs, ip */
	pushq $-1			/* orig_ax */
	push %rdi; push %rsi; push %rdx; push %rcx; push %rax
	push %r8; push %r9; push %r10; push %r11
	push %rbx; push %rbp; push %r12; push %r13; push %r14; push %r15
	.byte 0x48, 0x8d, 0x05		/* lea <the probed address + 1>(%rip), %rax */
	.long {site} - .
	mov %rax, 0x80(%rsp)
	movq $0x10, 0x88(%rsp)		/* __KERNEL_CS */
	lea 0xa8(%rsp), %rax		/* sp at the probed address */
	mov %rax, 0x98(%rsp)
	movq $0x18, 0xa0(%rsp)		/* __KERNEL_DS */
	mov %rsp, %rdi
	call kp_dispatch_{i}
	pop %r15; pop %r14; pop %r13; pop %r12; pop %rbp; pop %rbx
	pop %r11; pop %r10; pop %r9; pop %r8
	pop %rax; pop %rcx; pop %rdx; pop %rsi; pop %rdi
	lea 0x18(%rsp), %rsp		/* orig_ax, ip, cs */
	popfq
	lea 0x10(%rsp), %rsp		/* sp, ss */
/* @opt_tail */
	.byte 0xe9			/* jmp <the region's end> */
	.long {back} - .
	.size kp_detour_{i}, .-kp_detour_{i}
/* @slot_head */
	.section .text.kprewrite,"ax",@progbits
	.globl kp_slot_{i}
	.hidden kp_slot_{i}
	.type kp_slot_{i},@function
kp_slot_{i}:
/* @slot_ss_end */
	.globl kp_ss_{i}
	.hidden kp_ss_{i}
kp_ss_{i}:
	int3				/* the single-step's end: kp_int3_notify() resumes after the original */
/* @slot_tail */
	.byte 0xe9			/* jmp <the next instruction> */
	.long {back} - .
	.size kp_slot_{i}, .-kp_slot_{i}
/* @int3_table */
	.section .rodata.kprewrite,"a",@progbits
	.balign 4
	.globl kp_int3_at
	.hidden kp_int3_at
kp_int3_at:
/* @int3_at */
	.long {site} - .
/* @int3_ss */
	.long kp_ss_{i} - .
/* @int3_target */
	.globl kp_int3_target_{i}
	.hidden kp_int3_target_{i}
kp_int3_target_{i}:
	.long {target} - .
