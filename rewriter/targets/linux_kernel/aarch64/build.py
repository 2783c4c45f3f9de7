"""An instrumented arm64 Image: the handlers and one detour per jump-optimized site, linked
into the Image's own room, and a `B` at each site; where no jump may go, a `brk #BRK_IMM`
handled through the kernel's break hooks (brk_c()) and an out-of-line copy (xol_asm()).

Where things go (facts of Debian's 6.1 arm64 Image):
- code and read-only data: the zero padding inside [_stext, _etext) after the last of the text
  (``_etext`` is 64 KiB-aligned; ~54 KiB in Debian's build), mapped read-only and executable
  by map_kernel() and never freed, a `B` (+-128 MiB) from every function of the text;
- the runtime's debugfs views and trace events, which do not fit the padding: one blob with its
  relocations in the boot-only data (below), placed in module memory at boot (runtime.py); a
  probe's event is called through a pointer the blob sets (events_c());
- writable data (the handlers' .data and .bss, each probe's struct kprobe): the tail of the
  init data, in the unused (all-zero, R_AARCH64_NONE) entries of .rela.dyn before __init_end.
  __relocate_kernel reads them at boot as relocations and skips them (only
  R_AARCH64_RELATIVE is applied): the data must be zero there, or at least no 24-byte entry
  may read as R_AARCH64_RELATIVE.  free_initmem() would free those pages with the rest of
  the init memory: its `adrp x20, __init_end` is pointed at the first page kept
  (free_reserved_area() and vunmap_range() both take their end from x20), so the init memory
  freed ends where ours starts.  The pages stay mapped read-write and non-executable.

Everything is PC-relative (adrp/add, bl, b): KASLR moves the kernel by a multiple of 64 KiB,
the Image's relocation table has no room for our absolute addresses, and none is needed; an
absolute relocation in the handlers is refused.

A detour (detour_asm()): a struct pt_regs on the kernel stack (x0..x30, sp, pc = the probed
address, pstate = NZCV, DAIF, CurrentEL and SPSel: 0x...3c5 at EL1h with interrupts on),
interrupts masked as in the kernel's own kprobe handlers, a frame record, the generated
dispatcher (a struct kprobe filled at run time, the pre_handler called), everything
restored, the displaced instruction relocated (arch.emit.relocate()); then the
post_handler's call the same way (pc = the address after the displaced instruction), and a
`B` back after the site.  At a function's entry, a pre_handler that returns non-zero goes on
at the regs->pc it set (_changed(), as the kernel's ftrace-based kprobes do)."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from ....arch.aarch64 import emit as E, encode as enc, insn as I
from ....errors import KprewriteError
from ....link.toolchain import run
from ....link.runtime import cflags, _includes
from ....planner import FTRACE, BREAKPOINT, OPTIMIZED
from ....probes.events import trace_key
from ....probes.resolve import event_symbol, is_entry
from . import runtime as rt
from ...linux_kernel.symbols import link_symbols

PT_REGS = 288          # runtime/include/kprewrite/arch/aarch64/ptrace.h
FRAME = 320            # pt_regs, a frame record (288), the saved DAIF (304), padding
DCR_ROOM = 16          # the displaced instruction, relocated (at most 3 words), NOP-padded
PAGE = 0x1000
CONT = 0x10000         # a contiguous-hint run of 4 KiB pages (map_kernel_segment() may set PTE_CONT)
BLOCK = 0x200000       # a PMD block mapping
R_AARCH64_RELATIVE = 1027
# Relocations whose value does not move with KASLR (PC-relative, or the low bits of an address).
# The relocation types of our objects that stay right wherever KASLR puts the image (their
# numbers: the ELF for the Arm 64-bit Architecture ABI), by name for the refusal.
PC_RELATIVE_RELOCS = {0: "R_AARCH64_NONE", 260: "R_AARCH64_PREL64", 261: "R_AARCH64_PREL32",
                      262: "R_AARCH64_PREL16", 273: "R_AARCH64_LD_PREL_LO19", 274: "R_AARCH64_ADR_PREL_LO21",
                      275: "R_AARCH64_ADR_PREL_PG_HI21", 276: "R_AARCH64_ADR_PREL_PG_HI21_NC",
                      277: "R_AARCH64_ADD_ABS_LO12_NC", 278: "R_AARCH64_LDST8_ABS_LO12_NC",
                      279: "R_AARCH64_TSTBR14", 280: "R_AARCH64_CONDBR19", 282: "R_AARCH64_JUMP26",
                      283: "R_AARCH64_CALL26", 284: "R_AARCH64_LDST16_ABS_LO12_NC",
                      285: "R_AARCH64_LDST32_ABS_LO12_NC", 286: "R_AARCH64_LDST64_ABS_LO12_NC",
                      299: "R_AARCH64_LDST128_ABS_LO12_NC"}
ABSOLUTE_RELOCS = {257: "R_AARCH64_ABS64", 258: "R_AARCH64_ABS32", 259: "R_AARCH64_ABS16"}
# The kernel's names for what the runtime's headers declare (6.1: printk is _printk).
KERNEL_NAMES = {"printk": "_printk", "vprintk": "vprintk"}
# Breakpoint probes: immediates no one else uses (arch/arm64/include/asm/brk-imm.h has 0x004-0x007,
# 0x100, 0x400, 0x401, 0x800, 0x900-0x9ff, 0x8000-), the probe's and the one after its copy.
BRK_IMM, BRK_SS_IMM = 0x0A0, 0x0A1
# Where the break hooks are registered: setup_arch()'s entry (a jump probe of our own); the
# kernel takes breakpoints through them from trap_init() (debug_traps_init()) on.
HOOK_FUNCTION = "setup_arch"
# Where the command line's kprewrite.enabled is read: do_early_param(), parse_early_param()'s
# callback for each parameter (setup_arch()).
CMDLINE_HOOK_FUNCTION = "do_early_param"
# Where a dead task's kretprobe instances are freed (kp_kret_flush_task()): do_exit()'s entry.
EXIT_HOOK_FUNCTION = "do_exit"


def _call(i: int, pc: str, fn: str, changed: str | None = None, after: str = "") -> str:
    """A struct pt_regs on the stack (pc: the symbol of the address it reports), fn(regs)
    called with interrupts masked, everything restored; changed: where to go instead when fn
    returns non-zero (a pre_handler that changed the path); after: instructions right after
    the call (the trampoline's: fn's result into regs->regs[30])."""
    saves = "\n".join(f"\tstp x{r}, x{r + 1}, [sp, #{8 * r}]" for r in range(0, 30, 2))
    loads = "\n".join(f"\tldp x{r}, x{r + 1}, [sp, #{8 * r}]" for r in range(0, 30, 2))
    branch = f"\tcbnz w0, {changed}\n" if changed else after
    return f"""\tsub sp, sp, #{FRAME}
{saves}
\tstr x30, [sp, #240]
\tadd x0, sp, #{FRAME}
\tstr x0, [sp, #248]
\tadrp x0, {pc}
\tadd x0, x0, :lo12:{pc}
\tstr x0, [sp, #256]
\tmrs x2, daif
\tstr x2, [sp, #304]
\tmsr daifset, #3
\tmrs x1, nzcv
\torr x1, x1, x2
\tmrs x2, currentel
\torr x1, x1, x2
\tmrs x2, spsel
\torr x1, x1, x2
\tstr x1, [sp, #264]
\tstp x29, x0, [sp, #288]
\tadd x29, sp, #288
\tmov x0, sp
\tbl {fn}
{branch}\tldr x2, [sp, #304]
\tmsr daif, x2
\tldr x1, [sp, #264]
\tmsr nzcv, x1
{loads}
\tldr x30, [sp, #240]
\tadd sp, sp, #{FRAME}
"""


def _changed(i: int) -> str:
    """A pre_handler returned non-zero: the registers from its struct pt_regs (as it left
    them; not sp), then on at regs->pc, through x16 (IP0), which the procedure call standard
    leaves dead where such a change goes: a function's entry or a return address
    (override_function_with_return() sets pc = lr)."""
    loads = "\n".join(f"\tldp x{r}, x{r + 1}, [sp, #{8 * r}]" for r in range(0, 30, 2))
    return f"""kp_changed_{i}:
\tldr x2, [sp, #304]
\tmsr daif, x2
\tldr x1, [sp, #264]
\tmsr nzcv, x1
{loads}
\tldr x30, [sp, #240]
\tldr x16, [sp, #256]
\tadd sp, sp, #{FRAME}
\tbr x16
"""


def detour_asm(i: int, post: bool) -> str:
    """Site i's detour: the pre_handlers' call (regs->pc the probed address), the displaced
    instruction (kp_dcr_i: NOPs here, written relocated after the link), the post_handlers'
    call if any (regs->pc the address after the displaced instruction), and a `B` back; or,
    when a pre_handler returns non-zero, on at the regs->pc it set (_changed())."""
    return f"""
\t.section .text.kp_detour_{i},"ax"
\t.p2align 3
\t.globl kp_detour_{i}
kp_detour_{i}:
{_call(i, f"kp_site_{i}", f"kp_dispatch_{i}", f"kp_changed_{i}")}\t.globl kp_dcr_{i}
kp_dcr_{i}:
\t.rept {DCR_ROOM // 4}
\tnop
\t.endr
{_call(i, f"kp_post_pc_{i}", f"kp_post_dispatch_{i}") if post else ""}\tb kp_resume_{i}
{_changed(i)}"""


def xol_asm(i: int, post: bool) -> str:
    """Breakpoint site i's out-of-line copy (kp_xol_i: NOPs here, the probed instruction
    written relocated after the link), then `brk #BRK_SS_IMM` when it has post_handlers, else
    a `B` back after the site."""
    return f"""
\t.section .text.kp_xol_{i},"ax"
\t.p2align 3
\t.globl kp_xol_{i}
kp_xol_{i}:
\t.rept {DCR_ROOM // 4}
\tnop
\t.endr
\t.globl kp_xol_end_{i}
kp_xol_end_{i}:
\t{f"brk #{BRK_SS_IMM:#x}" if post else f"b kp_resume_{i}"}
"""


def brk_c(brk_sites: list[tuple[int, bool]]) -> str:
    """The kernel's break hooks (struct break_hook, register_kernel_break_hook()): at the
    probe's brk, the pre_handlers, then on at the copy (unless one changed the path, as the
    kernel's kprobe_breakpoint_handler() allows); at the brk after a copy, regs->pc after the
    probed instruction and the post_handlers (post_kprobe_handler()).  Registered by
    kp_brk_register(), the pre_handler of the hook probe on HOOK_FUNCTION's entry."""
    out = ["""
struct kp_break_hook {
	void *next, *prev;
	int (*fn)(struct pt_regs *regs, unsigned long esr);
	unsigned short imm, mask;
};
void register_kernel_break_hook(struct kp_break_hook *hook);
static struct kp_break_hook kp_brk_hook, kp_brk_ss_hook;
"""]
    pre, post = [], []
    for i, with_post in brk_sites:
        out.append(f"extern char kp_site_{i}[], kp_xol_{i}[], kp_xol_end_{i}[], kp_resume_{i}[];\n")
        pre.append(f"""
	if (regs->pc == (unsigned long)kp_site_{i}) {{
		if (!kp_dispatch_{i}(regs))
			regs->pc = (unsigned long)kp_xol_{i};
		return 0;
	}}""")
        if with_post:
            post.append(f"""
	if (regs->pc == (unsigned long)kp_xol_end_{i}) {{
		regs->pc = (unsigned long)kp_resume_{i};
		kp_post_dispatch_{i}(regs);
		return 0;
	}}""")
    out.append(f"""
static int kp_brk_fn(struct pt_regs *regs, unsigned long esr)
{{{"".join(pre)}
	return 1;	/* DBG_HOOK_ERROR: not ours */
}}

static int kp_brk_ss_fn(struct pt_regs *regs, unsigned long esr)
{{{"".join(post)}
	return 1;
}}

__attribute__((used)) int kp_brk_register(struct kprobe *p, struct pt_regs *regs)
{{
	kp_brk_hook.fn = kp_brk_fn;
	kp_brk_hook.imm = {BRK_IMM:#x};
	register_kernel_break_hook(&kp_brk_hook);
	kp_brk_ss_hook.fn = kp_brk_ss_fn;
	kp_brk_ss_hook.imm = {BRK_SS_IMM:#x};
	register_kernel_break_hook(&kp_brk_ss_hook);
	return 0;
}}
""")
    return "".join(out)


KEEP_RETURN_ADDRESS = "\tstr x0, [sp, #240]\n"     # the handler's result into regs->regs[30]


def trampoline_asm() -> str:
    """The kretprobes' return trampoline (the kernel's __kretprobe_trampoline): a function whose
    entry swapped x30 for it returns here, sp back at its value at the entry; a struct pt_regs
    (pc: the trampoline; the handler sets it to the real return address), the return handlers
    (kp_kret_trampoline_handler()), the registers restored as they left them, and `ret` to the
    real return address it returned.  Reached by a plain `ret` after the function's autiasp, so
    pointer authentication has checked the swapped value the function's paciasp signed."""
    return f"""
\t.section .text.kp_kret_trampoline,"ax"
\t.p2align 3
\t.globl kp_kret_trampoline
kp_kret_trampoline:
{_call(0, "kp_kret_trampoline", "kp_kret_trampoline_handler", after=KEEP_RETURN_ADDRESS)}\tret
"""


KRET_DEFAULT_MAXACTIVE = 10     # the kernel's max(10, 2 * num_possible_cpus()) up to 5 CPUs


def kretprobe_c(krets) -> str:
    """The kretprobes (krets: (index, EntryProbe, handler, entry_handler) in the spec's order):
    each a struct kretprobe, a static pool of maxactive instances with their owners, and its entry
    (pre_handler_kretprobe(): claim an instance, none free: nmissed; the entry_handler, non-zero:
    no return for this call; ri->ret_addr = x30, ri->fp = sp; x30 swapped for the trampoline, as
    arch_prepare_kretprobe()).  An instance's owner is its task (sp_el0) and the sp of the call:
    at the trampoline, sp is back at that value, so the current task's instance at the current sp
    is the call returning (the newest first: a tail call into another return-probed function
    shares the sp, and its instance holds the trampoline as its return address; the kernel's
    __kretprobe_trampoline_handler() walks the task's list the same way).  A task's instances are
    freed when it exits (kp_kret_flush_task(), on do_exit()'s entry, as kprobe_flush_task() frees
    a dead task's), so a call that never returns does not keep one."""
    out = ["""
extern char kp_kret_trampoline[];
void panic(const char *fmt, ...);
static unsigned long kp_kret_seq;
#define KP_RI_CLAIMING ((void *)1)
"""]
    each = []
    for k, p, h, eh in krets:
        n = p.kret.maxactive if p.kret.maxactive > 0 else KRET_DEFAULT_MAXACTIVE
        stride = (40 + p.kret.data_size + 7) & ~7
        for name in (h, eh):
            if name:
                out.append(f"int {name}(struct kretprobe_instance *ri, struct pt_regs *regs);\n")
        out.append(f"""
#define kp_rp_{k} kp_kretprobes[{k}]
static char kp_rp_pool_{k}[{n}][{stride}] __attribute__((aligned(8)));
static void *kp_rp_task_{k}[{n}];
static unsigned long kp_rp_seq_{k}[{n}];

static void kp_kret_entry_{k}(struct pt_regs *regs)
{{
	struct kretprobe_instance *ri;
	int n;

	__atomic_fetch_add(&kp_hit_block.hits[KP_NKPROBES + {k}], 1, __ATOMIC_RELAXED);
	kp_rp_{k}.kp.addr = (kprobe_opcode_t *)regs->pc;
	kp_rp_{k}.kp.symbol_name = "{p.symbol}";
	kp_rp_{k}.handler = {h or 0};
	kp_rp_{k}.entry_handler = {eh or 0};
	kp_rp_{k}.maxactive = {n};
	kp_rp_{k}.data_size = {p.kret.data_size};
	for (n = 0; n < {n}; n++) {{
		void *none = 0;

		if (__atomic_compare_exchange_n(&kp_rp_task_{k}[n], &none, KP_RI_CLAIMING, 0, __ATOMIC_ACQUIRE,
						__ATOMIC_RELAXED))
			break;
	}}
	if (n == {n}) {{
		__atomic_fetch_add(&kp_rp_{k}.nmissed, 1, __ATOMIC_RELAXED);
		return;
	}}
	ri = (struct kretprobe_instance *)kp_rp_pool_{k}[n];
	ri->rp = &kp_rp_{k};
{f'''	if ({eh}(ri, regs)) {{
		__atomic_store_n(&kp_rp_task_{k}[n], (void *)0, __ATOMIC_RELEASE);
		return;
	}}
''' if eh else ''}	ri->ret_addr = (kprobe_opcode_t *)regs->regs[30];
	ri->fp = (void *)regs->sp;
	kp_rp_seq_{k}[n] = __atomic_add_fetch(&kp_kret_seq, 1, __ATOMIC_RELAXED);
	regs->regs[30] = (unsigned long)kp_kret_trampoline;
	__atomic_store_n(&kp_rp_task_{k}[n], kp_task(), __ATOMIC_RELEASE);
}}
""")
        each.append((k, n))
    find = "".join(f"""
	for (n = 0; n < {n}; n++)
		if (kp_rp_task_{k}[n] == t && ((struct kretprobe_instance *)kp_rp_pool_{k}[n])->fp == (void *)sp &&
		    kp_rp_seq_{k}[n] > seq && kp_rp_seq_{k}[n] < below) {{
			seq = kp_rp_seq_{k}[n];
			*owner = &kp_rp_task_{k}[n];
			*which = {k};
			ri = (struct kretprobe_instance *)kp_rp_pool_{k}[n];
		}}""" for k, n in each)
    # The handlers called by the position of the instance's pool, never through the writable
    # struct kretprobe's fields (as the x86-64 kernel's kp_kret_handlers[]: docs/security.md).
    calls = "".join(f"\n\tcase {k}:\n\t\t{h}(ri, regs);\n\t\tbreak;" for k, _p, h, _eh in krets if h)
    flush = "".join(f"""
	for (n = 0; n < {n}; n++)
		if (kp_rp_task_{k}[n] == t)
			__atomic_store_n(&kp_rp_task_{k}[n], (void *)0, __ATOMIC_RELEASE);""" for k, n in each)
    out.append(f"""
/* The current task's newest instance at sp older than `below` (its owner slot in *owner, its
 * sequence number in *at), or NULL. */
static inline __attribute__((always_inline)) struct kretprobe_instance *
kp_kret_find(void *t, unsigned long sp, unsigned long below, void ***owner, int *which, unsigned long *at)
{{
	struct kretprobe_instance *ri = 0;
	unsigned long seq = 0;
	int n;
{find}
	*at = seq;
	return ri;
}}

/* Two or more instances of this call (a tail call into another return-probed function, two
 * kretprobes on one function): the newer ones hold the trampoline as their return address.  The
 * real one is the oldest's; each handler runs, newest first, with ri->ret_addr and regs->pc that
 * address, as __kretprobe_trampoline_handler() sets correct_ret_addr in each.  (A handler's
 * nested hits are missed: no instance is added meanwhile.) */
static __attribute__((noinline)) unsigned long kp_kret_chain(struct pt_regs *regs, void *t,
							   struct kretprobe_instance *ri, void **owner, int which,
							   unsigned long below)
{{
	void **older_owner;
	unsigned long ret;
	int older_which, count = 1;
	struct kretprobe_instance *older;

	for (ret = (unsigned long)ri->ret_addr; ret == (unsigned long)kp_kret_trampoline; count++) {{
		older = kp_kret_find(t, regs->sp, below, &older_owner, &older_which, &below);
		if (!older)
			panic("kprewrite: kretprobe trampoline at sp %lx: no instance of this task\\n", regs->sp);
		ret = (unsigned long)older->ret_addr;
	}}
	regs->pc = ret;
	for (;;) {{
		ri->ret_addr = (kprobe_opcode_t *)ret;
		switch (which) {{{calls}
		}}
		__atomic_store_n(owner, (void *)0, __ATOMIC_RELEASE);
		if (--count == 0)
			break;
		ri = kp_kret_find(t, regs->sp, ~0UL, &owner, &which, &below);
	}}
	return ret;
}}

/* At the trampoline: the newest instance of this call, its handler with regs->pc the real
 * return address (kp_kret_chain() when it is another instance's trampoline); returns it. */
__attribute__((used)) unsigned long kp_kret_trampoline_handler(struct pt_regs *regs)
{{
	void *t = kp_task(), **owner;
	unsigned long ret, seq;
	int g = kp_enter(), which = -1;
	struct kretprobe_instance *ri;

	ri = kp_kret_find(t, regs->sp, ~0UL, &owner, &which, &seq);
	if (!ri)
		panic("kprewrite: kretprobe trampoline at sp %lx: no instance of this task\\n", regs->sp);
	ret = (unsigned long)ri->ret_addr;
	if (ret == (unsigned long)kp_kret_trampoline) {{
		ret = kp_kret_chain(regs, t, ri, owner, which, seq);
	}} else {{
		regs->pc = ret;
		switch (which) {{{calls}
		}}
		__atomic_store_n(owner, (void *)0, __ATOMIC_RELEASE);
	}}
	kp_leave(g);
	return ret;
}}

/* do_exit()'s entry: the task's frames never return; its instances go back to their pools. */
__attribute__((used)) int kp_kret_flush_task(struct kprobe *p, struct pt_regs *regs)
{{
	void *t = kp_task();
	int n;
{flush}
	return 0;
}}
""")
    return "".join(out)


# struct ftrace_ops as the image's BTF lays it out (INIT_OPS_HASH() done at run time: the data
# holds no absolute address), and the flag asking ftrace for a whole struct pt_regs.
FTRACE_OPS_LAYOUT = (("ftrace_ops", None), ("ftrace_ops", "func"), ("ftrace_ops", "flags"),
                     ("ftrace_ops", "local_hash"), ("ftrace_ops", "func_hash"), ("ftrace_ops_hash", "regex_lock"),
                     (None, "FTRACE_OPS_FL_SAVE_REGS"))
# Where the ftrace_ops is registered: kernel_init_freeable()'s entry (process context, after
# ftrace_init(), before the secondary CPUs and the initcalls), a jump probe of our own.
OPS_HOOK_FUNCTION = "kernel_init_freeable"


def ftrace_ops_c(groups, ops_layout, index) -> str:
    """The glob sites reached through ftrace (Site.ftrace_ops; the kernel's kprobes on ftrace,
    kprobe_ftrace_handler(), without a kprobe per function): one struct ftrace_ops asking for
    pt_regs, its filter the sites (ftrace_set_filter_ips(), each site by its ftrace record's
    address, the `bl` at entry + 4), registered by kp_ftrace_ops_register() at
    OPS_HOOK_FUNCTION's entry.  groups: (rows, [(pre, post)...]): the sites whose probes have the
    same handlers, as offsets from kp_ops_anchor (the image's start) of their records, sorted.
    At a hit, regs->pc is the entry (p->addr) for the pre_handlers and entry + 8 (after the
    NOPs) for the post_handlers, as kprobe_ftrace_handler() emulates the single-step; a
    pre_handler returning non-zero leaves regs->pc where it set it, and ftrace returns there.
    One struct kprobe per glob probe and group, its addr set at each hit (symbol_name NULL:
    kallsyms names the address); a hit while the task is in a handler counts in its nmissed."""
    size, f_func, f_flags, f_local, f_hash, f_lock, fl_regs = ops_layout
    out = [f"""
extern char kp_ops_anchor[];
void *vmalloc(unsigned long size);
void vfree(const void *addr);
int ftrace_set_filter_ips(void *ops, unsigned long *ips, unsigned int cnt, int remove, int reset);
int ftrace_set_filter_ip(void *ops, unsigned long ip, int remove, int reset);
int register_ftrace_function(void *ops);
void __mutex_init(void *lock, const char *name, void *key);
static char kp_ops[{size}] __attribute__((aligned(16)));
static char kp_ops_lock_key[16];

static int kp_ops_find(const unsigned int *rows, int n, unsigned int off)
{{
	int lo = 0, hi = n;

	while (lo < hi) {{
		int mid = (lo + hi) / 2;

		if (rows[mid] == off)
			return 1;
		if (rows[mid] < off)
			lo = mid + 1;
		else
			hi = mid;
	}}
	return 0;
}}
"""]
    declared, cases, fill = set(), [], []
    total = sum(len(rows) for rows, _, _ in groups)
    for g, (rows, handlers, labels) in enumerate(groups):
        out.append(f"static const unsigned int kp_ops_boot_rows_{g}[{len(rows)}] __attribute__((used, section(\".kp_initdata\"))) = {{"
                   + ",".join(str(r) for r in rows) + f"}};\nstatic unsigned int *kp_ops_rows_{g};\n")
        missed, calls, posts = [], [], []
        for j, (pre, post) in enumerate(handlers):
            _declare(out, declared, pre, post)
            k = f"kp_ops_kprobe_{g}_{j}"
            # (Its symbol_name stays NULL, as its handlers see it: the list shows the last hit's address.)
            n = index.add(labels[j][2], 0, None, 0, labels[j][1], KPROBE_FLAG_FTRACE)
            out.append(f"#define {k} kp_kprobes[{n}]\n")
            missed.append(f"\n\t\t\t{k}.nmissed++;")
            calls.append(f"\n\t\t__atomic_fetch_add(&kp_hit_block.hits[{n}], 1, __ATOMIC_RELAXED);"
                         f"\n\t\t{k}.addr = (kprobe_opcode_t *)(ip - 4);")
            if pre:
                calls.append(f"\n\t\t{k}.pre_handler = {pre};\n\t\tif ({pre}(&{k}, regs))\n\t\t\tgoto changed;")
            if post:
                calls.append(f"\n\t\t{k}.post_handler = {post};")
                posts.append(f"\n\t\t{post}(&{k}, regs, 0);")
        cases.append(f"""
	if ({"1" if len(groups) == 1 else f"kp_ops_find(kp_ops_rows_{g}, {len(rows)}, off)"}) {{   /* ftrace's filter: the sites */
		if (g < 0) {{{"".join(missed)}
			goto out;
		}}
		regs->pc = ip - 4;{"".join(calls)}
		regs->pc = ip + 4;{"".join(posts)}
		goto done;
	}}""")
        fill.append(f"""
	kp_ops_rows_{g} = rows;
	for (i = 0; i < {len(rows)}; i++) {{
		*rows++ = kp_ops_boot_rows_{g}[i];
		ips[n++] = base + kp_ops_boot_rows_{g}[i];
	}}""")
    out.append(f"""
static void kp_ftrace_handler(unsigned long ip, unsigned long parent_ip, void *op, struct pt_regs *regs)
{{
	unsigned int off = (unsigned int)(ip - (unsigned long)kp_ops_anchor);
	unsigned long daif;
	int g;

	if (kp_disarmed)
		return;
	asm volatile("mrs %0, daif\\n\\tmsr daifset, #3" : "=r"(daif) :: "memory");
	g = kp_enter();{"".join(cases)}
	goto out;
changed:
done:
	kp_leave(g);
out:
	asm volatile("msr daif, %0" :: "r"(daif) : "memory");
}}

/* Process context (kernel_init_freeable()): ftrace's mutexes may sleep, so interrupts are on
 * for the calls as they were before the detour. */
__attribute__((used)) int kp_ftrace_ops_register(struct kprobe *p, struct pt_regs *regs)
{{
	unsigned long *ips, base = (unsigned long)kp_ops_anchor;
	unsigned int n = 0, i, *rows;
	int r;

	if (!(regs->pstate & 0x80))
		asm volatile("msr daifclr, #3" ::: "memory");
	*(void **)(kp_ops + {f_func}) = (void *)kp_ftrace_handler;
	*(unsigned long *)(kp_ops + {f_flags}) = {fl_regs};
	*(void **)(kp_ops + {f_hash}) = kp_ops + {f_local};
	__mutex_init(kp_ops + {f_local} + {f_lock}, "kp_ops", kp_ops_lock_key);
	/* The sites, from the boot-only data (freed with the init memory) to kept memory. */
	ips = vmalloc({total} * sizeof(*ips));
	rows = vmalloc({total} * sizeof(*rows));
	if (!ips || !rows) {{
		vfree(ips);
		vfree(rows);
		pr_err("kprewrite: no memory for the glob probes' ftrace filter: not armed\\n");
		goto out;
	}}{"".join(fill)}
	r = ftrace_set_filter_ips(kp_ops, ips, n, 0, 1);
	if (r) {{
		pr_warn("kprewrite: ftrace_set_filter_ips: %d; setting the filter one function at a time\\n", r);
		for (i = 0; i < n; i++)
			ftrace_set_filter_ip(kp_ops, ips[i], 0, 0);
	}}
	vfree(ips);
	r = register_ftrace_function(kp_ops);
	if (r)
		pr_err("kprewrite: register_ftrace_function: %d: the glob probes are not armed\\n", r);
out:
	asm volatile("msr daifset, #3" ::: "memory");
	return 0;
}}
""")
    return "".join(out)


def _declare(out: list, declared: set, pre: str | None, post: str | None) -> None:
    """The prototypes of a probe's pre and post handlers, each once."""
    for name, proto in ((pre, "int {}(struct kprobe *p, struct pt_regs *regs);"),
                        (post, "void {}(struct kprobe *p, struct pt_regs *regs, unsigned long flags);")):
        if name and name not in declared:
            declared.add(name)
            out.append(proto.format(name) + "\n")


GUARD_C = r"""
#define KP_SLOTS 64
static void *kp_active[KP_SLOTS];
static int kp_disarmed;		/* kprewrite.enabled=0 (kp_cmdline()) */

/* do_early_param(param, val, ...), for each parameter of the command line in setup_arch()'s
 * parse_early_param(): kprewrite.enabled=0 disarms every probe of the spec, the last one
 * given wins (the kernel ignores a dotted parameter it does not know). */
__attribute__((used)) int kp_cmdline(struct kprobe *p, struct pt_regs *regs)
{
	static const char key[] = "kprewrite.enabled";
	const char *param = (const char *)regs->regs[0], *val = (const char *)regs->regs[1];
	unsigned int i;

	for (i = 0; i < sizeof(key); i++)
		if (param[i] != key[i])
			return 0;
	if (!val)
		return 0;
	kp_disarmed = val[0] == '0' && !val[1];
	if (kp_disarmed)
		pr_info("kprewrite: kprewrite.enabled=0: every probe disarmed\n");
	return 0;
}

static inline void *kp_task(void)
{
	void *t;

	asm volatile("mrs %0, sp_el0" : "=r"(t));
	return t;
}

static int kp_nslots;		/* slots ever taken: how far the task's own is looked for */

/* The slot the task takes while in handlers; -1 when it is in one already; KP_SLOTS when
 * every slot is taken (more CPUs than slots: unguarded).  Only the task itself looks for its
 * slot, and it raised kp_nslots past it before leaving here, so the search stops there (one
 * slot per CPU in handlers at once: scanning all 64 was most of a hit's cost). */
static int kp_enter(void)
{
	void *t = kp_task();
	int i, n = __atomic_load_n(&kp_nslots, __ATOMIC_ACQUIRE);

	for (i = 0; i < n; i++)
		if (__atomic_load_n(&kp_active[i], __ATOMIC_RELAXED) == t)
			return -1;
	for (i = 0; i < KP_SLOTS; i++) {
		void *none = 0;

		if (__atomic_compare_exchange_n(&kp_active[i], &none, t, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
			while (n <= i && !__atomic_compare_exchange_n(&kp_nslots, &n, i + 1, 0, __ATOMIC_RELEASE,
								      __ATOMIC_RELAXED))
				;
			return i;
		}
	}
	return KP_SLOTS;
}

static void kp_leave(int g)
{
	if (g >= 0 && g < KP_SLOTS)
		__atomic_store_n(&kp_active[g], (void *)0, __ATOMIC_RELEASE);
}
"""


class ProbeIndex:
    """The spec's probes, each a slot of kp_kprobes[] (and of the hit counters) in the spec's
    order (key: the probe's index), as the debugfs views list them (runtime.glue_c()'s rows:
    link address, symbol, offset, event name, flags).  add() gives the C for the slot: a macro
    (KP_SLOT_n) that slots() defines once every probe is known."""
    def __init__(self):
        self._rows = []

    def add(self, key: int, addr: int, symbol, offset: int, name: str, flags: int) -> str:
        self._rows.append((key, len(self._rows), (addr, symbol, offset, name, flags)))
        return f"KP_SLOT_{len(self._rows) - 1}"

    @property
    def rows(self) -> list:
        return [row for _k, _n, row in sorted(self._rows)]

    def slots(self) -> str:
        order = sorted(self._rows)
        return "".join(f"#define KP_SLOT_{n} {slot}\n" for slot, (_k, n, _r) in
                       sorted(enumerate(order), key=lambda e: e[1][1]))


KPROBE_FLAG_OPTIMIZED, KPROBE_FLAG_FTRACE = 4, 8


def dispatch_c(sites, changes, krets=(), ops=None, index=None, flags=None) -> str:
    """Per site, a struct kprobe per probe (in the writable data, filled at run time: no
    absolute address in data), and the functions the detour calls: each probe's pre_handler
    in the spec's order, then, after the displaced instruction, each post_handler.  At a
    function's entry (changes[i]: the kernel's ftrace-based kprobe there,
    kprobe_ftrace_handler()) and at a breakpoint, a pre_handler returning non-zero changed
    the path: the rest and the post_handlers are skipped (aggr_pre_handler()) and the detour
    goes on at regs->pc; elsewhere its return value is ignored, as opt_pre_handler() ignores it.

    A hit while the same task is in a handler (a handler that reaches a probed function) runs
    no handler and counts in each probe's nmissed, as kprobe_running() makes the kernel do:
    the tasks in handlers are in kp_active[] (their sp_el0; interrupts are masked there, so
    at most one per CPU).  A kretprobe's entry (krets: kretprobe_c()) is one of the site's
    probes, in the spec's order; ops: the glob sites reached through ftrace (ftrace_ops_c()).

    The spec's struct kprobes are kp_kprobes[] (index: ProbeIndex, flags: each site's
    KPROBE_FLAG_*), its kretprobes kp_kretprobes[], and each counts its hits (armed, not
    missed) in kp_hit_block, laid out as the runtime's struct kp_thread: the runtime placed
    at boot (runtime.py) reads them for the debugfs views."""
    index = index if index is not None else ProbeIndex()
    out = ["#include <linux/kprobes.h>\n", "", GUARD_C, kretprobe_c(krets) if krets else "",
           ftrace_ops_c(*ops, index) if ops else ""]
    kret_of = {id(p): k for k, p, _, _ in krets}
    declared = set()
    for i, (site, probes) in enumerate(sites):
        fill, calls, missed, posts = [], [], [], []
        for j, (probe, pre, post) in enumerate(probes):
            if id(probe) in kret_of:
                k = kret_of[id(probe)]
                missed.append(f"\n\t\tif (!kp_disarmed)\n\t\t\tkp_rp_{k}.kp.nmissed++;")
                calls.append(f"\n\tif (!kp_disarmed)\n\t\tkp_kret_entry_{k}(regs);")
                continue
            # Our own hooks stay armed with kprewrite.enabled=0; the spec's probes do not.
            armed = "" if getattr(probe, "hook", None) else "!kp_disarmed && "
            _declare(out, declared, pre, post)
            k = f"kp_kprobe_{i}_{j}"
            # A disarmed probe is not hit at all: no hit, no nmissed (the kernel's disarmed kprobe).
            missed.append(f"\n\t\tif (!kp_disarmed)\n\t\t\t{k}.nmissed++;" if armed else f"\n\t\t{k}.nmissed++;")
            if armed:
                n = index.add(probe.index, probe.addr, probe.symbol, probe.offset, probe.event_name,
                              flags[i] if flags else 0)
                out.append(f"#define {k} kp_kprobes[{n}]\n")
                hit = f"\n\t\t__atomic_fetch_add(&kp_hit_block.hits[{n}], 1, __ATOMIC_RELAXED);"
            else:
                out.append(f"static struct kprobe {k};\n")
            fill.append(f"""
	{k}.addr = (kprobe_opcode_t *)regs->pc;
	{k}.symbol_name = "{probe.symbol}";
	{k}.offset = {probe.offset};""" + (f"\n\t{k}.pre_handler = {pre};" if pre else "")
                        + (f"\n\t{k}.post_handler = {post};" if post else ""))
            # An armed probe: its hit counted, then its pre_handler, under one test of kp_disarmed.
            if pre and changes[i]:
                calls.append(f"""
	if ({armed}{pre}(&{k}, regs)) {{
		kp_leave(g);
		return 1;
	}}""" if not armed else f"""
	if (!kp_disarmed) {{{hit}
		if ({pre}(&{k}, regs)) {{
			kp_leave(g);
			return 1;
		}}
	}}""")
            elif armed:
                calls.append(f"\n\tif (!kp_disarmed) {{{hit}" + (f"\n\t\t{pre}(&{k}, regs);" if pre else "") + "\n\t}")
            elif pre:
                calls.append(f"\n\t{pre}(&{k}, regs);")
            if post:
                posts.append(f"\n\tif (!kp_disarmed)\n\t\t{post}(&{k}, regs, 0);")
        out.append(f"""
__attribute__((used)) int kp_dispatch_{i}(struct pt_regs *regs)
{{
	int g = kp_enter();

	if (g < 0) {{{"".join(missed)}
		return 0;
	}}{"".join(fill)}{"".join(calls)}
	kp_leave(g);
	return 0;
}}
""")
        if posts:
            out.append(f"""
__attribute__((used)) void kp_post_dispatch_{i}(struct pt_regs *regs)
{{
	int g = kp_enter();

	if (g < 0)
		return;{"".join(posts)}
	kp_leave(g);
}}
""")
    n, nk = len(index.rows), len(krets)
    out[1] = (index.slots() + f"#define KP_NKPROBES {n}\n"
              f"struct kprobe kp_kprobes[{max(n, 1)}];\n"
              f"struct kretprobe kp_kretprobes[{max(nk, 1)}];\n"
              "/* The hits of kp_kprobes[] then kp_kretprobes[], laid out as struct kp_thread. */\n"
              "struct {\n\tunsigned long key;\n\tvoid *next;\n\tunsigned int active, pad;\n\tvoid *kret;\n"
              f"\tunsigned long hits[{max(n + nk, 1)}];\n}} kp_hit_block;\n")
    return "".join(out)


def events_c(evs) -> str:
    """The trace events' side in the Image (evs: ImageLayout.events): kp_rt_trace[], a pointer
    per event in the data kept after boot, 0 until the runtime placed at boot has registered
    the events and publishes its handler there (runtime.py: kp_rt_events()); and per event the
    handler the dispatch calls in the user's place (kp_ev_<slot>): the event's handler through
    the pointer, then the user's.  A hit before the runtime is placed writes no event (there is
    no trace_event_call yet) and counts in kp_rt_trace_early, which the runtime reports in the
    kernel log when it is placed; the kernel has no such count (its events cannot exist before
    the initcalls)."""
    out = [f"void *kp_rt_trace[{max(len(evs), 1)}];\nunsigned long kp_rt_trace_early;\n"]
    for slot, _key, ret, user in evs:
        args = "struct kretprobe_instance *ri, struct pt_regs *regs" if ret else "struct kprobe *p, struct pt_regs *regs"
        call = "ri, regs" if ret else "p, regs"
        if user:
            out.append(f"int {user}({args});\n")
        out.append(f"""
__attribute__((used)) int kp_ev_{slot}({args})
{{
	int (*ev)({args}) = __atomic_load_n(&kp_rt_trace[{slot}], __ATOMIC_ACQUIRE);

	if (ev)
		ev({call});
	else
		__atomic_fetch_add(&kp_rt_trace_early, 1, __ATOMIC_RELAXED);
	return {f"{user}({call})" if user else "0"};
}}
""")
    return "".join(out)


def _text_room(img) -> tuple[int, int]:
    """[start, end) of the zero padding at the end of [_stext, _etext), 256-byte aligned."""
    end = img.syms["_etext"]
    o = end - img.text - 1
    while o >= 0 and img.data[o] == 0:
        o -= 1
    start = (img.text + o + 1 + 0x40 + 0xFF) & ~0xFF
    return start, end


def _free_initmem(img, view) -> tuple[int, int]:
    """(address of free_initmem()'s `adrp x20, __init_end`, __init_end), read from its code:
    x19 = __init_begin (_sinittext), x20 = the end of the init memory it frees."""
    import capstone
    a = img.syms.get("free_initmem")
    if a is None:
        raise KprewriteError(f"{img.path}: no free_initmem in kallsyms: cannot keep the probes' data")
    code = view.read(a, 0x100)
    cs = capstone.Cs(capstone.CS_ARCH_ARM64, capstone.CS_MODE_ARM)
    pages = {}
    for x in cs.disasm(code, a):
        if x.mnemonic == "adrp":
            rd, imm = x.op_str.split(", #")
            pages[rd] = (x.address, int(imm, 16))
        if x.mnemonic in ("ret", "bl"):
            break
    if "x19" not in pages or "x20" not in pages or pages["x19"][1] != img.syms["_sinittext"] \
            or pages["x20"][1] & 0xFFFF:
        raise KprewriteError(f"{img.path}: free_initmem() is not `adrp x19, __init_begin; adrp x20, __init_end` "
                             f"as kprewrite knows it: cannot keep the probes' data")
    return pages["x20"]


def _check_relocs(objs, path):
    from ....elf.view import SHT_RELA, ElfView, relas
    for o in objs:
        e = ElfView(Path(o).read_bytes(), str(o))
        for sec in e.sections:
            if sec.type != SHT_RELA or sec.info >= len(e.sections):
                continue
            target = e.sections[sec.info].name
            if not target.startswith((".text", ".rodata", ".data", ".bss")):
                continue
            for _off, _sym, typ, _addend in relas(e.data, sec.offset, sec.size):
                if typ not in PC_RELATIVE_RELOCS:
                    t = ABSOLUTE_RELOCS.get(typ, f"relocation type {typ}")
                    raise KprewriteError(f"{path}: {Path(o).name} has an absolute relocation ({t}) in {target}: "
                                         "an arm64 image's probes are PC-relative only (KASLR would leave it "
                                         "stale; e.g. a static initializer holding an address)")


# The Image's back half: the steps of pipeline.build() (targets.base.Target's lay_out, tables,
# link, emit, write) answered for an arm64 Image, whose new code and data the link itself
# places in the Image's own room (two links: the first measures, the second is placed).  No
# runtime of link/runtime.py's (runtime_variant() False): the runtime's part an Image has is
# compiled and linked per rewrite, its glue holding the probes' rows (runtime.py).


@dataclass
class ImageLayout:
    """The sites as the detours take them, one detour or break each: the plan's, the hook
    probes of ours added (_with_hook_probe()), an entry taken past its ftrace NOPs (_Moved), with
    their probes' handlers ((probe, pre, post)); the kretprobes' handlers, the glob probes'
    ftrace_ops groups (_ftrace_ops_groups()) and each site's flags as the debugfs list shows
    them.  Where the code and data go is the link's (link(): the text padding, the init-data
    tail), so nothing has an address yet."""
    sites: list                         # [(site, [(probe, pre_handler, post_handler)])]
    krets: list                         # [(k, probe, handler, entry_handler)]
    ops: tuple | None
    site_flags: list
    events: list = None                 # [(slot, trace key, is_return, the user's handler)]: events_c()

    def detour(self, site) -> int:
        """The address `list` shows for a site's detour: none here (meta.py; an Image is
        written without the metadata)."""
        return 0


@dataclass
class ImageTables:
    """The generated sources: kp_detours.S (the detours and out-of-line copies, the kretprobe
    trampoline; HOLES where the runtime's holes go once its layout is known) and kp_dispatch.c
    (the struct kprobes, dispatchers, break hooks, kretprobes and ftrace_ops; the runtime's
    loader added by link()), and the probes' slots (ProbeIndex) the runtime's glue lists."""
    asm: str
    c: str
    index: ProbeIndex


@dataclass
class ImageBlob:
    """The linked detours, dispatch and handlers, as placed: (address, bytes) of the text
    (the text padding), the data kept after boot and the boot-only data (the runtime's bytes
    and relocations in its holes), their symbols; the rooms write() checks and patches."""
    text: tuple
    data: tuple
    initdata: tuple
    addrs: dict
    rela_lo: int                        # the start of .rela.dyn (its entries' grid)
    data_lo: int                        # where the data kept after boot starts
    adrp_at: int                        # free_initmem()'s `adrp x20, __init_end`


HOLES = "@HOLES@"


def lay_out(s, code) -> ImageLayout:
    """targets.base.Target.lay_out() for an arm64 Image: its sites and probes (ImageLayout)."""
    image, plan = s.image, s.plan
    img = image.container
    sites = []
    plan_sites = [site for site in plan.sites if not site.ftrace_ops]
    ops = _ftrace_ops_groups(s, img, [site for site in plan.sites if site.ftrace_ops])
    if ops:
        plan_sites = _with_hook_probe(s, plan_sites, OPS_HOOK_FUNCTION, "kp_ftrace_ops_register", first=True)
    # kprewrite.enabled=0 on the command line (kp_cmdline()), read as setup_arch() parses it.
    plan_sites = _with_hook_probe(s, plan_sites, CMDLINE_HOOK_FUNCTION, "kp_cmdline", first=True)
    if any(site.decision == BREAKPOINT for site in plan_sites):
        plan_sites = _with_hook_probe(s, plan_sites, HOOK_FUNCTION, "kp_brk_register", first=True)
    if plan.kretprobes:
        plan_sites = _with_hook_probe(s, plan_sites, EXIT_HOOK_FUNCTION, "kp_kret_flush_task", first=False)
    # The runtime placed at boot, and its debugfs files (runtime.py: kp_rt_load()).
    plan_sites = _with_hook_probe(s, plan_sites, rt.LOAD_HOOK_FUNCTION, "kp_rt_load", first=True)
    krets, evs = [], []

    def traced(p, user):
        """The handler the dispatch calls for p: its event's (events_c()) when it has one."""
        key = trace_key(p)
        if key not in s.traces:
            return user
        evs.append((len(evs), key, s.traces[key].is_return, user))
        return f"kp_ev_{len(evs) - 1}"
    for k, (_site, p, _group) in enumerate(plan.kretprobes):
        krets.append((k, p, traced(p, s.handler_symbols[p.kret.handler] if p.kret.handler else None),
                      s.handler_symbols[p.kret.entry_handler] if p.kret.entry_handler else None))
    site_flags = []                     # each site's KPROBE_FLAG_* as the debugfs list shows it
    for site in plan_sites:
        site_flags.append({FTRACE: KPROBE_FLAG_FTRACE, OPTIMIZED: KPROBE_FLAG_OPTIMIZED}.get(site.decision, 0))
        if site.decision == FTRACE:     # the jump past the ftrace NOPs (planner: Site.jump_at)
            site = _Moved(site, site.dcr[1:]) if getattr(site, "jump_at", 0) else _past_ftrace_nops(s, site)
        if site.decision not in (OPTIMIZED, BREAKPOINT):
            raise KprewriteError(f"{image.path}: {site.addr:#x}: not written on arm64 yet "
                                 f"(this one: {site.decision})")
        if site.head is not None or site.riders or site.slot or site.evicted:
            raise KprewriteError(f"{image.path}: {site.addr:#x}: a region shared between sites is not written "
                                 "on arm64 yet")
        probes = []
        for p in site.probes:
            if is_entry(p):             # a kretprobe's entry (kretprobe_c())
                probes.append((p, None, None))
                continue
            if p.spec.post_handler and any(insn.info.kind in I.BRANCHES for insn in site.dcr):
                raise KprewriteError(f"{image.path}: {p.symbol}+{p.offset:#x}: a post_handler after a branch "
                                     "is not written on arm64 yet")
            if getattr(p, "hook", None):
                probes.append((p, p.hook, None))
                continue
            probes.append((p, traced(p, s.handler_symbols[p.spec.pre_handler] if p.spec.pre_handler else None),
                           s.handler_symbols[p.spec.post_handler] if p.spec.post_handler else None))
        sites.append((site, probes))
    return ImageLayout(sites, krets, ops, site_flags, evs)


def tables(s, code, lay: ImageLayout) -> ImageTables:
    """targets.base.Target.tables() for an arm64 Image: the detours' assembly and the dispatch's
    C (ImageTables)."""
    sites, krets = lay.sites, lay.krets
    asm = "".join((xol_asm if site.decision == BREAKPOINT else detour_asm)(i, any(post for _, _, post in probes))
                  for i, (site, probes) in enumerate(sites)) + (trampoline_asm() if krets else "") + HOLES
    brk = [(i, any(post for _, _, post in probes)) for i, (site, probes) in enumerate(sites) if site.decision == BREAKPOINT]
    index = ProbeIndex()
    dispatch = (dispatch_c(sites, [isinstance(site, _Moved) or site.decision == BREAKPOINT for site, _ in sites], krets,
                           lay.ops, index, lay.site_flags) + (brk_c(brk) if brk else "") + events_c(lay.events or []))
    return ImageTables(asm, dispatch, index)


def runtime_variant(s, lay) -> bool:
    """targets.base.Target.runtime_variant() for an arm64 Image: False, no runtime of
    link/runtime.py's: the part of the runtime an Image has is compiled and linked by link()
    (runtime.py), its glue holding this rewrite's probes."""
    return False


def link(s, lay: ImageLayout, table: ImageTables, runtime: list, objs: list[Path], workdir: Path, cc: str):
    """targets.base.Target.link() for an arm64 Image: the runtime's blob compiled and linked
    (its layout decides the loader's C and the holes), the generated sources compiled, and
    the detours, dispatch and handlers linked twice: once to measure them, then placed in the
    text padding and the init-data tail (ImageBlob), the runtime's final link in its holes;
    done here (link.blob.Linked)."""
    from ....link.blob import Linked
    image, arch, sites = s.image, s.arch, lay.sites
    img = image.container
    ld = cc[:-3] + "ld" if cc.endswith("gcc") else "ld"
    (workdir / "kp_detours.S").write_text(table.asm)
    blob_objs, blob_syms, blob = _runtime_blob(s, img, workdir, cc, table.index, lay.krets, lay.events)
    (workdir / "kp_dispatch.c").write_text(table.c + rt.loader_c(blob.layout(), img.text))
    detours = workdir / "kp_detours.S"
    detours.write_text(detours.read_text().replace(HOLES, rt.holes_asm(blob.layout())))
    flags = [*cflags(arch, "linux_kernel"), *_includes(arch, "linux_kernel")]
    run([cc, *flags, "-c", str(workdir / "kp_dispatch.c"), "-o", str(workdir / "kp_dispatch.o")], "kp_dispatch.c")
    run([cc, "-c", str(workdir / "kp_detours.S"), "-o", str(workdir / "kp_detours.o")], "kp_detours.S")
    inputs = [workdir / "kp_detours.o", workdir / "kp_dispatch.o", *objs]
    _check_relocs(inputs, image.path)
    text_lo, text_hi = _text_room(img)
    adrp_at, init_end = _free_initmem(img, image)
    # The data: whole pages at the end of the init data, in zero file bytes after the
    # R_AARCH64_RELATIVE entries.
    rela_lo, rela_hi = img.text + img.rela_span[0], img.text + img.rela_span[1]
    # (The unused entries: zeros after the R_AARCH64_RELATIVE run, before the few other entries.)
    zeros_from, zeros_to = (rela_hi + PAGE - 1) & ~(PAGE - 1), rela_hi
    while zeros_to < init_end and img.data[zeros_to - img.text] == 0:
        zeros_to += 1
    # Symbols: each site and its resume address; every undefined name from kallsyms.
    syms = link_symbols(image)
    defs = {"kp_ops_anchor": img.text} if lay.ops else {}
    defs["kp_rt_text"] = img.text
    for i, (site, probes) in enumerate(sites):
        p = probes[0][0]
        defs[f"kp_site_{i}"] = p.addr                         # what regs->pc and p->addr say
        defs[f"kp_resume_{i}"] = site.region_end if site.decision != BREAKPOINT else site.addr + 4
        # regs->pc for the post_handler: after the probed instruction (the first NOP for an entry)
        if site.decision != BREAKPOINT:
            defs[f"kp_post_pc_{i}"] = site.region_end if site.addr == p.addr else p.addr + 4
    r = run([cc[:-3] + "nm" if cc.endswith("gcc") else "nm", *map(str, inputs)], "nm")
    undefined, defined = set(), set()
    for line in r.stdout.splitlines():
        f = line.split()
        if len(f) >= 2 and f[-2] == "U":
            undefined.add(f[-1])
        elif len(f) == 3:
            defined.add(f[-1])
    for name in sorted(undefined - defined):
        if name in defs:
            continue
        kname = KERNEL_NAMES.get(name, name)
        a = syms.get(kname)
        if a is None:
            raise KprewriteError(f"{image.path}: the handlers call {name}, which kallsyms does not name "
                                 f"(or names more than once)")
        defs[name] = a

    def link_at(data_at: int, init_at: int) -> Path:
        lds = workdir / "kp.lds"
        lds.write_text(f"""SECTIONS {{
  . = {text_lo:#x};
  .text : {{ *(.text .text.* .kprobes.text) *(.rodata .rodata.* .srodata*) }}
  . = {init_at:#x};
  .kp_initdata : {{ *(.kp_initdata) }}
  . = {data_at:#x};
  .data : {{ *(.data .data.*) *(.bss .bss.* COMMON) }}
  .kp_must_be_empty : {{ *(.iplt) *(.igot.plt) *(.got) *(.got.plt) *(.rela.*) }}
  /DISCARD/ : {{ *(.comment) *(.note*) *(.eh_frame*) *(.debug*) }}
}}
""")
        out = workdir / "kp_blob.elf"
        # Every section placed by the script, none left for ld to put elsewhere (--orphan-handling).
        run([ld, "-nostdlib", "--fix-cortex-a53-843419", "--orphan-handling=error", "-T", str(lds), "-o", str(out),
             *(f"--defsym={n}={a:#x}" for n, a in sorted(defs.items())), *map(str, inputs)], "link")
        return out

    # (Measured with the boot-only data out of the way: it may be larger than its room.)
    elf = link_at(zeros_to, zeros_to + BLOCK)
    text, data, addrs, initdata = _read_blob(elf)
    # The data kept after boot: whole 64 KiB (contiguous-hint) chunks above the last 2 MiB
    # boundary below __init_end.  free_initmem()'s vunmap_range() clears a whole block
    # mapping it touches (pmd_clear_huge()), and the init data's 2 MiB-aligned middle may be
    # one: data below that boundary would go with it.  Boot-only data (.kp_initdata: read up
    # to the registration of the glob probes) goes below, and is freed with the init memory.
    floor = init_end & ~(BLOCK - 1)
    data_lo = (zeros_to - max(len(data[1]), 1)) & ~(CONT - 1)
    if data_lo < max(floor, zeros_from):
        raise KprewriteError(f"{image.path}: the probes need {len(data[1])} bytes of data; the room kept after "
                             f"boot (the unused entries of .rela.dyn after the last 2 MiB boundary of the init "
                             f"data, from a 64 KiB boundary) has "
                             f"{max(zeros_to - max(floor, (zeros_from + CONT - 1) & ~(CONT - 1)), 0)}")
    if zeros_from + len(initdata[1]) > data_lo:
        raise KprewriteError(f"{image.path}: the runtime placed at boot needs {_boot_bytes(blob)} bytes of boot-only "
                             f"data (with its relocations), {len(initdata[1])} in all with the glob probes' sites; "
                             f"the unused entries of .rela.dyn below the probes' data have {data_lo - zeros_from}")
    if text[0] + len(text[1]) > text_hi:
        raise KprewriteError(f"{image.path}: the probes need {len(text[1])} bytes of code; the text padding "
                             f"has {text_hi - text_lo} (before _etext {text_hi:#x})")
    elf = link_at(data_lo, zeros_from)
    text, data, addrs, initdata = _read_blob(elf)
    initdata = _fill_runtime(s, img, workdir, cc, blob_objs, blob_syms, blob, addrs, initdata)
    return Linked(ImageBlob(text, data, initdata, addrs, rela_lo, data_lo, adrp_at))


def unlinked(s, code, lay) -> None:
    """targets.base.Target.unlinked() for an arm64 Image: nothing (emit() needs the link's
    addresses for all it writes)."""
    return None


def emit(s, code, lay: ImageLayout, blob: ImageBlob, unlinked) -> tuple[bytearray, list]:
    """targets.base.Target.emit() for an arm64 Image: the linked text with each displaced
    instruction relocated into its detour (or out-of-line copy), and the patches: a `B` to the
    detour (or `brk #BRK_IMM`) at each site, free_initmem()'s `adrp x20` pointed at the data
    kept after boot ([(address, bytes)])."""
    path, text, addrs = s.image.path, blob.text, blob.addrs
    code = bytearray(text[1])
    for i, (site, _) in enumerate(lay.sites):
        at = addrs[f"kp_xol_{i}" if site.decision == BREAKPOINT else f"kp_dcr_{i}"]
        moved = b""
        for insn in ([site.xol.insn] if site.decision == BREAKPOINT else site.dcr):
            moved += E.relocate(insn, at + len(moved))
        if len(moved) > DCR_ROOM:
            raise KprewriteError(f"{path}: {site.addr:#x}: the displaced instructions need {len(moved)} bytes")
        off = at - text[0]
        code[off:off + len(moved)] = moved
    patches = [(site.addr, enc.brk(BRK_IMM) if site.decision == BREAKPOINT else enc.b(site.addr, addrs[f"kp_detour_{i}"]))
               for i, (site, _) in enumerate(lay.sites)]
    # free_initmem() frees the init memory up to our data, no further.
    patches.append((blob.adrp_at, enc.adrp(blob.adrp_at, 20, blob.data_lo)))
    return code, patches


def write(image, arch, layout, rx: bytearray, patches, blob: ImageBlob, metadata: bytes, plan, early=None) -> bytes:
    """targets.base.Target.write() for an arm64 Image: the text (rx), the data (checked: no
    unused .rela.dyn entry may read as R_AARCH64_RELATIVE) and the patches put into the Image's
    bytes (an ELF vmlinux in, an ELF out: the text padding's code gets a section).  No metadata:
    `list` reads the running kernel's debugfs instead."""
    img = image.container
    out = bytearray(img.data)

    def put(addr: int, b: bytes):
        off = addr - img.text
        if not 0 <= off <= len(out) - len(b):
            raise KprewriteError(f"{image.path}: {addr:#x} is not in the Image's bytes")
        out[off:off + len(b)] = b

    text, rela_lo = blob.text, blob.rela_lo
    put(text[0], bytes(rx))
    for part in (blob.data, blob.initdata):
        if not any(part[1]):
            continue
        for ent in range((part[0] - rela_lo) // 24, (part[0] + len(part[1]) - rela_lo) // 24 + 1):
            a = rela_lo + 24 * ent + 8
            if part[0] <= a and a + 4 <= part[0] + len(part[1]):
                if struct.unpack_from("<I", part[1], a - part[0])[0] == R_AARCH64_RELATIVE:
                    raise KprewriteError(f"{image.path}: the probes' data at {a:#x} would read as a relocation at boot")
        put(part[0], part[1])
    for addr, b in patches:
        put(addr, b)
    if img.elf is None:
        return bytes(out)
    # ELF in, ELF out: the code in the text padding (between the ELF's sections) gets a section.
    return img.elf.write(bytes(out), [(".kprewrite.text", text[0], len(text[1]))] if text[1] else [])


# The detours' data the runtime's glue reads (runtime.glue_c()), by name.
RUNTIME_DATA = ("kp_kprobes", "kp_kretprobes", "kp_hit_block", "kp_disarmed", "kp_rt_text", "kp_rt_trace",
                "kp_rt_trace_early")


# What the events' runtime needs of the kernel's types: the task's cpu (THREAD_INFO_IN_TASK:
# task_struct.thread_info.cpu; the blob names no cpu_number: kp_arch_platform.h) and where
# dyn_event_operations has its create (kp_trace_buffer.c: trace_add_event_call() under
# dyn_event_create()'s event_mutex).
EVENTS_LAYOUT = (("task_struct", "thread_info"), ("thread_info", "cpu"), ("dyn_event_operations", "create"))


def _events(s, evs):
    """runtime.Events for the blob: the events' C (events.trace_c(), no user handler: the
    dispatch calls the user's after the event's, events_c()) and the kernel's facts (BTF)."""
    from ....probes.events import trace_c
    from ..btf import layout
    from ..generated_c import _types
    kt = _types(s.image)
    if kt is None or not kt.trace or kt.comm is None or kt.pid is None:
        raise KprewriteError(f"{s.image.path}: trace events need the kernel's types (task_struct, the tracing "
                             "structures) from the image's BTF, which lacks them")
    info, cpu, create = layout(s.image, EVENTS_LAYOUT, "trace events")
    keys = {key for _slot, key, _ret, _user in evs}
    return rt.Events(trace_c({k: v for k, v in s.traces.items() if k in keys}, {}, []),
                     [(slot, key, ret) for slot, key, ret, _user in evs], (kt.comm, kt.pid, info + cpu), kt.trace, create)


def _runtime_blob(s, img, workdir, cc, index, krets, evs=()):
    """The runtime's objects (runtime.compile_blob()), the symbols they need ({name: (address,
    is a function)}: kernel symbols from kallsyms, the detours' data a placeholder until the
    Image's link), and its first link: its size and layout, for the loader's C."""
    from ..btf import layout
    from ..symbols import link_symbols
    image = s.image
    try:
        fops = layout(image, FOPS_LAYOUT, "the debugfs files")
    except KprewriteError:
        fops = [-1] * 4             # no BTF: no debugfs files (kp_kernel_debugfs() says so)
    kret_rows = [(p.addr, p.symbol, p.offset, p.event_name, KPROBE_FLAG_FTRACE) for _k, p, _h, _e in krets]
    events = _events(s, evs) if evs else None
    objs = rt.compile_blob(cc, s.arch, workdir, rt.glue_c(index.rows, kret_rows, fops, img.text, events), events)
    ksyms = link_symbols(image)
    types = {k.name: k.type for k in image.kernel_symbols}
    syms = {}
    for name in rt.undefined(cc, objs):
        if name in RUNTIME_DATA:
            syms[name] = (img.text, False)
            continue
        a = ksyms.get(KERNEL_NAMES.get(name, name))
        if a is None:               # only code the link leaves out may use it (--gc-sections)
            continue
        syms[name] = (a, types.get(KERNEL_NAMES.get(name, name), "t") in "tTwW")
    return objs, syms, _link_runtime(cc, objs, workdir, syms, image.path, img.text - rt.LINK_BELOW)


def _link_runtime(cc, objs, workdir, syms, path, base):
    return rt.link_blob(cc, objs, workdir, {n: a for n, (a, f) in syms.items() if f},
                        {n: a for n, (a, f) in syms.items() if not f}, path, base)


FOPS_LAYOUT = (("file_operations", None), ("file_operations", "llseek"), ("file_operations", "read"),
               ("file_operations", "write"))


def _boot_bytes(blob) -> int:
    return len(blob.data) + 4 * (len(blob.rel_blob) + len(blob.rel_image)) + 12 * len(blob.adrp)


def _fill_runtime(s, img, workdir, cc, objs, syms, blob, addrs, initdata):
    """The runtime linked again with the detours' data where the Image's link put it (the
    same layout: the loader was compiled for it), its bytes and relocations written into the
    loader's holes in the boot-only data."""
    syms = {n: ((addrs[n], f) if n in RUNTIME_DATA and n != "kp_rt_text" else (a, f)) for n, (a, f) in syms.items()}
    final = _link_runtime(cc, objs, workdir, syms, s.image.path, blob.base)
    if final.layout() != blob.layout():
        raise KprewriteError(f"{s.image.path}: the runtime's second link differs from its first")
    at, b = initdata[0], bytearray(initdata[1])

    def hole(name: str, data: bytes):
        off = addrs[name] - at
        if not 0 <= off <= len(b) - len(data):
            raise KprewriteError(f"{s.image.path}: {name} is not in the boot-only data")
        b[off:off + len(data)] = data
    hole("kp_rt_blob", final.data)
    hole("kp_rt_rel_blob", struct.pack(f"<{len(final.rel_blob)}I", *final.rel_blob))
    hole("kp_rt_rel_image", struct.pack(f"<{len(final.rel_image)}I", *final.rel_image))
    hole("kp_rt_adrp_at", struct.pack(f"<{len(final.adrp)}I", *(o for o, _ in final.adrp)))
    hole("kp_rt_adrp_to", struct.pack(f"<{len(final.adrp)}Q", *(t for _, t in final.adrp)))
    return at, bytes(b)


class _Moved:
    """A site taken past a function's ftrace NOPs: the jump and the displaced instruction at
    entry + 8, the probe's address (regs->pc, p->addr) still the entry."""
    def __init__(self, site, dcr):
        self.addr, self.dcr, self.probes, self.decision = site.jump_at, dcr, site.probes, OPTIMIZED
        self.head, self.riders, self.slot, self.evicted = None, [], 0, None
        self.region_end = dcr[-1].addr + len(dcr[-1].code)


def _past_ftrace_nops(s, site):
    """The breakpoint hook's own site (_with_hook_probe(), added here, after planning),
    placed as the planner places a probe's entry (planner.sites.share_ftrace_site()).
    A probe on a function's entry: the kernel's kprobe sits on the first ftrace NOP, which
    ftrace_init_nop() rewrites at boot and ftrace patches (the second) when tracing; the jump
    goes after both instead (the instruction at entry + 8, usually paciasp), so that ftrace and
    the kernel's own kprobes keep working on the function.  The NOPs run before the handler as
    they would before the kernel's single-step: the same state (unless the function is traced:
    then its tracer has run first, and x9 holds x30)."""
    from ....planner.sites import share_ftrace_site
    func = site.probes[0].func
    at = site.addr + s.rules.share_ftrace
    if any(o.addr == at for o in s.plan.sites):
        raise KprewriteError(f"{s.image.path}: {func.name}: a probe on its entry and one at {at:#x}: "
                             "both would take the jump after the ftrace NOPs")
    site.dcr, site.jump_at, site.reason = [s.arch.ftrace_site_insn(site.addr)], 0, None
    share_ftrace_site(s.image, s.analysis, s.arch, site, s.rules)
    if not site.jump_at:
        raise KprewriteError(f"{s.image.path}: {func.name}: its entry is taken past the ftrace NOPs, at {at:#x}, "
                             f"which cannot take a jump: {site.reason}")
    return _Moved(site, site.dcr[1:])


def _ftrace_ops_groups(s, img, ops_sites):
    """ftrace_ops_c()'s arguments for the sites reached through ftrace: their ftrace records
    (entry + 4) as offsets from the image's start, grouped by their probes' handlers; None
    when there are none."""
    if not ops_sites:
        return None
    from ..btf import layout
    groups: dict[tuple, list[int]] = {}
    labels: dict[tuple, list] = {}
    for site in ops_sites:
        key = tuple((s.handler_symbols[p.spec.pre_handler] if p.spec.pre_handler else None,
                     s.handler_symbols[p.spec.post_handler] if p.spec.post_handler else None) for p in site.probes)
        groups.setdefault(key, []).append(site.addr + 4 - img.text)
        # What the debugfs views say of each of the group's struct kprobes: its glob, and the
        # spec's name or the kernel's default name made from the glob.
        labels.setdefault(key, [(p.spec.symbol_name, p.spec.name or f"p_{event_symbol(p.spec.symbol_name)}_0",
                                 p.index) for p in site.probes])
    return ([(sorted(rows), list(key), labels[key]) for key, rows in groups.items()],
            layout(s.image, FTRACE_OPS_LAYOUT, "probes from a glob (an ftrace_ops)"))


def _with_hook_probe(s, sites, function: str, hook_name: str, first: bool):
    """The sites with a hook probe of ours added on function's entry (a site of its own, or a
    probe beside the user's there): kp_brk_register() first on HOOK_FUNCTION's,
    kp_kret_flush_task() last on EXIT_HOOK_FUNCTION's (after a kretprobe there has claimed
    the instance it frees)."""
    from types import SimpleNamespace
    f = next((f for f in s.image.functions if f.name == function), None)
    if f is None:
        raise KprewriteError(f"{s.image.path}: no {function} in kallsyms: {hook_name}() needs its entry")
    hook = SimpleNamespace(symbol=function, offset=0, addr=f.start, func=f, hook=hook_name,
                           spec=SimpleNamespace(pre_handler=None, post_handler=None))
    for site in sites:
        if site.addr == f.start and site.decision == FTRACE and not site.ftrace_ops:
            site.probes.insert(0 if first else len(site.probes), hook)
            return sites
    if f.start not in s.rules.ftrace:
        raise KprewriteError(f"{s.image.path}: {function}'s entry cannot take the jump that calls {hook_name}()")
    return [SimpleNamespace(addr=f.start, probes=[hook], decision=FTRACE, ftrace_ops=False, head=None, riders=[],
                            slot=0, evicted=None, dcr=None, with_post=False)] + list(sites)


def _read_blob(elf: Path):
    """((.text address, bytes), (.data address, bytes, bss zeros included), symbols,
    (.kp_initdata address, bytes))."""
    from ....elf.view import SHT_NOBITS, ElfView
    e = ElfView(Path(elf).read_bytes(), str(elf))
    extra = e.section(".kp_must_be_empty")
    if extra is not None and extra.size:
        raise KprewriteError(f"{elf}: the link made {extra.size} bytes of GOT, PLT or dynamic relocations: "
                             "an arm64 image's probes are PC-relative only")
    t = e.section(".text")
    text = (t.addr, e.section_bytes(t)) if t is not None else (0, b"")

    def data_of(name):
        d = e.section(name)
        if d is None:
            return (0, b"")
        return (d.addr, bytes(d.size) if d.type == SHT_NOBITS else e.section_bytes(d))
    addrs = {s.name: s.value for s in e.symbols() if s.name}
    return text, data_of(".data"), addrs, data_of(".kp_initdata")
