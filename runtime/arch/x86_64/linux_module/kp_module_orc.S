/*
 * ORC entries for a module's new code, x86-64 (orc.py: PARTS, read by parts): each part follows
 * its line `@NAME` (in a comment).  Read as text by rewriter/targets/linux_module/x86_64/orc.py
 * (the writer's module_parts()); not assembled alone.
 *
 * entry_macro: KP_ORC at, sp_offset, bp_offset, bits: one entry as objtool writes it, a PC32 to
 * the address in .orc_unwind_ip and its six bytes in .orc_unwind (struct orc_entry: sp_offset,
 * bp_offset, then the registers' and type's bit fields); `ld -r` appends them to the module's
 * own tables, which the kernel sorts at load (unwind_module_init()).
 *
 * c_code: the section the runtime's and handlers' code is renamed to (orc.C_SECTION), which the
 * objects framing it open: one with the frame-pointer entry at its start, one with a terminator
 * at its end (c_begin_s(), c_end_s()).
 */
/* @entry_macro */
	.macro KP_ORC at, sp_offset, bp_offset, bits
	.pushsection .orc_unwind_ip,"a",@progbits
	.long \at - .
	.popsection
	.pushsection .orc_unwind,"a",@progbits
	.short \sp_offset, \bp_offset, \bits
	.popsection
	.endm
/* @c_code */
	.section .text.kprewrite_c,"ax",@progbits
