"""Linux kernel images: a vmlinux, with or without .symtab.

Symbols come from .symtab when the image has one, else from a System.map
(--system-map), else from the image's own kallsyms tables (kallsyms.py); a
function ends where the next symbol starts, as kallsyms_lookup_size_offset()
does.  The rules are the kernel's own (sites.py reads the tables):
registration refuses the kprobe blacklist (_kprobe_blacklist, .kprobes.text,
.noinstr.text, .entry.text), __cfi_/__pfx_ symbols, jump labels, static calls,
BUG sites, alternatives and the inside of ftrace sites; a detoured region must
not overlap any site the kernel patches at boot; a function with an
exception-table entry, or an indirect jump (a jmp through a retpoline thunk
included), is not jump-optimized.  A function entry with an ftrace site
(__mcount_loc) is probed there, as KPROBE_FLAG_FTRACE does.
"""
from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass

from ...arch.base import ThreadKey
from ...blacklist import BlacklistEntry, Index
from ...elfwrite import NewSection, append_section_headers
from ...errors import KprewriteError
from ...planner import INT3
from ...report import META_SECTION
from ...spec import KprobeSpec
from ...rules import Rules
from . import btf, bzimage_write, kaslr, sites as ks
from .kaslr import address_c  # noqa: F401  (tables.py: an address in the image, relocated with KASLR)
from .elfview import ElfView
from .kallsyms import functions as kallsyms_functions, read_kallsyms
from .sysmap import read_system_map

name = "linux_kernel"
KERNEL_HALF = 1 << 63
PT_LOAD = 1

# Registration refusals (check_kprobe_address_safe(), arch_prepare_kprobe()), by table.
REGISTER_REASONS = {
    "_kprobe_blacklist": "NOKPROBE_SYMBOL",
    ".kprobes.text": "in .kprobes.text (__kprobes)",
    ".noinstr.text": "in .noinstr.text (noinstr)",
    ".entry.text": "in .entry.text (entry code)",
    ".static_call.text": "static call trampoline (static_call_text_reserved)",
    "__cfi_/__pfx_": "CFI/padding symbol",
    ".head.text": "in .head.text (runs before per-CPU setup, on the early identity mapping)",
    "__jump_table": "jump label site (jump_label_text_reserved)",
    ".static_call_sites": "static call site (static_call_text_reserved)",
    "__bug_table": "BUG/WARN site (find_bug)",
    ".altinstructions": "alternatives site (alternatives_text_reserved)",
}


def detect(image) -> bool:
    """A kernel image: an executable linked in the kernel half of the address space."""
    return image.e_type == 2 and any(s.type == PT_LOAD and s.vaddr >= KERNEL_HALF for s in image.segments)


def load_symbols(image, system_map: str | None = None) -> None:
    """Function symbols and bounds: .symtab as for any ELF, else System.map, else kallsyms."""
    if system_map is None and any(f.source == "symtab" for f in image.functions):
        return
    if system_map is not None:
        syms = read_system_map(system_map).require_symbols().symbols
        source = "System.map"
    else:
        syms = read_kallsyms(image.data, image.path).symbols
        source = "kallsyms"
    image.kernel_symbols = syms
    image.kernel_symbols_source = source
    image._link_symbols = None          # link_symbols() is made from these
    image.set_functions([(f.start, f.end, f.name) for f in kallsyms_functions(syms, ElfView(image.data, image.path))],
                        source)


def _kernel(image) -> ks.KernelImage:
    k = getattr(image, "_kernel_tables", None)
    if k is None:
        syms = getattr(image, "kernel_symbols", None)
        if syms is None:     # .symtab: the function symbols and the linker's table bounds
            syms = {n: a[0] for n, a in image.symbols.items()}
            syms.update({n: a for n, a in image.all_symbols().items() if n not in syms})
        k = image._kernel_tables = ks.KernelImage(image.data, syms, image.path)
    return k


def rules(image, arch) -> Rules:
    k = _kernel(image)
    reserved = ks.kernel_sites(image.data, None, image.path, image=k)
    mcount = {m.site: m for m in ks.mcount_locs(k)}
    register, patched = [], []
    # The kprobe blacklist is listed function by function (sites.kprobe_blacklist() adds the
    # functions of .kprobes.text, .noinstr.text and .entry.text), each with its section's reason.
    whole = {t: k.bounds(t) for t in (".kprobes.text", ".noinstr.text", ".entry.text")}
    for r in reserved:
        if r.table in whole:
            continue
        why = REGISTER_REASONS.get(r.table)
        if r.table == "_kprobe_blacklist":
            why = next((REGISTER_REASONS[t] for t, b in whole.items() if b and b[0] <= r.start < b[1]), why)
        if why is not None:
            sym = r.detail if r.table in ("_kprobe_blacklist", "__cfi_/__pfx_", ".head.text") else _symbol_at(image, r.start)
            register.append(BlacklistEntry(r.start, r.end, sym, why))
        if r.table == "__mcount_loc":
            # Inside an ftrace site, not at its start (arch_check_ftrace_location()).
            register.append(BlacklistEntry(r.start + 1, r.end, _symbol_at(image, r.start), "inside an ftrace site"))
        if r.table not in ("_kprobe_blacklist", ".kprobes.text", ".noinstr.text", ".entry.text", "__cfi_/__pfx_",
                           ".head.text"):
            patched.append(BlacklistEntry(r.start, r.end, r.detail or r.table, r.table))
    ex_insns = sorted(e.insn for e in ks.ex_table(k))
    thunks = ks.indirect_thunk_range(k)
    # A `jmp __x86_return_thunk` at a .return_sites entry is a return (patched at boot to
    # the chosen return sequence), not a jump through a retpoline thunk.
    returns = {r.start for r in reserved if r.table == ".return_sites"}

    def function_refusal(analysis, func):
        i = bisect.bisect_left(ex_insns, func.start)
        if i < len(ex_insns) and ex_insns[i] < func.end:
            return arch.Refusal("__ex_table", ex_insns[i], f"{func.name} has an exception table entry: "
                                "its fixup may jump back into the function")
        if thunks is not None:
            for target, src in analysis.decoded(func).branches:
                if thunks[0] <= target < thunks[1] and src not in returns and image.read(src, 1) != b"\xe8":
                    return arch.Refusal("indirect_jump", src, f"{func.name} jumps through a retpoline thunk "
                                        "(an indirect jump)")
        return None

    def ex_fixups(img, an):
        for e in ks.ex_table(k):
            yield e.fixup, f"exception fixup of {e.insn:#x}"

    def jump_label_targets(img, an):
        a, buf = k.table_bytes("__jump_table", 16)
        for i in range(0, len(buf), 16):
            code, target, _ = struct.unpack_from("<iiq", buf, i)
            yield a + i + 4 + target, f"jump label at {a + i + code:#x}"

    # Breakpoint probes need our hook on the kernel's int3 path (INT3_HOOK); single-stepped
    # copies end with an int3, as the kernel's own since 5.14 (its #DB path is not hooked).
    return Rules(Index(register), Index(patched), mcount, function_refusal, int3=int3_hook(image) is not None,
                 # kretprobes hook every exit (the user-space design; instances per task): a
                 # `jmp __x86_return_thunk` is a return, its .return_sites entry pointed at the
                 # copy in the detour (return_site_patches()); an exit no jump fits keeps the
                 # trampoline for its function (no breakpoint return hooks in a kernel).
                 kretprobes=True, kretprobe_exits=True, return_jumps=frozenset(returns),
                 kretprobe_int3_exits=False, kretprobe_clean_entry=True,
                 singlestep_int3=True,
                 fast_forms=False, jump_target_sources=[ex_fixups, jump_label_targets],
                 # A kernel is built with -fno-jump-tables and jumps through retpoline
                 # thunks; decoding its 46,000 functions again would cost half a minute.
                 read_indirect_jumps=False)


def _symbol_at(image, addr: int) -> str:
    f = image.function_at(addr)
    if f is None:
        return f"{addr:#x}"
    return f.name if f.start == addr else f"{f.name}+{addr - f.start:#x}"



# --- where new code and data go, and how the output is written -----------------------------
#
# The gap between the end of .text and .rodata (PFN_ALIGN(_etext) .. __start_rodata) is in
# the first PT_LOAD: loaded, mapped and executable from boot, zero-filled in the file.
# mark_rodata_ro() would make it read-only and NX, then free it; three boot hooks (runtime
# handlers on set_memory_ro(), set_memory_nx() and free_kernel_image_pages(), placed as any
# probe; runtime/platform/linux_kernel/platform.c) keep the pages we use: code read-only and
# executable like .text, data read-write (never made read-only: every hit writes it) and NX.
# A fourth, on setup_per_cpu_areas(), allocates every possible CPU's counters from memblock.
# The runtime's data (the probe tables, written at every hit) goes in the rodata/data gap
# (PFN_ALIGN(__end_rodata) .. _sdata), which mark_rodata_ro() frees the same way; the first
# PT_LOAD is extended over it, so that it is loaded (its file bytes are the padding before
# the second PT_LOAD's 2 MiB-aligned offset).
PAGE = 0x1000
# The boot hooks: (function, runtime pre_handler).
BOOT_HOOKS = (("setup_per_cpu_areas", "kp_kernel_alloc_cpus"),
              ("set_memory_ro", "kp_kernel_keep_ro"), ("set_memory_nx", "kp_kernel_keep_nx"),
              ("free_kernel_image_pages", "kp_kernel_keep_free"),
              # kprewrite.enabled=0 on the command line, read in setup_arch() (kp_debugfs.c);
              # the debugfs views, once initcalls are done, before /init (kp_debugfs.c).
              ("parse_early_param", "kp_kernel_cmdline"), ("console_on_rootfs", "kp_kernel_debugfs"))


@dataclass
class GapLayout:
    rx_vaddr: int             # the first byte we use: PFN_ALIGN(_etext)
    end: int                  # __start_rodata
    data_vaddr: int           # PFN_ALIGN(__end_rodata): the runtime's data
    data_end: int             # _sdata

    @property
    def after_phdrs(self) -> int:
        return self.rx_vaddr


def _symbol(image, name: str) -> int:
    syms = getattr(image, "kernel_symbols", None)
    if syms is not None:
        for s in syms:
            if s.name == name:
                return s.addr
    else:
        a = image.all_symbols().get(name)
        if a is not None:
            return a
    raise KprewriteError(f"{image.path}: no symbol {name}, so the text/rodata gap cannot be found")


def plan_layout(image) -> GapLayout:
    align = lambda a: (a + PAGE - 1) & ~(PAGE - 1)  # noqa: E731
    return GapLayout(align(_symbol(image, "_etext")), _symbol(image, "__start_rodata"),
                     align(_symbol(image, "__end_rodata")), _symbol(image, "_sdata"))


def thread_key(image) -> ThreadKey:
    """The runtime's "thread" in a kernel is the CPU (preemption off while handlers
    run, as the kernel's current_kprobe is per-CPU): its per-CPU offset."""
    resched = _resched(image)
    return ThreadKey("cpu", _symbol(image, "this_cpu_off"), _symbol(image, "__preempt_count"),
                     None if resched is None else link_symbols(image)[resched])


# What preempt_enable() calls on a pending reschedule: the static call PREEMPT_DYNAMIC
# patches at boot (preempt= none/voluntary: a return), else the thunk of a PREEMPT kernel;
# a kernel with neither never preempts kernel code.
RESCHED = ("__SCT__preempt_schedule", "preempt_schedule_thunk")


def _resched(image) -> str | None:
    syms = link_symbols(image)
    return next((n for n in RESCHED if syms.get(n)), None)


def reserve_stubs(image, pos: int) -> tuple[dict[str, int], int]:
    """No start-up stub: the runtime's tables are ready statically, the boot hooks are probes."""
    return {}, pos


# The int3 hook: a `call kp_kernel_int3_entry` on kprobe_int3_handler()'s ftrace site, which
# do_int3() calls first for every kernel-mode int3 (after text_poke_bp()'s): our breakpoint
# sites are handled there and it returns 1, any other int3 goes on into the kernel's
# kprobes, kgdb and notify_die().  Not a probe (runtime/platform/linux_kernel/kp_int3_hook.c
# says why a call on this NOKPROBE function is safe); its __mcount_loc entry is dropped as an
# ftrace-site probe's is.  Only written when the image has breakpoint sites.
INT3_HOOK = ("kprobe_int3_handler", "kp_kernel_int3_entry")


def int3_hook(image):
    """The ftrace site (a __mcount_loc entry) at kprobe_int3_handler()'s entry, or None
    (no such function or no ftrace site: this image gets no breakpoint probes)."""
    if not hasattr(image, "_int3_hook"):
        f = next((f for f in image.functions if f.name == INT3_HOOK[0]), None)
        image._int3_hook = None if f is None else \
            next((m for m in ks.mcount_locs(_kernel(image)) if m.site == f.start), None)
    return image._int3_hook


# do_int3()'s own calls of kprobe_int3_handler() (do_int3() and its copies inlined into
# exc_int3()) call the hook's C half instead, which returns to them itself: the ftrace
# site's call and the entry's jump saved at each trap.  The ftrace site stays hooked for
# any other caller; the C half goes on past it for an int3 not ours (kp_int3_hook.c).
INT3_CALLERS = ("do_int3", "exc_int3")
INT3_DIRECT = "kp_arch_int3_bp"


def _direct_calls(image, callers, callee: int | None) -> list[int]:
    """The `call callee` instructions in the functions named in `callers`
    (decoded, not scanned), sorted."""
    if callee is None:
        return []
    from ...arch import get_arch
    arch = get_arch(image.machine)
    out = []
    for g in (g for g in image.functions if g.name in callers):
        d = arch.decode_function(image.read(g.start, g.end - g.start), g.start)
        out += [src for target, src in d.branches if target == callee and image.read(src, 1) == b"\xe8"]
    return sorted(out)


def _call_patch(addr: int, target: int) -> tuple[int, bytes]:
    """A `call rel32` at addr sent to target."""
    return addr, b"\xe8" + struct.pack("<i", target - (addr + 5))


def int3_callers(image) -> list[int]:
    """The `call kprobe_int3_handler` instructions in INT3_CALLERS."""
    if not hasattr(image, "_int3_callers"):
        f = next((f for f in image.functions if f.name == INT3_HOOK[0]), None)
        image._int3_callers = _direct_calls(image, INT3_CALLERS, f.start if f is not None else None)
    return image._int3_callers


# The early #BP: until setup_arch()'s idt_setup_early_traps(), an int3 goes through the early
# IDT (head_64.S early_idt_handler_array -> early_idt_handler_common), whose
# do_early_exception() halts on it: a breakpoint site the kernel runs that early (the first
# printk()'s timestamp: sched_clock_cpu(), local_clock()) hung the boot.  Its `call
# do_early_exception` calls kp_kernel_early_exception(regs, trapnr) instead, which runs the
# probed instruction of an int3 of ours (no handlers: the tables do not exist yet, the hit
# counts in kp_early_hits) and passes every other exception on (kp_int3_hook.c).
EARLY_HOOK = ("early_idt_handler_common", "do_early_exception", "kp_kernel_early_exception")


def early_int3_callers(image) -> list[int]:
    """The `call do_early_exception` in early_idt_handler_common."""
    if not hasattr(image, "_early_int3_callers"):
        target = image.symbols.get(EARLY_HOOK[1])
        image._early_int3_callers = _direct_calls(image, (EARLY_HOOK[0],), target[0] if target else None)
    return image._early_int3_callers


def _int3_hook_patches(image, blob) -> list[tuple[int, bytes]]:
    m = int3_hook(image)
    entry, direct, early = blob.symbols[INT3_HOOK[1]], blob.symbols[INT3_DIRECT], blob.symbols[EARLY_HOOK[2]]
    return [_call_patch(m.site, entry)] + [_call_patch(a, direct) for a in int3_callers(image)] + \
        [_call_patch(a, early) for a in early_int3_callers(image)]


# The shutdown hooks: kprobe_profile (event, hits, nmissed) in the kernel log before power-off,
# restart or halt, the counters' last chance to be read (a kernel has no exit to write them at).
SHUTDOWN_HOOKS = (("kernel_power_off", "kp_kernel_profile"), ("kernel_restart", "kp_kernel_profile"),
                  ("kernel_halt", "kp_kernel_profile"))


# kprobe_flush_task(): with kretprobes, a task_struct being freed gives back the
# instances of frames it never returned from (kp_kretprobe_task.c).
KRET_HOOKS = (("free_task", "kp_kernel_kret_flush_task"),)


def runtime_probes(spec) -> None:
    """The boot and shutdown hooks: probes the runtime needs, added to the spec's kprobes."""
    for what, hooks in (("boot", BOOT_HOOKS), ("shutdown", SHUTDOWN_HOOKS),
                        ("kretprobe", KRET_HOOKS if spec.kretprobes else ())):
        for fn, handler in hooks:
            spec.kprobes.append(KprobeSpec(f"[kprewrite {what} hook {fn}]", fn, None, 0, handler, None, False,
                                           f"kprewrite_{fn}"))


RUNTIME_HANDLERS = frozenset(h for _, h in BOOT_HOOKS + SHUTDOWN_HOOKS + KRET_HOOKS)


# Per-CPU blocks (struct kp_thread and its hit counters) are taken on each CPU's first
# hit, never allocated in probe context: the boot CPU's first from a static block, every
# possible CPU's from memory the setup_per_cpu_areas() boot hook allocates (platform.c).
POOL_CPUS = 1


def tables_c(image, arch, any_int3: bool) -> str:
    """struct task_struct's comm and pid (BTF) and the current task, for trace lines; the
    tracing structures (BTF) our events' output types need; the
    gap's bounds (the boot hooks); the per-CPU blocks' pool, sized from the probe tables
    generated before this part."""
    lay = plan_layout(image)
    kt = _types(image)
    task = ("const long kp_kernel_task_comm = -1, kp_kernel_task_pid = -1;\n"
            "char *kp_kernel_current(void) { return 0; }\n") if kt is None else (
        f"const long kp_kernel_task_comm = {kt.comm if kt.comm is not None else -1}, "
        f"kp_kernel_task_pid = {kt.pid if kt.pid is not None else -1};\n"
        "char *kp_kernel_current(void)\n{\n\tchar *t;\n"
        f'\t__asm__("movq %%gs:{kt.current}, %0" : "=r"(t));\n\treturn t;\n}}\n')
    resched = _resched(image)
    task += ("void kp_kernel_resched(void);\n__asm__(\".pushsection .text\\n.globl kp_kernel_resched\\n"
             f"kp_kernel_resched:\\n\\tjmp {resched}\\n.popsection\");\n" if resched else
             "void kp_kernel_resched(void) {}\n")
    # struct file_operations' size and its llseek, read and write offsets (BTF), for the debugfs files.
    fops = kt.fops if kt is not None and kt.fops else [-1] * 4
    task += f"const long kp_kernel_fops[4] = {{ {', '.join(map(str, fops))} }};\n"
    # struct trace_event, trace_iterator and trace_array (BTF), for our events' output types.
    trace = kt.trace if kt is not None and kt.trace else [-1] * 8
    task += f"const long kp_kernel_trace[8] = {{ {', '.join(map(str, trace))} }};\n"
    return task + (f"const unsigned long kp_kernel_gap_start = {address_c(image, lay.rx_vaddr)}, "
                   f"kp_kernel_gap_end = {address_c(image, lay.end)};\n"
            "#define KP_KERNEL_BLOCK ((sizeof(struct kp_thread) + KP_NHITS * sizeof(unsigned long) + 63) & ~63UL)\n"
            f"unsigned long kp_kernel_pool[{POOL_CPUS} * KP_KERNEL_BLOCK / sizeof(unsigned long)];\n"
            "const unsigned long kp_kernel_block = KP_KERNEL_BLOCK;\n"
            "const unsigned long kp_kernel_pool_size = sizeof(kp_kernel_pool);\n")


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


# The probe tables are built at boot (runtime/platform/linux_kernel/platform.c, at the
# setup_per_cpu_areas() hook, in memblock memory) from compact records: a probe on every
# function entry needs some 4 MiB of struct kprobe and struct kp_site, more than either gap.
TABLES_AT_BOOT = True
# symbol/symstr and return addresses in trace lines: the running kernel's sprint_symbol()
# (runtime/platform/linux_kernel/kp_trace_buffer.c); a table of every function would not
# fit the gap, and kallsyms knows the KASLR base.
RUNTIME_KALLSYMS = True


def table_base(image) -> int:
    """The link address the records' 32-bit offsets count from: _text (the runtime adds
    the running _text, so KASLR needs no relocation for them)."""
    return _symbol(image, "_text")


def derived_symbol(image, addr: int) -> str | None:
    """The name the running kernel's kallsyms_lookup() gives for addr (the first of the
    symbols there, in kallsyms order), or None when the image's kallsyms are not what
    the symbols came from (a .symtab or System.map could order aliases differently)."""
    first = getattr(image, "_kallsyms_first", None)
    if first is None:
        first = image._kallsyms_first = {}
        if getattr(image, "kernel_symbols_source", None) == "kallsyms":
            for sym in image.kernel_symbols:
                first.setdefault(sym.addr, sym.name)
    return first.get(addr)


def handler_headers(image) -> dict[str, str]:
    """linux/sched.h from the image's own BTF (btf.py): the kernel's types and `current`,
    so that handlers read current->comm or a struct file as module code does; and
    linux/preempt.h (handlers run with preemption disabled, as the kernel's do)."""
    kt = _types(image)
    out = {"linux/preempt.h": PREEMPT_H}
    if kt is not None:              # no BTF: the handler API's own linux/sched.h
        out["linux/sched.h"] = kt.sched_h
    return out


def _types(image) -> btf.KernelTypes | None:
    if not hasattr(image, "_kernel_types"):
        sec = image.section_named(".BTF")
        image._kernel_types = None if sec is None else btf.kernel_types(
            image.data[sec.offset:sec.offset + sec.size], link_symbols(image), image.path)
    return image._kernel_types


def link_symbols(image) -> dict[str, int | None]:
    """What the runtime and handlers may call or read in the image: name -> address
    (kallsyms, System.map or .symtab), None for a name that several symbols share
    (static functions of different files), unless one of them is global.  Made once per
    image (the thread key, the tables, the link and the BTF header all ask)."""
    cached = getattr(image, "_link_symbols", None)
    if cached is not None:
        return cached
    syms = getattr(image, "kernel_symbols", None)
    if syms is None:
        out = dict(image.all_symbols())
    else:
        out: dict[str, int | None] = {}
        is_global: dict[str, bool] = {}
        for s in syms:
            g = s.type.isupper()
            if s.name not in out or (g and not is_global[s.name]):
                out[s.name], is_global[s.name] = s.addr, g
            elif g == is_global[s.name] and out[s.name] != s.addr:
                out[s.name] = None
    image._link_symbols = out
    return out


def diff_expected(image, meta: dict) -> list[tuple[int, int, str]]:
    """What `kprewrite diff` may find changed besides the probe sites and the gap
    our code fills: the __mcount_loc entry of each ftrace site a probe took
    (write() zeroes it, so ftrace neither patches nor checks the site)."""
    taken = {p["addr"]: p["name"] for p in meta["probes"] if p.get("ftrace")}
    out = [(m.entry_offset, 8, f"__mcount_loc entry of the ftrace site {m.site:#x} dropped ({taken[m.site]})")
           for m in ks.mcount_locs(_kernel(image)) if m.site in taken] if taken else []
    entries = None
    for p in meta["probes"]:
        for _, _, exit_addr in p.get("return_sites") or ():
            if exit_addr in _return_jumps(image):
                entries = entries or ks.return_site_entries(_kernel(image))
                out.append((image.offset_of(entries[exit_addr]), 4, f".return_sites entry of {exit_addr:#x} "
                            "pointed at its copy in the return site's detour"))
    hook = int3_hook(image)
    if hook is not None and any(p.get("int3") for p in meta["probes"]):
        out += [(image.offset_of(hook.site), 5, f"{INT3_HOOK[0]}'s ftrace site: call {INT3_HOOK[1]} (the int3 hook)"),
                (hook.entry_offset, 8, f"__mcount_loc entry of the ftrace site {hook.site:#x} dropped (the int3 hook)")]
        out += [(image.offset_of(a), 5, f"{_symbol_at(image, a)}: call {INT3_DIRECT}, not {INT3_HOOK[0]} "
                 "(the int3 hook)") for a in int3_callers(image)]
        out += [(image.offset_of(a), 5, f"{_symbol_at(image, a)}: call {EARLY_HOOK[2]}, not {EARLY_HOOK[1]} "
                 "(the early int3 hook)") for a in early_int3_callers(image)]
    return out


# apply_returns() (arch/x86/kernel/alternative.c) decodes the instruction each .return_sites
# entry points at, WARNs "missing return thunk" unless it is `jmp __x86_return_thunk`, and
# rewrites it with text_poke_early() (a memcpy: the kernel image is still writable then,
# before mark_rodata_ro()) to the chosen return (`ret; int3...` when X86_FEATURE_RETHUNK is
# off, a jmp to the chosen thunk when on).  A return region replaces that jump with ours,
# so its entry is pointed at the jump's copy in the detour: apply_returns() patches the copy
# the detour runs and never sees our jump.
JMP32 = 0xE9
STATIC_CALL_UD = b"\x0f\xb9\xcc"    # __static_call_fixup()'s tramp_ud: after it, a static-call trampoline


def return_site_patches(image, layout, rx, plan) -> list[tuple[int, bytes]]:
    """For each return region over a .return_sites site: (the entry's address, its new s32
    value, relative to itself, pointing at the `jmp __x86_return_thunk` copied at the end of
    the region's detour).  The copy lies in the text/rodata gap, mapped with .text's
    permissions until mark_rodata_ro() (writable when apply_returns() runs at boot); entries
    and copies are in the image, so KASLR moves both by the same offset and the relative
    entry needs no relocation."""
    rets = [rs for rs in plan.ret_sites if rs.exit.addr in _return_jumps(image)]
    if not rets:
        return []
    entries = ks.return_site_entries(_kernel(image))
    thunk = _symbol(image, "__x86_return_thunk")
    gap = plan_layout(image)
    out = []
    for rs in rets:
        size = layout.sizes[("ret", rs.addr)]
        copy = rs.detour + size - 5
        off = copy - layout.rx_vaddr
        code = bytes(rx[off:off + 8])
        entry = entries[rs.exit.addr]
        if code[0] != JMP32 or copy + 5 + struct.unpack_from("<i", code, 1)[0] != thunk or code[5:8] == STATIC_CALL_UD:
            raise KprewriteError(f"{image.path}: internal error: the detour of the return site {rs.exit.addr:#x} "
                                 f"does not end with its `jmp __x86_return_thunk` at {copy:#x}")
        if not gap.rx_vaddr <= copy < gap.end:
            raise KprewriteError(f"{image.path}: internal error: the copy of the return site {rs.exit.addr:#x} at "
                                 f"{copy:#x} is outside the text/rodata gap (not writable by apply_returns())")
        d = copy - entry
        if not -(1 << 31) <= d < 1 << 31:
            raise KprewriteError(f"{image.path}: the .return_sites entry at {entry:#x} cannot reach the copy of "
                                 f"{rs.exit.addr:#x} at {copy:#x} (s32)")
        out.append((entry, struct.pack("<i", d)))
    return out


def _return_jumps(image) -> set[int]:
    if not hasattr(image, "_return_jumps"):
        image._return_jumps = {r.start for r in ks.return_sites(_kernel(image))}
    return image._return_jumps


def write(image, arch, layout, rx: bytearray, patches, blob, metadata: bytes, plan) -> bytes:
    """The vmlinux with the probes' jumps, the dropped __mcount_loc entries of the ftrace
    sites we took, our code and data in the gap, and the metadata section."""
    k, gap = _kernel(image), layout.target
    code_end, data_end = blob.text_addr + len(blob.text), blob.data_addr + blob.data_memsz
    if code_end > gap.end or data_end > gap.data_end:
        raise KprewriteError(f"{image.path}: the probes need {(code_end - gap.rx_vaddr) >> 10} KiB of code and "
                             f"{(data_end - gap.data_vaddr) >> 10} KiB of data; the text/rodata gap has "
                             f"{(gap.end - gap.rx_vaddr) >> 10} KiB and the rodata/data gap {(gap.data_end - gap.data_vaddr) >> 10} KiB")
    out = bytearray(image.data)
    offset_of = _extend_first_load(image, out, gap.data_vaddr, data_end)
    hooked = []         # the int3 hook's ftrace site, when there are breakpoint sites
    if any(site.decision == INT3 for site in plan.sites):
        patches = list(patches) + _int3_hook_patches(image, blob)
        hooked = [int3_hook(image)]
    patches = list(patches) + return_site_patches(image, layout, rx, plan)
    for addr, code in patches:
        off = image.offset_of(addr)
        out[off:off + len(code)] = code
    mcount = {m.site: m for m in ks.mcount_locs(k)}
    for m in [mcount[site.addr] for site in plan.sites if site.decision == "ftrace"] + hooked:
        out[m.entry_offset:m.entry_offset + 8] = bytes(8)     # ftrace neither patches nor checks it any more
    code = bytes(rx) + blob.text
    off = image.offset_of(layout.rx_vaddr)
    out[off:off + len(code)] = code
    doff = offset_of(blob.data_addr)
    out[doff:doff + len(blob.data)] = blob.data
    zeroed = [mcount[site.addr].entry for site in plan.sites if site.decision == "ftrace"] + [m.entry for m in hooked]
    sections = [NewSection(".kprewrite.text", 1, 6, layout.rx_vaddr, code),
                NewSection(".kprewrite.data", 8 if not blob.data else 1, 3, blob.data_addr, blob.data, blob.data_memsz),
                NewSection(META_SECTION, 1, 0, 0, metadata, align=1)]
    shoff, shnum, shstrndx = append_section_headers(out, image, sections, lambda s: offset_of(s.addr))
    struct.pack_into("<Q", out, 40, shoff)
    struct.pack_into("<H", out, 60, shnum)
    struct.pack_into("<H", out, 62, shstrndx)
    if image.container is None:
        return bytes(out)
    # A bzImage: the vmlinux back in its decompressor, with its KASLR table (kaslr.py).
    table = None if image.container.relocs is None else \
        kaslr.relocation_table(image, arch, layout, rx, patches, blob, plan, zeroed)
    return bzimage_write.build(image.container, bytes(out), table, image.path)


def _extend_first_load(image, out: bytearray, data_vaddr: int, data_end: int):
    """Extend the PT_LOAD that ends in the rodata/data gap over [data_vaddr, data_end), so
    that the loader (QEMU's PVH loader, the decompressor's parse_elf()) copies our data;
    the file bytes there are the padding before the next PT_LOAD and must be zero.
    Returns the file offset of an address, the extended segment included."""
    e_phoff, = struct.unpack_from("<Q", out, 32)
    e_phnum, = struct.unpack_from("<H", out, 56)
    for i in range(e_phnum):
        at = e_phoff + 56 * i
        p_type, _, p_offset, p_vaddr, _, p_filesz, p_memsz, _ = struct.unpack_from("<IIQQQQQQ", out, at)
        if p_type == PT_LOAD and p_vaddr <= data_vaddr and p_vaddr + p_memsz <= data_vaddr < p_vaddr + 0x40000000:
            end_off = p_offset + (data_end - p_vaddr)
            others = [s for s in image.segments if s.type == PT_LOAD and s.vaddr != p_vaddr]
            if p_filesz != p_memsz or any(p_offset + p_filesz < s.offset + s.filesz and s.offset < end_off for s in others) \
                    or end_off > len(out) or any(out[p_offset + p_filesz:end_off]):
                break
            if data_end > data_vaddr:
                struct.pack_into("<QQ", out, at + 32, data_end - p_vaddr, data_end - p_vaddr)

            def offset_of(addr: int, base=p_offset - p_vaddr, lo=p_vaddr, hi=data_end) -> int:
                return base + addr if lo <= addr < max(hi, lo + 1) else image.offset_of(addr)
            return offset_of
    raise KprewriteError(f"{image.path}: the rodata/data gap at {data_vaddr:#x} is not file padding after "
                         "a PT_LOAD; cannot place the probes' data there")
