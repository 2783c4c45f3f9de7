#include <kprewrite/kprobes.h>
/* The empty pre_handler of the seeds' "o" row: it never reads regs, so
 * kprewrite gives it the clean call with the dispatch inlined in the detour. */
int empty_pre(struct kprobe *p, struct pt_regs *regs) { return 0; }
/* Reads one register, and only loads from regs: the detour stores that one field
 * of a partial struct pt_regs (a handler that wrote regs would get the whole one,
 * as the kernel's optprobe always builds it). */
int regs_pre(struct kprobe *p, struct pt_regs *regs) { return regs->ax == 0xdead; }
/* The empty handlers of the seeds' "r" and "ro" rows. */
int empty_ret(struct kretprobe_instance *ri, struct pt_regs *regs) { return 0; }
int empty_entry(struct kretprobe_instance *ri, struct pt_regs *regs) { return 0; }
