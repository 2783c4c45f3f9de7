/*
 * A module's sections for its loader, kept beside its code, whatever the CPU: each part follows
 * its line `@NAME` (in a comment).  Read as text by rewriter/targets/linux_module/<arch>/writer.py
 * (module_parts()), filled in per module; not assembled alone.
 *
 * versions, version: __versions entries (struct modversion_info: the CRC in 8 bytes, the name in
 * 56), for the kernel symbols the module's runtime calls that the module did not: {crc} from the
 * kernel's Module.symvers, {name}, {pad} zero bytes after it (_versions()); `ld -r` appends them
 * to the module's own table, which the loader checks (check_version()).
 *
 * nokprobe, nokprobe_entry: _kprobe_blacklist entries (NOKPROBE_SYMBOL(): the loader hands them to
 * the kprobes blacklist, add_module_kprobe_blacklist()), {func} each function of ours that runs
 * inside a breakpoint's trap (nokprobe_s()), appended to the runtime's assembly.
 */
/* @versions */
	.section __versions,"a"
	.balign 32
/* @version */
	.quad {crc}
	.ascii "{name}"
	.zero {pad}
/* @nokprobe */
	.section _kprobe_blacklist,"aw"
	.balign 8
/* @nokprobe_entry */
	.quad {func}
