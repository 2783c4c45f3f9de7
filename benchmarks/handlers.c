#include <kprewrite/kprobes.h>
/* The empty pre_handler of the seeds' "o" row. */
int empty_pre(struct kprobe *p, struct pt_regs *regs) { return 0; }
/* The empty handlers of the seeds' "r" and "ro" rows. */
int empty_ret(struct kretprobe_instance *ri, struct pt_regs *regs) { return 0; }
int empty_entry(struct kretprobe_instance *ri, struct pt_regs *regs) { return 0; }
