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

/*
 * Stacks through a probe (the kernel's ORC unwinder; docs/kernel.md, "Stacks
 * through probes"): our code has no ORC entry, so the unwinder takes it as
 * generated code with a frame pointer (orc_fp_entry: CFA = %rbp + 16, the return
 * address at %rbp + 8, the caller's %rbp at %rbp).  The runtime and handlers keep
 * %rbp chains (-fno-omit-frame-pointer); an entry points %rbp at a frame record
 * below the stack pointer of the hit S, at S - 16: [S - 16] the probed code's
 * %rbp, [S - 8] the hit + 1 (its site record's address, from _text, + 1;
 * + insn_len after the probed instruction, for a post_handler), as a call at
 * the hit would have pushed.  From it the unwinder goes on by the probed
 * function's own ORC entry at the hit, with %rsp = S.  The site records
 * (kp_site_recs[], 16 bytes each) are rodata from the first instruction of
 * boot: no test for the tables built at boot.  The two words are below the
 * hit's stack pointer (a kernel has no red zone: nothing lives there): in the
 * 128 bytes a long stub steps over, or over a short stub's SITE and return
 * address, which its entries first copy one word lower (optprobe_entry.S:
 * COPY_RET, RET_OVER_SITE; SHORT_LAYOUT).
 * s: S's offset from %rsp; ret: the offset of the return address the entry
 * returns by (the record must be above it); post: 1 after the probed
 * instruction (kp_unwind.c checks the record's layout).  SITE is in %edi
 * already (read before the record may cover it; the callback's first
 * argument); %rax and %rdx are free (saved) where it runs.
 */
#define KP_UNWIND_FRAME_RECORD 1
#define KP_SITE_REC_LEN 12		/* offsetof(struct kp_site_rec, insn_len) */
.macro KP_UNWIND_FRAME s, ret, post
.if \s - 16 < \ret + 8
	.error "KP_UNWIND_FRAME: the frame record would overwrite the entry's return address"
.endif
	mov	%rbp, \s-16(%rsp)
	lea	\s-16(%rsp), %rbp
	lea	(,%rdi,8), %rdx
	mov	kp_site_recs(%rdx,%rdx), %eax
.if \post
	movzbl	kp_site_recs+KP_SITE_REC_LEN(%rdx,%rdx), %edx
	add	%rdx, %rax
.endif
	lea	_text+1(%rax), %rax
	mov	%rax, 8(%rbp)
.endm
/* After the C call: the probed code's %rbp back (the full entries reload it
 * from pt_regs anyway; the clean ones pop it on the way out: RET_OVER_SITE). */
.macro KP_UNWIND_FRAME_END
	mov	(%rbp), %rbp
.endm
/*
 * The same at a kretprobe's return hook (kretprobe_entry.S), whose frame is the
 * function's at its exit: the record at S' - 16, S' the return-address slot (s its
 * offset from %rsp), its return address written by kp_kretprobe_task.c when an
 * instance fires (0 until then: the unwind stops there).  Called (slot 8), the hook's
 * own return into the detour is at S' - 8: kept at S' - 24 meanwhile, in the
 * KP_KRET_GAP bytes the hooks leave above their frame.  The trampoline's record is
 * below its slot, which holds the real return address while the handlers run.
 */
#define KP_KRET_GAP 16
.macro KP_UNWIND_EXIT_FRAME s, slot
.if \slot
	mov	\s-8(%rsp), %rax
	mov	%rax, \s-24(%rsp)
.endif
	movq	$0, \s-8(%rsp)
	mov	%rbp, \s-16(%rsp)
	lea	\s-16(%rsp), %rbp
.endm
/* After the call (reg: a scratch register the hook restores next). */
.macro KP_UNWIND_EXIT_FRAME_END s, slot, reg
	mov	(%rbp), %rbp
.if \slot
	mov	\s-24(%rsp), \reg
	mov	\reg, \s-8(%rsp)
.endif
.endm
#endif
