"""x86-64's per-CPU data as the rewritten kernel's code reads it: the CPU's per-CPU base in
%gs (this_cpu_off), the current task, the preempt count (__preempt_count), interrupts in
EFLAGS, and what preempt_enable() calls on a pending reschedule."""
from __future__ import annotations

from ....arch.base import ThreadKey
from ..symbols import link_symbols, symbol


def thread_key(image) -> ThreadKey:
    """The runtime's "thread" in a kernel is the CPU (preemption off while handlers
    run, as the kernel's current_kprobe is per-CPU).  The runtime keys its block by the
    CPU's number (linux_kernel/kp_platform.h, kp_platform_cpu_slot()), not by this word:
    no template reads the key in a kernel (Rules.fast_forms is off).  No red zone
    (the kernel is built with -mno-red-zone: an interrupt pushes on the stack it
    interrupts), so detours take the short stubs."""
    r = resched(image)
    return ThreadKey("cpu", symbol(image, "this_cpu_off"), symbol(image, "__preempt_count"),
                     None if r is None else link_symbols(image)[r], red_zone=False)


# What preempt_enable() calls on a pending reschedule: the static call PREEMPT_DYNAMIC
# patches at boot (preempt= none/voluntary: a return), else the thunk of a PREEMPT kernel;
# a kernel with neither never preempts kernel code.
RESCHED = ("__SCT__preempt_schedule", "preempt_schedule_thunk")


def resched(image) -> str | None:
    syms = link_symbols(image)
    return next((n for n in RESCHED if syms.get(n)), None)


def current_tasks(symbols) -> list[tuple[str, str | None]]:
    """Where the CPU's current task pointer is, first choice first: (per-CPU variable,
    its member or None).  Linux 6.2+: struct pcpu_hot's current_task; before: current_task."""
    return ([("pcpu_hot", "current_task")] if "pcpu_hot" in symbols else []) + [("current_task", None)]


def current_c(decl: str, ctype: str, current: str) -> str:
    """C: the function `decl` returning the CPU's current task (`current`: the per-CPU
    variable, or variable+offset) as a `ctype *`, as get_current() reads it."""
    return (f"{decl}\n{{\n\t{ctype} *t;\n"
            f'\t__asm__("movq %%gs:{current}, %0" : "=r"(t));\n\treturn t;\n}}\n')


def tail_call_c(name: str, target: str) -> str:
    """C: `void name(void)`, a jump to the kernel's `target` (its arguments and return
    untouched)."""
    return (f"void {name}(void);\n__asm__(\".pushsection .text\\n.globl {name}\\n"
            f"{name}:\\n\\tjmp {target}\\n.popsection\");\n")


# linux/preempt.h's preempt_count() and preemptible(), as x86 defines them: the per-CPU
# __preempt_count with PREEMPT_NEED_RESCHED (bit 31, inverted) masked out.
PREEMPT_H = """#ifndef _KPREWRITE_LINUX_PREEMPT_H
#define _KPREWRITE_LINUX_PREEMPT_H
static inline int preempt_count(void)
{
	int pc;
	__asm__ volatile("movl %%gs:__preempt_count, %0" : "=r"(pc));
	return pc & ~0x80000000;
}
static inline int kp_irqs_disabled(void)
{
	unsigned long flags;
	__asm__ volatile("pushfq; popq %0" : "=r"(flags));
	return !(flags & 0x200);
}
#define preemptible() (preempt_count() == 0 && !kp_irqs_disabled())
#endif
"""
