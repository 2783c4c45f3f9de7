#include <linux/kprobes.h>
#include "message.h"

static int handler_pre(struct kprobe *p, struct pt_regs *regs)
{
    pr_info(WORK_MESSAGE, regs->di);
    return 0;
}
