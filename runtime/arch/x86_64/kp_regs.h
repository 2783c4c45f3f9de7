/*
 * Register save/restore sequences shared by the asm entries
 * (optprobe_entry.S, kretprobe_entry.S).
 *
 * struct pt_regs offsets: r15 0 r14 8 r13 16 r12 24 bp 32 bx 40 r11 48 r10 56
 * r9 64 r8 72 ax 80 cx 88 dx 96 si 104 di 112 orig_ax 120 ip 128 cs 136
 * flags 144 sp 152 ss 160; size 168.  Flags: pushfq/popfq cost 7 ns on the
 * machines we measure, so the arithmetic flags are saved with seto/lahf and
 * restored with add/sahf.
 *
 * The clean frame: rax rcx rdx rsi rdi r8 r9 r10 r11 at 0..64, the flags word
 * at 72 (al = OF, ah = lahf).
 */
#define PT_SIZE 168

/* pt_regs at %rsp: every register, the flags (IF set, as user code always
 * runs with it), orig_ax, cs, ss; ip and sp are the caller's to fill. */
.macro PT_REGS_SAVE
	mov	%rax, 80(%rsp)
	mov	%rcx, 88(%rsp)
	seto	%al
	lahf
	movzbl	%ah, %ecx
	movzbl	%al, %eax
	shl	$11, %eax
	or	%eax, %ecx
	or	$0x200, %ecx
	mov	%rcx, 144(%rsp)
	mov	%rdx, 96(%rsp)
	mov	%rsi, 104(%rsp)
	mov	%rdi, 112(%rsp)
	mov	%r8, 72(%rsp)
	mov	%r9, 64(%rsp)
	mov	%r10, 56(%rsp)
	mov	%r11, 48(%rsp)
	mov	%rbx, 40(%rsp)
	mov	%rbp, 32(%rsp)
	mov	%r12, 24(%rsp)
	mov	%r13, 16(%rsp)
	mov	%r14, 8(%rsp)
	mov	%r15, 0(%rsp)
	movq	$-1, 120(%rsp)			/* orig_ax */
	movq	$0x33, 136(%rsp)		/* __USER_CS */
	movq	$0x2b, 160(%rsp)		/* __USER_DS */
.endm

/* Every register and the arithmetic flags back from pt_regs at %rsp. */
.macro PT_REGS_RESTORE
	movzbl	144(%rsp), %eax
	shl	$8, %eax
	movzbl	145(%rsp), %ecx
	shr	$3, %ecx
	and	$1, %ecx
	or	%ecx, %eax
	add	$0x7f, %al			/* OF = (al == 1) */
	sahf					/* SF ZF AF PF CF */
	PT_REGS_LOAD
.endm

/* Every register (not the flags) from pt_regs at %rsp. */
.macro PT_REGS_LOAD
	mov	0(%rsp), %r15
	mov	8(%rsp), %r14
	mov	16(%rsp), %r13
	mov	24(%rsp), %r12
	mov	32(%rsp), %rbp
	mov	40(%rsp), %rbx
	mov	48(%rsp), %r11
	mov	56(%rsp), %r10
	mov	64(%rsp), %r9
	mov	72(%rsp), %r8
	mov	80(%rsp), %rax
	mov	88(%rsp), %rcx
	mov	96(%rsp), %rdx
	mov	104(%rsp), %rsi
	mov	112(%rsp), %rdi
.endm

/* The clean frame at %rsp: the call-clobbered registers and the flags. */
.macro CLEAN_SAVE
	mov	%rax, 0(%rsp)
	seto	%al
	lahf
	mov	%ax, 72(%rsp)
	mov	%rcx, 8(%rsp)
	mov	%rdx, 16(%rsp)
	mov	%rsi, 24(%rsp)
	mov	%rdi, 32(%rsp)
	mov	%r8, 40(%rsp)
	mov	%r9, 48(%rsp)
	mov	%r10, 56(%rsp)
	mov	%r11, 64(%rsp)
.endm

.macro CLEAN_RESTORE
	movzwl	72(%rsp), %eax
	add	$0x7f, %al			/* OF = (al == 1) */
	sahf					/* SF ZF AF PF CF */
	mov	0(%rsp), %rax
	mov	8(%rsp), %rcx
	mov	16(%rsp), %rdx
	mov	24(%rsp), %rsi
	mov	32(%rsp), %rdi
	mov	40(%rsp), %r8
	mov	48(%rsp), %r9
	mov	56(%rsp), %r10
	mov	64(%rsp), %r11
.endm
