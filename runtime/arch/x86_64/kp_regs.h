/*
 * Register save/restore sequences shared by the asm entries
 * (optprobe_entry.S, kretprobe_entry.S).
 *
 * struct pt_regs offsets (PT_*, PT_SIZE) come from kp_asm_offsets.h, which
 * rewriter/link/runtime.py generates from kp_asm_offsets.c.  Flags: pushfq/popfq cost
 * 7 ns on the machines we measure, so the arithmetic flags are saved with
 * seto/lahf and restored with add/sahf.
 *
 * The clean frame: rax rcx rdx rsi rdi r8 r9 r10 r11 at 0..64, the flags word
 * at 72 (al = OF, ah = lahf; flags 0: not kept, the arithmetic flags are dead
 * at the site).
 */
#include <kp_asm_offsets.h>
#include <kp_platform_asm.h>	/* arch/x86_64/<platform>/: KP_PT_CS, KP_PT_SS, KP_PT_REAL_FLAGS, KP_RET */
#ifndef KP_CFI
#define KP_CFI(...)		/* a platform with no unwind tables for its entries */
#endif
#ifndef KP_UNWIND_FRAME_RECORD
/* A platform whose unwinder reads the entries' CFI (KP_CFI) needs no frame
 * record (the kernel's does: linux_kernel/kp_platform_asm.h). */
.macro KP_UNWIND_FRAME s, ret, field
.endm
.macro KP_UNWIND_FRAME_END
.endm
#endif
#ifndef KP_KRET_GAP
#define KP_KRET_GAP 0
.macro KP_UNWIND_EXIT_FRAME s, slot
.endm
.macro KP_UNWIND_EXIT_FRAME_END s, slot, reg
.endm
#endif

/* pt_regs at %rsp: every register, the flags (user code: the arithmetic
 * flags with IF set, as it always runs with it; a kernel: pushfq), orig_ax,
 * cs, ss (the platform's segments); ip and sp are the caller's to fill. */
.macro PT_REGS_SAVE
	mov	%rax, PT_AX(%rsp)
	mov	%rcx, PT_CX(%rsp)
#ifdef KP_PT_REAL_FLAGS
	pushfq					/* IF may be clear in a kernel */
	pop	%rcx
#else
	seto	%al
	lahf
	movzbl	%ah, %ecx
	movzbl	%al, %eax
	shl	$11, %eax
	or	%eax, %ecx
	or	$0x200, %ecx
#endif
	mov	%rcx, PT_FLAGS(%rsp)
	mov	%rdx, PT_DX(%rsp)
	mov	%rsi, PT_SI(%rsp)
	mov	%rdi, PT_DI(%rsp)
	mov	%r8, PT_R8(%rsp)
	mov	%r9, PT_R9(%rsp)
	mov	%r10, PT_R10(%rsp)
	mov	%r11, PT_R11(%rsp)
	mov	%rbx, PT_BX(%rsp)
	mov	%rbp, PT_BP(%rsp)
	mov	%r12, PT_R12(%rsp)
	mov	%r13, PT_R13(%rsp)
	mov	%r14, PT_R14(%rsp)
	mov	%r15, PT_R15(%rsp)
	movq	$-1, PT_ORIG_AX(%rsp)
	movq	$KP_PT_CS, PT_CS(%rsp)
	movq	$KP_PT_SS, PT_SS(%rsp)
.endm

/* Every register and the arithmetic flags back from pt_regs at %rsp. */
.macro PT_REGS_RESTORE
	movzbl	PT_FLAGS(%rsp), %eax
	shl	$8, %eax
	movzbl	PT_FLAGS+1(%rsp), %ecx
	shr	$3, %ecx
	and	$1, %ecx
	or	%ecx, %eax
	add	$0x7f, %al			/* OF = (al == 1) */
	sahf					/* SF ZF AF PF CF */
	PT_REGS_LOAD
.endm

/* Every register (not the flags) from pt_regs at %rsp. */
.macro PT_REGS_LOAD
	mov	PT_R15(%rsp), %r15
	mov	PT_R14(%rsp), %r14
	mov	PT_R13(%rsp), %r13
	mov	PT_R12(%rsp), %r12
	mov	PT_BP(%rsp), %rbp
	mov	PT_BX(%rsp), %rbx
	mov	PT_R11(%rsp), %r11
	mov	PT_R10(%rsp), %r10
	mov	PT_R9(%rsp), %r9
	mov	PT_R8(%rsp), %r8
	mov	PT_AX(%rsp), %rax
	mov	PT_CX(%rsp), %rcx
	mov	PT_DX(%rsp), %rdx
	mov	PT_SI(%rsp), %rsi
	mov	PT_DI(%rsp), %rdi
.endm

/* The clean frame at %rsp: the call-clobbered registers and the flags. */
.macro CLEAN_SAVE flags=1
	mov	%rax, 0(%rsp)
.if \flags
	seto	%al
	lahf
	mov	%ax, 72(%rsp)
.endif
	mov	%rcx, 8(%rsp)
	mov	%rdx, 16(%rsp)
	mov	%rsi, 24(%rsp)
	mov	%rdi, 32(%rsp)
	mov	%r8, 40(%rsp)
	mov	%r9, 48(%rsp)
	mov	%r10, 56(%rsp)
	mov	%r11, 64(%rsp)
.endm

.macro CLEAN_RESTORE flags=1
.if \flags
	movzwl	72(%rsp), %eax
	add	$0x7f, %al			/* OF = (al == 1) */
	sahf					/* SF ZF AF PF CF */
.endif
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
