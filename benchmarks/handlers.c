#include <kprewrite/kprobes.h>
/* The empty pre_handler of the seeds' "o" row: it never reads regs, so
 * kprewrite gives it the clean call with the dispatch inlined in the detour. */
int empty_pre(struct kprobe *p, struct pt_regs *regs) { return 0; }
/* Reads one register: the detour builds the full struct pt_regs, as the
 * kernel's optprobe always does. */
int regs_pre(struct kprobe *p, struct pt_regs *regs) { return regs->ax == 0xdead; }
