/*
 * Breakpoint (INT3) probes in a kernel: our way into the kernel's #BP path.
 *
 * exc_int3() gives text_poke_bp()'s int3s to poke_int3_handler() first; it
 * then calls do_int3(), whose first question is kprobe_int3_handler(regs):
 * "is this int3 a kprobe's?"  The rewriter puts a `call kp_kernel_int3_entry`
 * on kprobe_int3_handler()'s ftrace site (its __mcount_loc entry dropped, as
 * for an ftrace-site probe; rewriter/targets/linux_kernel/x86_64/traps.py,
 * INT3_HOOK), and do_int3()'s own calls of kprobe_int3_handler() (do_int3()
 * and its copies inlined into exc_int3(); INT3_CALLERS) call the C half,
 * kp_arch_int3_bp(), directly: no call from the ftrace site and jump back at
 * each trap; the ftrace site stays hooked for any caller not found.  So every
 * int3 asks us first: one of our sites (or the int3 after one of our
 * single-stepped copies) is handled here, in kprobe_int3_handler()'s place,
 * and do_int3() gets 1 ("handled"); any other (from user mode, the kernel's
 * own kprobes, kgdb, a BUG-free stray int3) goes on into the rest of
 * kprobe_int3_handler() (past its ftrace site) and notify_die() untouched.
 *
 * kprobe_int3_handler() is NOKPROBE_SYMBOL: a kprobe on it would trap inside
 * the trap handler and recurse.  This hook is a plain call, not a probe: it
 * traps on nothing, takes no lock and runs no dispatch of its own (a probe's
 * "active" and "armed" checks must not stop it: a disarmed or nested hit of
 * our int3 still has to run its instruction out of line), so the blacklist's
 * reason does not apply to it.  A handler that hits another of our int3s
 * nests one #BP inside another (the kernel allows it: #BP is not on an IST
 * stack); that hit counts as missed and runs only its instruction.
 *
 * The trap's struct pt_regs is the kernel's own frame: handlers see and change
 * it in place, and exc_int3() resumes from it.  The entry code left a gap above
 * the frame for an emulated call's push (idtentry's create_gap for X86_TRAP_BP),
 * as int3_emulate_call() needs.
 */
#include "kp_internal.h"

/*
 * The C half is kp_arch_int3_bp(regs) (runtime/arch/x86_64/kp_int3.c: kp_arch_breakpoint_regs(regs, 1),
 * its common cases first; an int3 follows each single-stepped copy).  It needs no
 * dispatch_begin()/end() of its own: exc_int3() has raised the preempt count
 * (irqentry_nmi_enter()), so the CPU, the thread key of the hit, cannot change under it.
 *
 * kp_kernel_int3_entry is called from kprobe_int3_handler()'s first instruction (its ftrace
 * site, the function's first byte: int3_hook()), by a caller other than do_int3()'s
 * (rewritten to call the C half): the stack holds that caller's return address, then ours.  The
 * entry drops ours and jumps to the C half, which so returns straight to the caller: 1
 * for an int3 of ours, as kprobe_int3_handler() would; any other (a user-mode one too,
 * which kprobe_int3_handler() refuses itself) it tail-calls into the rest of
 * kprobe_int3_handler(), past the ftrace site (kp_kernel_breakpoint_next), with regs still the
 * argument and the caller's return address on top, as if the site had been a nop.  No
 * register is saved here: at a function's entry only %rdi is live.
 */
__asm__(".pushsection .text\n"
	".globl kp_kernel_int3_entry\n"
	".type kp_kernel_int3_entry, @function\n"
	"kp_kernel_int3_entry:\n"
	"	add $8, %rsp\n"			/* our return address: kprobe_int3_handler+5 */
	"	jmp kp_arch_int3_bp\n"
	".size kp_kernel_int3_entry, .-kp_kernel_int3_entry\n"
	".globl kp_kernel_breakpoint_next\n"
	".type kp_kernel_breakpoint_next, @function\n"
	"kp_kernel_breakpoint_next:\n"
	"	jmp kprobe_int3_handler + 5\n"	/* past the 5-byte ftrace site */
	".size kp_kernel_breakpoint_next, .-kp_kernel_breakpoint_next\n"
	".popsection\n");

/*
 * The early #BP.  Until setup_arch()'s idt_setup_early_traps() installs
 * exc_int3(), every exception goes through the early IDT: head_64.S's
 * early_idt_handler_common builds a struct pt_regs and calls
 * do_early_exception(regs, trapnr), which fixes up page faults and the like
 * and halts on anything else, an int3 included.  The first printk()s of
 * start_kernel() run sched_clock_cpu() and local_clock() for their timestamps, so
 * a breakpoint site there hung the boot before the console came up.  The
 * rewriter points that call here (rewriter/targets/linux_kernel/x86_64/traps.py,
 * EARLY_HOOK): an int3 of ours (or the one ending a single-stepped copy) runs
 * its instruction and returns into early_idt_handler_common, which restores the
 * frame and irets; anything else goes to do_early_exception() as before.  This
 * runs on the early page tables (our code and data lie inside the kernel image,
 * which they map whole) and touches no per-CPU data.  Never called once the
 * early handlers are gone with the rest of .init.text.
 */
void do_early_exception(struct pt_regs *regs, int trapnr);

void kp_kernel_early_exception(struct pt_regs *regs, int trapnr)
{
	if (trapnr == 3 && kp_arch_int3_early(regs))	/* X86_TRAP_BP */
		return;
	do_early_exception(regs, trapnr);
}

/*
 * Arming the breakpoint sites (arch_arm_kprobe(): text_poke(addr, INT3)), at the
 * sched_init_smp() boot hook (platform.c), once smp_init() has brought every CPU up.
 * The image holds the int3 of a site named exactly in the spec (armed from the first
 * instruction on; a store of the same byte here); a site whose probes all come from
 * globs holds its own instruction until then (rewriter/targets/linux_kernel/writer.py),
 * so no int3 of ours traps where the CPU has no IDT yet: Xen PVH's entry runs
 * xen_prepare_pvh() and the library code it calls (memcmp()) before startup_64 loads
 * one, and each CPU coming up runs cr4_init() (native_write_cr4()) before
 * load_current_idt().  The kernel's text is still writable (it is
 * until mark_rodata_ro()).  The other CPUs run meanwhile: each store is one byte at
 * an instruction's first byte, text_poke_bp()'s first step, so a CPU runs either the
 * old instruction or the int3, never a mix; one that has not seen the store yet
 * runs the old instruction a moment longer (no hit).  A serializing cpuid for this
 * CPU (sync_core()).  A CPU brought up later (hotplug) would meet the armed sites on
 * that path, as with the kernel's own kprobes.
 */
void kp_arch_arm_breakpoints(void)
{
	unsigned long bias = kp_rt.bias;
	for (unsigned int i = 0; i < kp_nbreakpoints; i++)
		*(volatile unsigned char *)(kp_breakpoints[i].addr + bias) = 0xcc;
	if (kp_nbreakpoints) {
		unsigned int a = 1, b, c = 0, d;
		__asm__ volatile("cpuid" : "+a"(a), "=b"(b), "+c"(c), "=d"(d) : : "memory");
	}
}
