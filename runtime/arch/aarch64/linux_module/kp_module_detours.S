/*
 * Templates of the module's detours, arm64 (writer.py: DETOURS, read by parts): each part follows its
 * line `@NAME` (in a comment); {i} is the site's number, {n} its dispatch's, {site} and {back}
 * placeholder references (writer.py's _redirect() points their relocations at the module's
 * sections), filled in per site.  Read as text by rewriter/targets/linux_module/aarch64/writer.py
 * (module_parts()); not assembled alone.
 *
 * opt_head, opt_tail: a jump-optimized probe's detour, entered by the `B` at the probed address (a
 * R_AARCH64_JUMP26 the loader resolves, through a module PLT entry when out of reach): a struct
 * pt_regs on the stack (pc the probe's address, sp and pstate as at the probe) and a frame record
 * {fp, pc} above it so that a stack taken in a handler goes on through the probed function, the
 * dispatch called with interrupts masked, every register restored (a handler's changes to x0-x30 and
 * NZCV kept; a pre_handler's return value ignored, as an optimized kprobe's), then (between the two
 * parts) the displaced instruction's copy, and the `B` back after it.  The layout is the kernel image
 * target's (rewriter/targets/linux_kernel/aarch64/build.py's _call()): 320 bytes, pt_regs (288),
 * the frame record (288), the saved DAIF (304).
 *
 * kret_trampoline: where a kretprobed function returns (its x30 swapped at entry for this, before its
 * paciasp signed it: kp_kret_entry_N()), as the kernel's __kretprobe_trampoline: a struct pt_regs
 * (x0 the return value, sp the function's at entry), kp_kret_return() called (the instances'
 * handlers; it gives the real return address, also regs->pc), every register restored, then `ret`
 * there.
 */
/* @opt_head */
	.section .text.kprewrite,"ax",%progbits
	.p2align 2
	.globl kp_detour_{i}
	.type kp_detour_{i},%function
kp_detour_{i}:
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
	str x0, [sp, #248]		/* sp at the probe */
	ldr x0, kp_site_{i}
	str x0, [sp, #256]		/* pc: the probe's address */
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
	stp x29, x0, [sp, #288]		/* the frame record: the probed function's, at the probe */
	add x29, sp, #288
	mov x0, sp
	bl kp_dispatch_{n}
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
/* @opt_tail */
kp_back_{i}:
	.reloc ., R_AARCH64_JUMP26, {back}
	.inst 0x14000000		/* b: the instruction after the displaced one */
	.p2align 3
kp_site_{i}:
	.reloc ., R_AARCH64_ABS64, {site}
	.quad 0				/* the probe's address */
	.size kp_detour_{i}, .-kp_detour_{i}
/* @kret_trampoline */
	.section .text.kprewrite,"ax",%progbits
	.p2align 2
	.globl kp_kret_trampoline
	.type kp_kret_trampoline,%function
kp_kret_trampoline:
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
	str x0, [sp, #248]		/* sp after the function's ret: its instances' key */
	adr x0, kp_kret_trampoline
	str x0, [sp, #256]		/* pc until kp_kret_return() sets the real return address */
	mrs x2, daif
	str x2, [sp, #304]
	msr daifset, #3
	mrs x1, nzcv
	orr x1, x1, x2
	mrs x2, currentel
	orr x1, x1, x2
	mrs x2, spsel
	orr x1, x1, x2
	str x1, [sp, #264]
	stp x29, x0, [sp, #288]
	add x29, sp, #288
	mov x0, sp
	bl kp_kret_return		/* the instances' handlers; the real return address */
	str x0, [sp, #240]		/* into x30, for the ret below (trampoline_probe_handler()'s) */
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
	ret
	.size kp_kret_trampoline, .-kp_kret_trampoline
