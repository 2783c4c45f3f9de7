/*
 * Templates of the module's detours, arm64 (writer.py: DETOURS, read by parts): each part follows its
 * line `@NAME` (in a comment); {i} is the site's number, {n} its dispatch's, {site}, {back} and {post_pc}
 * placeholder references (writer.py's _redirect() points their relocations at the module's
 * sections), filled in per site.  Read as text by rewriter/targets/linux_module/aarch64/writer.py
 * (module_parts()); not assembled alone.
 *
 * macros: kp_regs_call PC, FN and kp_regs_restore, once at the start of the module's kp_detours.S: a struct
 * pt_regs on the stack (pc the 64-bit word at PC; sp and pstate as at the call's place) with a frame
 * record {fp, pc} above it, FN(regs) called with interrupts masked; then every register back from it.
 *
 * opt_head, opt_post, opt_tail, opt_post_pc, opt_end: a jump-optimized probe's detour, entered by the `B` at the probed address (a
 * R_AARCH64_JUMP26 the loader resolves, through a module PLT entry when out of reach): a struct
 * pt_regs on the stack (pc the probe's address, sp and pstate as at the probe) and a frame record
 * {fp, pc} above it so that a stack taken in a handler goes on through the probed function, the
 * dispatch called with interrupts masked, every register restored (a handler's changes to x0-x30 and
 * NZCV kept; a pre_handler's return value ignored, as an optimized kprobe's), then (between the two
 * parts) the displaced instruction's copy, with post_handlers (opt_post) their call with pc the address
 * after the displaced instruction, and the `B` back after it.  The layout is the kernel image
 * target's (rewriter/targets/linux_kernel/aarch64/build.py's _call()): 320 bytes, pt_regs (288),
 * the frame record (288), the saved DAIF (304).
 *
 * kret_trampoline: where a kretprobed function returns (its x30 swapped at entry for this, before its
 * paciasp signed it: kp_kret_entry_N()), as the kernel's __kretprobe_trampoline: a struct pt_regs
 * (x0 the return value, sp the function's at entry), kp_kret_return() called (the instances'
 * handlers; it gives the real return address, also regs->pc), every register restored, then `ret`
 * there.
 */
/* @macros */
	.macro kp_regs_call pc, fn
	sub sp, sp, #320
	stp x0, x1, [sp, #0]
	stp x2, x3, [sp, #16]
	stp x4, x5, [sp, #32]
	stp x6, x7, [sp, #48]
	stp x8, x9, [sp, #64]
	stp x10, x11, [sp, #80]
	stp x12, x13, [sp, #96]
	stp x14, x15, [sp, #112]
	stp x16, x17, [sp, #128]
	stp x18, x19, [sp, #144]
	stp x20, x21, [sp, #160]
	stp x22, x23, [sp, #176]
	stp x24, x25, [sp, #192]
	stp x26, x27, [sp, #208]
	stp x28, x29, [sp, #224]
	str x30, [sp, #240]
	add x0, sp, #320
	str x0, [sp, #248]		/* sp where the detour was entered */
	ldr x0, \pc
	str x0, [sp, #256]		/* pc */
	mrs x2, daif
	str x2, [sp, #304]
	msr daifset, #3			/* interrupts masked, as in the kernel's kprobe handlers */
	mrs x1, nzcv
	orr x1, x1, x2
	mrs x2, currentel
	orr x1, x1, x2
	mrs x2, spsel
	orr x1, x1, x2
	str x1, [sp, #264]		/* pstate */
	stp x29, x0, [sp, #288]		/* the frame record: the probed function's, at pc */
	add x29, sp, #288
	mov x0, sp
	bl \fn
	.endm
	.macro kp_regs_restore
	ldr x2, [sp, #304]
	msr daif, x2
	ldr x1, [sp, #264]
	msr nzcv, x1
	ldp x0, x1, [sp, #0]
	ldp x2, x3, [sp, #16]
	ldp x4, x5, [sp, #32]
	ldp x6, x7, [sp, #48]
	ldp x8, x9, [sp, #64]
	ldp x10, x11, [sp, #80]
	ldp x12, x13, [sp, #96]
	ldp x14, x15, [sp, #112]
	ldp x16, x17, [sp, #128]
	ldp x18, x19, [sp, #144]
	ldp x20, x21, [sp, #160]
	ldp x22, x23, [sp, #176]
	ldp x24, x25, [sp, #192]
	ldp x26, x27, [sp, #208]
	ldp x28, x29, [sp, #224]
	ldr x30, [sp, #240]
	add sp, sp, #320
	.endm
/* @opt_head */
	.section .text.kprewrite,"ax",%progbits
	.p2align 2
	.globl kp_detour_{i}
	.type kp_detour_{i},%function
kp_detour_{i}:
	kp_regs_call kp_site_{i}, kp_dispatch_{n}
	kp_regs_restore
/* @opt_post */
	kp_regs_call kp_post_pc_{i}, kp_post_{n}
	kp_regs_restore
/* @opt_tail */
kp_back_{i}:
	.reloc ., R_AARCH64_JUMP26, {back}
	.inst 0x14000000		/* b: the instruction after the displaced one */
	.p2align 3
kp_site_{i}:
	.reloc ., R_AARCH64_ABS64, {site}
	.quad 0				/* the probe's address */
/* @opt_post_pc */
kp_post_pc_{i}:
	.reloc ., R_AARCH64_ABS64, {post_pc}
	.quad 0				/* the address after the displaced instruction */
/* @opt_end */
	.size kp_detour_{i}, .-kp_detour_{i}
/* @kret_trampoline */
	.section .text.kprewrite,"ax",%progbits
	.p2align 2
	.globl kp_kret_trampoline
	.type kp_kret_trampoline,%function
kp_kret_trampoline:
	kp_regs_call kp_kret_at, kp_kret_return	/* pc the trampoline, until kp_kret_return() sets the real return address */
	str x0, [sp, #240]		/* the real return address into x30, for the ret below (trampoline_probe_handler()'s) */
	kp_regs_restore
	ret
	.p2align 3
kp_kret_at:
	.quad kp_kret_trampoline
	.size kp_kret_trampoline, .-kp_kret_trampoline
