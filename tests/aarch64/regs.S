/* _start, and a user of kp_regs.h's macros as a detour would use them
 * (uapi_probe.c checks what the handler saw and what came back). */
#include <kp_regs.h>

	.text
	.globl _start
	.type _start, %function
_start:
	mov	x0, sp
	bl	c_main
	brk	#0x3e8

/* A detour: called with bl, pt_regs right below the caller's sp. */
	.globl regs_entry
	.type regs_entry, %function
	.p2align 2
regs_entry:
	sub	sp, sp, #PT_SIZE
	PT_REGS_SAVE
	add	x0, sp, #PT_SIZE
	str	x0, [sp, #PT_SP]
	adr	x0, regs_entry
	str	x0, [sp, #PT_PC]
	mov	x0, sp
	bl	regs_handler
	PT_REGS_RESTORE
	add	sp, sp, #PT_SIZE
	ret

/* void regs_roundtrip(unsigned long out[32]): x0..x28 = 1000 + n, NZCV = Z,
 * x29 = sp; call the detour; out[0..28] = x0..x28, out[31] = NZCV after. */
	.globl regs_roundtrip
	.type regs_roundtrip, %function
	.p2align 2
regs_roundtrip:
	stp	x29, x30, [sp, #-112]!
	stp	x19, x20, [sp, #16]
	stp	x21, x22, [sp, #32]
	stp	x23, x24, [sp, #48]
	stp	x25, x26, [sp, #64]
	stp	x27, x28, [sp, #80]
	str	x0, [sp, #96]
	mov	x29, sp
	mov	x0, #0x40000000
	msr	nzcv, x0
	.irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28
	mov	x\n, #(1000 + \n)
	.endr
	bl	regs_entry
	ldr	x30, [sp, #96]
	stp	x0, x1, [x30, #0]
	stp	x2, x3, [x30, #16]
	stp	x4, x5, [x30, #32]
	stp	x6, x7, [x30, #48]
	stp	x8, x9, [x30, #64]
	stp	x10, x11, [x30, #80]
	stp	x12, x13, [x30, #96]
	stp	x14, x15, [x30, #112]
	stp	x16, x17, [x30, #128]
	stp	x18, x19, [x30, #144]
	stp	x20, x21, [x30, #160]
	stp	x22, x23, [x30, #176]
	stp	x24, x25, [x30, #192]
	stp	x26, x27, [x30, #208]
	str	x28, [x30, #224]
	mrs	x0, nzcv
	str	x0, [x30, #248]
	ldp	x19, x20, [sp, #16]
	ldp	x21, x22, [sp, #32]
	ldp	x23, x24, [sp, #48]
	ldp	x25, x26, [sp, #64]
	ldp	x27, x28, [sp, #80]
	ldp	x29, x30, [sp], #112
	ret
	.section .note.GNU-stack, "", %progbits
