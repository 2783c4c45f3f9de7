"""Which ranges of a kernel image are refused or patched at boot: the rules.Rules of
the target.  The rules are the kernel's own (the architecture's sites.py reads the
tables): registration refuses the kprobe blacklist (_kprobe_blacklist, .kprobes.text,
.noinstr.text and the architecture's ranges), __cfi_/__pfx_ symbols, jump labels, BUG
sites and the architecture's own (x86: static calls, alternatives, entry text) and the
inside of ftrace sites; a detoured region must not overlap any site the kernel patches
at boot; a function with an exception-table entry, or one the architecture refuses (x86:
an indirect jump, a jmp through a retpoline thunk included), is not jump-optimized.  A
function entry with an ftrace site (__mcount_loc) is probed there, as KPROBE_FLAG_FTRACE
does."""
from __future__ import annotations

import bisect
import struct

from ... import safety
from ...analysis.blacklist import BlacklistEntry, Index
from ...analysis.rules import SWITCHES, Rules
from . import sites as ks
from .symbols import arch_of, kernel, symbol_at

# Registration refusals (check_kprobe_address_safe(), arch_prepare_kprobe()), by table;
# the architecture's REGISTER_REASONS add its own tables.
REGISTER_REASONS = {
    "_kprobe_blacklist": "NOKPROBE_SYMBOL",
    ".kprobes.text": "in .kprobes.text (__kprobes)",
    ".noinstr.text": "in .noinstr.text (noinstr)",
    "__cfi_/__pfx_": "CFI/padding symbol",
    "__jump_table": "jump label site (jump_label_text_reserved)",
    "__bug_table": "BUG/WARN site (find_bug)",
}
# Refused function by function, with the function's name (never patched at boot).
NAMED = ("_kprobe_blacklist", "__cfi_/__pfx_")


def rules(image, arch) -> Rules:
    k = kernel(image)
    kern = arch_of(image)
    reasons = {**REGISTER_REASONS, **kern.REGISTER_REASONS}
    named = NAMED + kern.FUNCTION_RANGES
    reserved = kern.sites.kernel_sites(image.data, None, image.path, image=k)
    mcount = {m.site: m for m in ks.mcount_locs(k)}
    register, patched = [], []
    # The kprobe blacklist is listed function by function (sites.kprobe_blacklist() adds the
    # functions of .kprobes.text, .noinstr.text and the architecture's ranges), each with its
    # section's reason.
    whole = {t: k.bounds(t) for t in k.BLACKLIST_RANGES}
    for r in reserved:
        if r.table in whole:
            continue
        why = reasons.get(r.table)
        if r.table == "_kprobe_blacklist":
            why = next((reasons[t] for t, b in whole.items() if b and b[0] <= r.start < b[1]), why)
        if why is not None:
            sym = r.detail if r.table in named else symbol_at(image, r.start)
            register.append(BlacklistEntry(r.start, r.end, sym, why))
        if r.table == "__mcount_loc":
            # Inside an ftrace site, not at its start (arch_check_ftrace_location()).
            register.append(BlacklistEntry(r.start + 1, r.end, symbol_at(image, r.start), "inside an ftrace site"))
        if r.table not in named + tuple(whole):
            patched.append(BlacklistEntry(r.start, r.end, r.detail or r.table, r.table))
    ex_insns = sorted(e.insn for e in ks.ex_table(k))
    # A return the kernel patches at boot (the architecture's RETURN_SITES table: x86's
    # return thunk jumps, patched to the chosen return sequence), not a jump.
    returns = {r.start for r in reserved if r.table == kern.RETURN_SITES}
    arch_refusal = kern.function_refusal(image, k, arch, returns)

    def function_refusal(analysis, func):
        i = bisect.bisect_left(ex_insns, func.start)
        if i < len(ex_insns) and ex_insns[i] < func.end and safety.enabled("exception_tables"):
            return arch.Refusal("__ex_table", ex_insns[i], f"{func.name} has an exception table entry: "
                                "its fixup may jump back into the function")
        return arch_refusal(analysis, func)

    def ex_fixups(img, an):
        for e in ks.ex_table(k):
            yield e.fixup, f"exception fixup of {e.insn:#x}"

    def jump_label_targets(img, an):
        a, buf = k.table_bytes("__jump_table", 16)
        for i in range(0, len(buf), 16):
            code, target, _ = struct.unpack_from("<iiq", buf, i)
            yield a + i + 4 + target, f"jump label at {a + i + code:#x}"

    # Breakpoint probes need our hook on the kernel's breakpoint path (the architecture's
    # breakpoint_hook()); single-stepped copies end with a breakpoint, as the kernel's own since 5.14
    # (its #DB path is not hooked).
    return Rules(Index(register), Index(patched), mcount, function_refusal,
                 share_ftrace=kern.SHARE_FTRACE, take_ftrace=kern.TAKE_FTRACE,
                 ftrace_ops_globs=kern.FTRACE_OPS_GLOBS, events_pt_regs=True,
                 breakpoints=kern.breakpoint_hook(image) is not None,
                 # kretprobes hook every exit where the architecture does (the user-space design;
                 # instances per task): a return the kernel patches at boot is a return, its table
                 # entry pointed at the copy in the detour (the architecture's return_site_patches());
                 # an exit no jump fits keeps the trampoline for its function (no breakpoint return
                 # hooks in a kernel).  Elsewhere the entry swaps the return address, as the kernel's.
                 kretprobes=True, kretprobe_exits=kern.KRETPROBE_EXITS, return_jumps=frozenset(returns),
                 kretprobe_blacklist={"__switch_to": SWITCHES},   # the kernel's kretprobe_blacklist[]
                 kretprobe_breakpoint_exits=False, kretprobe_clean_entry=True,
                 singlestep_breakpoint=True,
                 fast_forms=False, jump_target_sources=[ex_fixups, jump_label_targets],
                 # A kernel is built with -fno-jump-tables and jumps through retpoline
                 # thunks; decoding its 46,000 functions again would cost half a minute.
                 read_indirect_jumps=False)
