"""Writing a rewritten module: the probes, their detours and the handlers linked into
the .ko itself, for the module loader to relocate (load_module(): simplify_symbols(),
apply_relocations()), as kbuild links any module: `ld -r`.

What is written, for each probe at a function's ftrace site (the `call __fentry__`
the loader would turn into a nop; KPROBE_FLAG_FTRACE's place):

- the call's relocation points at the probe's detour instead of __fentry__, and its
  __mcount_loc entry is dropped (its relocation made R_X86_64_NONE: the entry stays 0,
  which ftrace_process_locs() skips), so ftrace never sees the site;
- the detour (kp_detours.S, from runtime/arch/x86_64/linux_module/kp_module_detours.S)
  builds a struct pt_regs as kprobe_ftrace_handler() does (ip the probed address + 1),
  calls the probe's dispatch, restores the registers (a handler's changes to them
  included) and returns to the function through
  __x86_return_thunk, or, when the pre_handler returned 1, to the regs->ip it set (a
  change of regs->sp is not applied);
- the dispatch (runtime/platform/linux_module/kp_module_runtime.c, on the probes' facts
  runtime_c() generates as macros in kp_module.c) counts the hit and calls the pre- and
  post-handlers directly (no indirect call), while the probes are armed;
- `struct module`'s init and exit (the relocations of .gnu.linkonce.this_module against
  init_module and cleanup_module) are redirected to kp_module_init, which arms the
  probes and chains to the module's own init, and kp_module_exit, which chains to the
  module's exit, disarms and prints each probe's hits.  The code goes with the module
  at rmmod, and the probes with it.

A kretprobe is the kernel's kind: the return address swapped at entry for
kp_kret_trampoline, its instance from a pool claimed atomically and found again at return
by its return-address slot.  A kprobe inside a function is an optimized (jump) probe: a
`jmp` to a detour built as opt.c's template, then the region's copy with the module's
relocations carried (optprobe.py; opt_detour(), _redirect()).  Where no jump can go (or
with a post_handler, which the kernel never optimizes), a breakpoint probe: an int3 at the
site, taken by the module's own die notifier (DIE_INT3, registered first thing in
kp_module_init(); kp_module_int3.c), the instruction run from a slot in the module's code
(int3_slot(): its copy carrying its relocations, then a jump back, or an int3 where the
kernel would single-step).  A kretprobe's entry may be any of these.  What cannot be placed
is refused with one line.

Our code gets entries in the module's own ORC tables (orc.py), so a handler's stack unwinds
through the runtime and the detour into the probed function and its callers: the runtime's and
handlers' code (renamed .text.kprewrite_c) by the frame-pointer rule, each detour, slot and the
trampoline per instruction.

Trace events (`events` lines, `fetch`) are the runtime's fetch programs (kp_fetch.c,
kp_trace.c on runtime/platform/linux_module); with the kernel's BTF each is the kernel's
own event call (kp_module_event_calls.c), else their lines are written to the ftrace ring buffer
as trace_printk() writes them.  The kernel symbols our code calls that the module did not
get their CRCs from the kernel's Module.symvers (symvers.py) in extra __versions entries;
with them, handlers run with preemption disabled and a hit during one of ours is missed
(nmissed), and the counters are in debugfs while the module is loaded.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ....errors import KprewriteError
from ....arch.base import SINGLESTEP
from ....planner.model import FTRACE, BREAKPOINT, OPTIMIZED
from ....probes.spec import where
from .optprobe import CopyRefused, FIELD_SIZE, relocations
from ..parts import module_parts
from ..ko import (PLACEHOLDER, SECTIONS, placeholder_namer as _placeholder, _append_relas, _c_string, _define, _imported, _names,  # noqa: F401
                  _run, _sites, _versions, handler_externs, kretprobes_c, module_name, write)
from .relocatable import RELA, R_X86_64_PC32, SHN_LORESERVE, SHT_RELA, THIS_MODULE, read_sections, relas, symbols


def module_source(rel: str) -> str:
    """A source file under runtime/ the writer reads as text (the kretprobe trampoline, which
    it annotates with ORC entries): its first comment says what it is; the text after it is
    what is read."""
    from ....link.runtime import RUNTIME_DIR
    return (RUNTIME_DIR / rel).read_text().split("*/\n", 1)[1]


R_X86_64_NONE = 0


# The detours' and slots' templates: ftrace, opt_head, opt_tail, slot_head, slot_ss_end, slot_tail;
# kp_int3_at[]'s: int3_table, int3_at, int3_ss, int3_target.
DETOURS = module_parts("arch/x86_64/linux_module/kp_module_detours.S")


def opt_detour(i: int, site, mod, relocs, placeholders: dict, unwind=None) -> str:
    """The optimized detour of site i (DETOURS' opt_head, the region's copies, opt_tail),
    each relocated field a reference to a new placeholder: placeholders[name] = Field
    (optprobe.Field: what _redirect() points its relocation at).  unwind: (orc.Entries, the
    module's entries) to give the detour ORC entries (orc.py): the probed function's entry at
    the hit moved by what the head pushed, a pt_regs entry at the dispatch's call, each copied
    instruction's own, the region end's at the jump back."""
    from .optprobe import Field, region
    ph = _placeholder(placeholders)
    sec, off = mod.place(site.addr)
    end_sec, end = mod.place(site.region_end - 1)
    head = DETOURS["opt_head"].replace("{i}", str(i)).replace("{site}", ph(Field(0, 4, sec.name, addend=off + 1 - 4)))
    if unwind:
        from . import orc
        entries, table = unwind
        at_hit = orc.entry_at(table, sec.name, off)
        head = entries.annotate(head, lambda cfa: orc.adjust(at_hit, cfa), regs_calls=("kp_dispatch_",))
    out = [head]
    for insn, (code, fields) in zip(site.dcr, region(mod, relocs, site)):
        if unwind:
            where = mod.place(insn.addr)
            out.append(entries.copy(code, orc.entry_at(table, where[0].name, where[1])))
        out.append(_copy_s(code, fields, ph))
    if unwind:
        out.append(entries.at(orc.entry_at(table, end_sec.name, end + 1)))
    out.append(DETOURS["opt_tail"].replace("{i}", str(i)).replace("{back}", ph(Field(0, 4, end_sec.name,
                                                                                   addend=end + 1 - 4))))
    return "".join(out)


def _copy_s(code: bytes, fields: list, ph) -> str:
    """An instruction's copy as assembler lines, each relocated field a reference to a new
    placeholder (ph(field) names it)."""
    out, pos = [], 0
    for fl in fields:
        if fl.at > pos:
            out.append("\t.byte " + ", ".join(f"{b:#x}" for b in code[pos:fl.at]) + "\n")
        out.append(f"\t.{'long' if fl.size == 4 else 'quad'} {ph(fl)}{' - .' if fl.carry is None else ''}\n")
        pos = fl.at + fl.size
    if pos < len(code):
        out.append("\t.byte " + ", ".join(f"{b:#x}" for b in code[pos:]) + "\n")
    return "".join(out)


def traps_after(site) -> bool:
    """Whether a breakpoint site's slot ends with an int3: the kernel's single-step since 5.14
    (an instruction it does not boost, or a kprobe with a post_handler, which runs at that
    trap: the module's rules single-step those, x86_64/rules.py's int3_copy())."""
    return site.xol.mode == SINGLESTEP


def int3_slot(i: int, site, mod, relocs, placeholders: dict, unwind=None) -> str:
    """The out-of-line slot of breakpoint site i (the kernel's insn slot, in the module's own
    code): the instruction's copy (optprobe.copy(): its relocations carried; a relative branch
    re-encoded, a call pushing the original return address), then an int3 where the kernel
    would single-step (kp_ss_<i>: its trap resumes after the original instruction and runs the
    post_handlers), then the jump back to the next instruction (a boosted copy's way back).
    A single-stepped copy runs with interrupts off (setup_singlestep()); it has two slots,
    kp_slot_<i> for a trap that came with interrupts on (its closing trap turns them back on,
    resume_singlestep()'s kprobe_saved_flags) and kp_slot_<i>_irqoff for one that came with
    them off: the saved IF is the slot taken, no state kept between the two traps (one slot,
    IF untouched, for an instruction that changes or reads it: ss_slots()).
    unwind: (orc.Entries, the module's entries) to give the slot ORC entries: the probed
    instruction's own at its copy, the next instruction's at the int3 and the jump back."""
    from .optprobe import Field, copy
    ph = _placeholder(placeholders)
    code, fields = copy(mod, relocs, site.xol.insn)
    end_sec, end = mod.place(site.addr + len(site.xol.insn.code) - 1)
    out = []
    for name in ss_slots(i, site) or (str(i),):
        out.append(DETOURS["slot_head"].replace("{i}", name))
        if unwind:
            from . import orc
            entries, table = unwind
            sec, off = mod.place(site.addr)
            out.append(entries.copy(code, orc.entry_at(table, sec.name, off)))
        out.append(_copy_s(code, fields, ph))
        if unwind:
            out.append(entries.at(orc.entry_at(table, end_sec.name, end + 1)))
        if traps_after(site):
            out.append(DETOURS["slot_ss_end"].replace("{i}", name))
        out.append(DETOURS["slot_tail"].replace("{i}", name).replace("{back}", ph(Field(0, 4, end_sec.name,
                                                                                  addend=end + 1 - 4))))
    return "".join(out)


def ss_slots(i: int, site) -> tuple[str, ...]:
    """The slots of single-stepped breakpoint site i: two, by the interrupt flag the site's trap
    came with, on (set again at the closing trap) and off (left off); one, run with the flag
    as the probed code has it, for an instruction that changes or reads it (cli, sti, pushf,
    popf: the kernel emulates those, kprobe_emulate_ifmodifiers(), rather than single-step them
    with interrupts off, which would undo a cli or push a wrong IF); none if not single-stepped."""
    if not traps_after(site):
        return ()
    if site.xol.insn.info.emulate in IF_MODIFIERS:
        return (str(i),)
    return str(i), f"{i}_irqoff"


# prepare_emulation()'s IF modifiers (x86_64/insn.py's names).
IF_MODIFIERS = ("cli", "sti", "pushf", "popf")


def int3_table(int3: list, mod, relocs, placeholders: dict) -> str:
    """kp_int3_at[]: each breakpoint site's address, as a 32-bit distance from its entry (an
    R_X86_64_PC32 to the site's section, applied by the module loader), as the kernel's
    kprobe_table is its data, then each single-stepped slot's closing int3 (kp_ss_<i>, both
    slots'), in the order int3_runs() gives the notifier's binary search; and
    kp_int3_target_<i>, an emulated branch's target, the same way (optprobe.branch_target())."""
    from .optprobe import Field, branch_target
    ph = _placeholder(placeholders)
    out = [DETOURS["int3_table"]]
    for _, site in int3:
        sec, off = mod.place(site.addr)
        out.append(DETOURS["int3_at"].replace("{site}", ph(Field(0, 4, sec.name, addend=off))))
    for i, site in int3:
        out += [DETOURS["int3_ss"].replace("{i}", name) for name in ss_slots(i, site)]
    for i, site in int3:
        if emulated(site):              # the branch's target, for its emulation in the trap
            out.append(DETOURS["int3_target"].replace("{i}", str(i)).replace(
                "{target}", ph(branch_target(mod, relocs, site.xol.insn))))
    return "".join(out)


def int3_runs(sections: list[str], n_ss: int) -> list[int]:
    """The bounds of kp_int3_at[]'s runs, each sorted by address once loaded: the sites (in
    address order, _sites()) cut where their section changes (the loader places each section
    where it will: only the order inside one is known here), then the closing int3s (in
    .text.kprewrite, in slot order).  kp_int3_find() searches each run by halves."""
    runs = [0]
    for k in range(1, len(sections)):
        if sections[k] != sections[k - 1]:
            runs.append(k)
    if sections:
        runs.append(len(sections))
    if n_ss:
        runs.append(len(sections) + n_ss)
    return runs


def emulated(site) -> bool:
    """A breakpoint site whose branch the trap emulates (kprobe_emulate_jmp/jcc/call()) so a
    post_handler runs after it; without one the branch runs from its slot's copy."""
    from ....arch.base import EMULATE
    return site.xol.mode == EMULATE and site.with_post


def _resched(symvers: dict | None) -> str | None:
    """The kernel's way to reschedule after a handler (kp_module_preempt.c's KP_RESCHED): its
    PREEMPT_DYNAMIC static call, else its thunk, else none (a kernel without CONFIG_PREEMPTION
    exports neither)."""
    return next((n for n in ("__SCT__preempt_schedule", "preempt_schedule_thunk") if n in (symvers or {})), None)


# struct kprobe's flags by the site's decision (a breakpoint's: none).
_KPROBE_FLAGS = {FTRACE: "KPROBE_FLAG_FTRACE", OPTIMIZED: "KPROBE_FLAG_OPTIMIZED"}


def runtime_c(plan, handler_symbols: dict[str, str], module: str, traces: dict | None = None,
              debugfs: bool = False, symvers: dict | None = None, event_calls: bool = False,
              place=None) -> str:
    """The module's kp_module.c: the probes' facts as macros (names, numbers, the handlers each
    site calls, by its decision), for the fixed runtime it includes last,
    runtime/platform/linux_module/kp_module_runtime.c (its first comment names the macros):
    probe structures, the dispatch of each site, the kretprobe entry and return, init and exit.
    traces: the trace events (events.trace_key -> TraceEvent) whose
    kp_trace_pre_<key>/kp_trace_ret_<key> (events.trace_c(), in kp_events.c) run in place of
    the user's handler and call it; debugfs: with the kernel's CRCs (each probe's counters as
    files while the module is loaded, handlers with preemption off); place: an address's
    section name (the breakpoint sites' runs, int3_runs())."""
    from ....probes.events import trace_key
    traces = traces or {}
    out = ["/* A module's probes, for kp_module_runtime.c (generated by kprewrite: writer.py's runtime_c()). */",
           f'#define KP_MODULE_NAME "{module}"']
    if debugfs:
        out.append("#define KP_MODULE_CRCS 1")
        resched = _resched(symvers)
        if resched:
            out.append(f'#define KP_RESCHED "{resched}"')
    if event_calls:
        out.append("#define KP_MODULE_EVENT_CALLS 1")
    kps = [p for _, p in plan.kprobes]
    krs = [ep for _, ep, _ in plan.kretprobes]
    kr_flags = [_KPROBE_FLAGS.get(site.decision, "0") for site, _, _ in plan.kretprobes]
    out += [f"#define KP_NK {len(kps)}", f"#define KP_NK_SLOTS {max(len(kps), 1)}",
            f"#define KP_NR {len(krs)}", f"#define KP_NR_SLOTS {max(len(krs), 1)}"]
    traced = [f"KP_EXTERN_KRET(kp_trace_ret_{key})" if traces[key].is_return else f"KP_EXTERN_PRE(kp_trace_pre_{key})"
              for key in sorted(traces, key=str)]
    out.append(_define("KP_EXTERNS", handler_externs(handler_symbols, kps, krs, traced)))
    out.append(_define("KP_PROBES", [
        f"KP_PROBE({_c_string(p.symbol)}, {p.offset}, {_KPROBE_FLAGS.get(site.decision, '0')}, "
        f"{_c_string(p.event_name)}, {p.index})" for site, p in plan.kprobes]))
    out += kretprobes_c(krs, kr_flags, handler_symbols, traces)
    dispatches = []
    for n, (site, ks, rs) in enumerate(_sites(plan)):
        body = []
        for i in ks:
            p = kps[i]
            pre = handler_symbols.get(p.spec.pre_handler) if p.spec.pre_handler else None
            if trace_key(p) in traces:      # the event's pre_handler, which calls the user's
                pre = f"kp_trace_pre_{trace_key(p)}"
            post = handler_symbols.get(p.spec.post_handler) if p.spec.post_handler else None
            if site.decision == OPTIMIZED:
                run = f"KP_RUN_OPTIMIZED({pre})" if pre else ""
            elif site.decision == BREAKPOINT:
                run = f"KP_RUN_INT3({pre})" if pre else ""
            else:
                run = (f"KP_RUN_FTRACE({f'KP_FTRACE_PRE({pre})' if pre else ''}, "
                       f"{f'KP_FTRACE_POST({post})' if post else ''})")
            body.append(f"KP_KPROBE({i}, {run})")
        body += [f"KP_KRET_AT({j})" for j in rs]
        missed = [f"KP_MISSED_K({i})" for i in ks] + [f"KP_MISSED_R({j})" for j in rs]
        out_label = "KP_OUT" if any("KP_RUN_INT3" in b or "KP_FTRACE_PRE" in b for b in body) else ""
        dispatches.append(f"KP_DISPATCH({n}, {' '.join(missed)}, {' '.join(body)}, {out_label})")
    out.append(_define("KP_SITES", dispatches))
    int3 = [(n, site, ks) for n, (site, ks, _) in enumerate(_sites(plan)) if site.decision == BREAKPOINT]
    if int3:
        sections = [place(site.addr) if place else "" for _, site, _ in int3]
        out.append(_int3_c(int3, kps, handler_symbols, sections))
    out.append('#include "kp_module_runtime.c"')
    return "\n".join(out) + "\n"


def _int3_c(int3: list, kps: list, handler_symbols: dict, sections: list[str]) -> str:
    """The breakpoint sites' facts for kp_module_int3.c (its first comment says how their traps
    are taken): each site's slots, post_handlers and emulated branch, and the notifier's cases,
    one per kp_int3_at[] entry: a site's trap (the site's k-th), then each closing int3's (the
    e-th), in int3_runs()' order.  sections: each site's section, in int3's order."""
    decls, targets = [], []
    for n, site, ks in int3:
        if not emulated(site):
            decls.append(f"KP_SLOT({n})")
        if len(ss_slots(n, site)) == 2:
            decls.append(f"KP_SLOT_IRQOFF({n})")
        posts = [(i, handler_symbols[kps[i].spec.post_handler]) for i in ks if kps[i].spec.post_handler]
        if posts:
            decls.append(f"KP_POST_FUNC({n}, {' '.join(f'KP_POST_CALL({i}, {h})' for i, h in posts)})")
    cases, e = [], len(int3)
    for k, (n, site, ks) in enumerate(int3):
        has_post = any(kps[i].spec.post_handler for i in ks)
        if emulated(site):
            targets.append(f"KP_TARGET({n})")
            cases.append(f"KP_CASE_EMULATED({k}, {n}, {_emulate_c(site, k, n)})")
            continue
        after = f"KP_AFTER({k}, {len(site.xol.insn.code)}, {f'KP_POST({n})' if has_post else ''})"
        if len(ss_slots(n, site)) < 2:  # boosted, or an IF modifier: the copy runs with IF untouched
            cases.append(f"KP_CASE_SLOT({k}, {n})")
            if traps_after(site):
                cases.append(f"KP_CASE_RESUME({e}, {after})")
                e += 1
            continue
        cases.append(f"KP_CASE_SS({k}, {n})")
        cases.append(f"KP_CASE_RESUME_IF({e}, {e + 1}, {after})")
        e += 2
    runs = int3_runs(sections, e - len(int3))
    return "\n".join(["#define KP_MODULE_INT3 1", _define("KP_INT3_DECLS", decls), _define("KP_INT3_TARGETS", targets),
                      f"#define KP_INT3_RUNS {', '.join(map(str, runs))}", f"#define KP_INT3_NRUNS {len(runs)}",
                      _define("KP_INT3_CASES", cases)])


def trap_path(plan, traces: dict | None = None) -> tuple[set[str], list[str]]:
    """The functions of ours that run inside a breakpoint's trap, or on a kretprobe's way back
    through the trampoline (the kernel's NOKPROBE_SYMBOL()s: kprobe_int3_handler(), its
    kprobe_post_process(), the kretprobe trampoline's handler): (those of kp_module.c, by name,
    gcc's clones of them included by nokprobe_s(); those defined elsewhere: an event's
    pre_handler at a breakpoint (kp_events.c), the trampoline (kp_detours.S))."""
    from ....probes.events import trace_key
    traces = traces or {}
    local, other = set(), []
    sites = _sites(plan)
    kps = [p for _, p in plan.kprobes]
    for n, (site, ks, rs) in enumerate(sites):
        if site.decision != BREAKPOINT:
            continue
        local |= {"kp_int3_notify", f"kp_dispatch_{n}"}
        if any(kps[i].spec.post_handler for i in ks):
            local.add(f"kp_post_{n}")
        if rs:
            local |= {"kp_claim", *(f"kp_kret_entry_{j}" for j in rs)}
        other += [f"kp_trace_pre_{trace_key(kps[i])}" for i in ks if trace_key(kps[i]) in traces]
    if plan.kretprobes:
        local.add("kp_kret_return")
        other.append("kp_kret_trampoline")
    return local, sorted(set(other))


def nokprobe_s(asm: str, names: tuple[set[str], list[str]]) -> str:
    """The module's _kprobe_blacklist entries (NOKPROBE_SYMBOL(): the module loader hands them to
    the kprobes blacklist, add_module_kprobe_blacklist()), as lines to append to kp_module.c's
    assembly: each function of trap_path() that gcc emitted (one inlined everywhere is its
    callers' code), with its clones (`.part.N`, `.isra.N`, `.constprop.N`, `.cold`), which
    a list made in C could not name; and those defined in our other objects."""
    local, other = names
    funcs = [m.group(1) for m in re.finditer(r"^\s*\.type\s+([^\s,]+),\s*@function", asm, re.M)]
    found = [f for f in funcs if f.split(".")[0] in local]
    if not found and not other:
        return ""
    return SECTIONS["nokprobe"] + "".join(SECTIONS["nokprobe_entry"].replace("{func}", f) for f in found + other)


def _emulate_c(site, k: int, n: int) -> str:
    """prepare_emulation()'s branch done in the trap for breakpoint site n (the k-th), as
    kp_module_int3.c's KP_EMULATE_JMP/JCC/CALL."""
    from ....arch.x86_64.kprobe_xol import K_CALL, K_JCC, K_JMP
    x = site.xol
    if x.kind == K_JMP:
        return f"KP_EMULATE_JMP({n})"
    if x.kind == K_JCC:
        return f"KP_EMULATE_JCC({k}, {n}, {len(x.insn.code)}, {x.cc})"
    if x.kind == K_CALL:
        return f"KP_EMULATE_CALL({k}, {n}, {len(x.insn.code)})"
    raise KprewriteError(f"{site.addr:#x}: no emulation of kind {x.kind} in a module (its rules refuse it)")


TRAMPOLINE_S = module_source("arch/x86_64/linux_module/kp_module_kret_trampoline.S")


def refusals(image, plan, traces, spec_name: str) -> list[str]:
    """targets.base.Target.refusals(): one line per probe the module cannot take, asked by
    `check` and `instrument` alike: a module without an exit, an optimized region whose
    copy cannot carry its relocations (optprobe.py; the module's rules refuse it first),
    an @SYM in an event.
    What a breakpoint site cannot take is the module's rules' refusal (x86_64/rules.py's
    int3_copy())."""
    from ....probes.resolve import is_entry
    from .optprobe import region
    lines = []
    if "cleanup_module" not in image.symbols:
        # The probes' exit (unregistering, freeing) runs from the module's; without one
        # the module could never be unloaded, so it is not rewritten.
        lines.append(f"{image.path}: the module has no exit (cleanup_module): it could not be unloaded")
    relocs = None
    for site in plan.sites:
        if site.decision != OPTIMIZED or all(is_entry(p) for p in site.probes):
            continue
        label = lambda p: f"{where(spec_name, p.spec.table)} ({p.label})"  # noqa: E731
        relocs = relocs if relocs is not None else relocations(image.container)
        try:
            region(image.container, relocs, site)
        except CopyRefused as e:
            check, addr, why = e.args
            lines += [f"{label(p)}: {check} at {addr:#x}: {why}" for p in site.probes if not is_entry(p)]
    for key, ev in sorted(traces.items(), key=lambda kv: str(kv[0])):
        if any(i.op == "IMM_LINK" for a in ev.args for i in a.code):
            lines.append(f"{spec_name}: event {ev.name}: @SYM in a module's event is not written yet "
                         f"(the module's addresses are the loader's)")
    return lines


def _names_bound(ev) -> int:
    """kp_trace_buffer.c's kp_trace_names_bound(): the bytes of an event's print_fmt and its
    array fields' "TYPE[N]" names."""
    total = 128
    for a in ev.args:
        n = len(a.name.encode())
        total += 48 + n + (a.count or 1) * (n + 48)
    return total


def event_calls_c(traces: dict, layout: list) -> str:
    """The module's kp_event_calls.c: each trace event as the kernel's own event call, the words
    of its trace_event_call, class and fields_array laid out from the kernel's BTF (layout:
    kernel_btf.layout()), as macros for runtime/platform/linux_module/kp_module_event_calls.c
    (its first comment says how the calls are registered), on the kernel image's
    runtime/platform/linux_kernel/kp_trace_buffer.c built with KP_MODULE_EVENTS."""
    from ....link.runtime import RUNTIME_DIR
    from ..kernel_btf import EXTRA
    trace_n = len(layout) - len(EXTRA)
    (raw_init,) = layout[trace_n:]
    order = sorted(traces, key=str)
    L = dict(zip(("entry", "ev_size", "ev_type", "ev_funcs", "seq", "ent", "ent_size", "buffer", "call_size",
                  "call_class", "call_name", "call_event", "print_fmt", "class_size", "system", "reg",
                  "fields_array", "fields", "fields_size", "define"), layout))
    for k, v in [*L.items(), ("raw_init", raw_init)]:
        if k not in ("ev_type", "seq", "ent", "ent_size", "buffer", "call_size", "class_size", "fields_size",
                     "entry", "ev_size") and v % 8:
            raise KprewriteError(f"the kernel's BTF puts {k} at {v}, not a pointer's place")
    fl = L["fields"] // 8
    out = ["/* A module's event calls, for kp_module_event_calls.c (generated by kprewrite: writer.py's "
           "event_calls_c()). */",
           "#define KP_MODULE_EVENTS 1",
           f'#include "{RUNTIME_DIR / "platform" / "linux_kernel" / "kp_trace_buffer.c"}"',
           f"#define KP_TRACE_LAYOUT {', '.join(map(str, layout[:trace_n]))}",
           f"#define KP_TRACE_LAYOUT_N {trace_n}",
           # The words of a trace_event_call and of its class each pointer goes in (the BTF's offsets / 8).
           f"#define KP_CALL_CLASS {L['call_class'] // 8}",
           f"#define KP_CALL_NAME {L['call_name'] // 8}",
           f"#define KP_CALL_EVENT_FUNCS {(L['call_event'] + L['ev_funcs']) // 8}",
           f"#define KP_CLASS_SYSTEM {L['system'] // 8}",
           f"#define KP_CLASS_REG {L['reg'] // 8}",
           f"#define KP_CLASS_RAW_INIT {raw_init // 8}",
           f"#define KP_CLASS_FIELDS_ARRAY {L['fields_array'] // 8}",
           f"#define KP_CLASS_FIELDS {fl}",
           f"#define KP_CLASS_FIELDS_PREV {fl + 1}",
           f"#define KP_FIELD_DEFINE {L['define'] // 8}",
           f"#define KP_NCALLS {len(order)}",
           # each call: its index, the event's name, the bytes of its names, its array types' count
           _define("KP_CALLS(X)", [f"X({i}, {json.dumps(traces[k].name)}, {_names_bound(traces[k])}, "
                                   f"{len(traces[k].args) + 1})" for i, k in enumerate(order)]),
           '#include "kp_module_event_calls.c"']
    return "\n".join(out) + "\n"


# The module's back half: the steps of pipeline.build() (targets.base.Target's lay_out,
# tables, link, unlinked, emit, write) answered for a module, which its loader lays out and
# `ld -r` links.  The runtime's fixed objects a module's trace events use (runtime/kp_lib.c,
# kp_line.c, kp_fetch.c, kp_trace.c, platform/linux_module/platform.c) come built and cached
# by link/runtime.py from the module's recipe (linux_module/recipe.py).


@dataclass
class ModuleLayout:
    """A module's layout is its loader's: nothing of it has an address before insmod, and the
    loader places each section where it will (only the order inside one is known here).  What
    the later steps share: the probed sites in address order (_sites(): one detour each), the
    module's relocations read once, its ORC tables' layout and entries (orc.py) when it has them."""
    mod: object
    name: str                           # the module's name (module_name())
    debugfs: bool                       # the kernel's CRCs are known (symvers.py)
    calls: list | None                  # the kernel's event-call layout (kernel_btf.py), or None
    sites: list                         # _sites(plan)
    relocs: dict                        # optprobe.relocations(mod)
    orc_format: str | None
    orc_own: dict | None                # orc.module_entries(): None, no ORC entries of ours

    def detour(self, site) -> int:
        """The address `list` shows for a site's detour: none before the loader's (meta.py)."""
        return 0

    def section(self, addr: int) -> str:
        """The name of the module's section holding addr."""
        return self.mod.place(addr)[0].name


@dataclass
class ModuleTables:
    """The generated sources of a module's rewrite: kp_module.c (the probes' facts as macros
    for kp_module_runtime.c, runtime_c()), kp_detours.S (the detours, slots, kp_int3_at[] and the
    kretprobe trampoline from the templates of runtime/arch/x86_64/linux_module/, with their
    ORC entries), the trace events' C (kp_events.c, and kp_event_calls.c with the kernel's BTF);
    the placeholders the copies' relocated fields name (_redirect() points them) and the
    functions of the trap's path (trap_path())."""
    c: str
    asm: str
    events: list                        # [(file name, C text)]
    placeholders: dict
    trap_path: tuple


@dataclass
class ModuleBlob:
    """The linked module (`ld -r`: the .ko, our code and the handlers), before emit() points
    its relocations at our code."""
    path: Path
    data: bytes
    placeholders: dict


def lay_out(s, code) -> ModuleLayout:
    """targets.base.Target.lay_out() for a module: its loader's (ModuleLayout)."""
    mod = s.image.container
    debugfs = mod.symvers is not None
    # The events as the kernel's own event calls when the kernel's BTF gives their layouts
    # (kernel_btf.py; with the CRCs, which their functions need), else trace_printk() lines.
    calls = None
    if s.traces and debugfs:
        from .. import kernel_btf
        calls = kernel_btf.event_layout(mod)[0]
    relocs = relocations(mod)
    # The module's own ORC tables take entries for our code (orc.py), when it has them.
    from . import orc
    fmt = orc.orc_format(mod)
    own = orc.module_entries(mod, relocs) if fmt else None
    return ModuleLayout(mod, module_name(mod), debugfs, calls, _sites(s.plan), relocs, fmt, own)


def tables(s, code, lay: ModuleLayout) -> ModuleTables:
    """targets.base.Target.tables() for a module: its generated sources (ModuleTables)."""
    from ....probes.events import trace_c, trace_key
    from . import orc
    mod, relocs, fmt = lay.mod, lay.relocs, lay.orc_format
    src = runtime_c(s.plan, s.handler_symbols, lay.name, s.traces, lay.debugfs, mod.symvers, lay.calls is not None,
                    place=lay.section)
    placeholders: dict = {}
    unwind = (orc.Entries(fmt), lay.orc_own) if lay.orc_own is not None else None

    def ftrace_detour(i):
        text = DETOURS["ftrace"].replace("{i}", str(i))
        if not unwind:
            return text
        # the return address into the probed function right above the CFA all along
        return unwind[0].annotate(text, lambda cfa: orc.entry(fmt, orc.ORC_REG_SP, cfa), start=8)
    detours = [ftrace_detour(i) if site.decision == FTRACE
               else "" if site.decision == BREAKPOINT and emulated(site)     # run in the trap: no slot
               else int3_slot(i, site, mod, relocs, placeholders, unwind) if site.decision == BREAKPOINT
               else opt_detour(i, site, mod, relocs, placeholders, unwind) for i, (site, _, _) in enumerate(lay.sites)]
    int3 = [(i, site) for i, (site, _, _) in enumerate(lay.sites) if site.decision == BREAKPOINT]
    trampoline = TRAMPOLINE_S if s.plan.kretprobes else ""
    if unwind and trampoline:
        # Its return address is a kretprobe's, the real one in the instance: no rule before the
        # dispatch's call (a pad byte's terminator for a return address there, looked up at - 1),
        # pt_regs at it (regs->ip the real return address once kp_kret_return() set it), the
        # slot's return address after.
        called = []
        pad = "kp_kret_swapped:\n\tint3\t\t\t\t/* never run */\nkp_kret_trampoline:"
        trampoline = unwind[0].annotate(
            trampoline.replace("kp_kret_trampoline:", pad, 1),
            lambda cfa: orc.entry(fmt, orc.ORC_REG_SP, cfa) if called else orc.UNDEFINED,
            regs_calls=("kp_kret_return",), on_call=lambda: called.append(1))
    if unwind:
        trampoline += '\t.section .text.kprewrite,"ax",@progbits\n' + unwind[0].at(orc.UNDEFINED)
    if int3:
        detours.append(int3_table(int3, mod, relocs, placeholders))
    asm = ((orc.ENTRY_MACRO_S if unwind else "") + "".join(f"\t.weak {n}\n" for n in placeholders)
           + "".join(detours) + trampoline)
    events = []
    if s.traces:
        users = {trace_key(p): s.handler_symbols[p.spec.pre_handler] for _, p in s.plan.kprobes if p.spec.pre_handler}
        users.update({trace_key(p): s.handler_symbols[p.kret.handler] for _, p, _ in s.plan.kretprobes
                      if p.kret.handler})
        events.append(("kp_events.c", "".join(f"extern char {u}[];\n" for u in sorted(set(users.values())))
                       + trace_c(s.traces, users, [])))
        if lay.calls is not None:
            events.append(("kp_event_calls.c", event_calls_c(s.traces, lay.calls)))
    return ModuleTables(src, asm, events, placeholders, trap_path(s.plan, s.traces))


def link(s, lay: ModuleLayout, table: ModuleTables, runtime: list[Path], objs: list[Path], workdir: Path, cc: str):
    """targets.base.Target.link() for a module: its generated sources compiled, linked with the
    runtime's objects (when it has trace events) and the handlers' into one object whose hidden
    symbols are made local, ORC entries framing its C code, then `ld -r` with the module itself
    and the __versions entries of the kernel symbols it added; done here (link.blob.Linked)."""
    from ....link.blob import Linked
    from ....link.toolchain import linker
    from ....link.runtime import _includes, cflags
    from . import orc
    mod, fmt = lay.mod, lay.orc_format
    src, asm = workdir / "kp_module.c", workdir / "kp_detours.S"
    src.write_text(table.c)
    asm.write_text(table.asm)
    obj_c, obj_s = workdir / "kp_module.o", workdir / "kp_detours.o"
    flags = [*cflags(s.arch, "linux_module"), *_includes(s.arch, "linux_module")]
    if lay.calls is not None:
        flags.append("-DKP_MODULE_EVENTS")
    # Compiled to assembly first: the trap's functions, as gcc emitted them (clones included),
    # are named in the module's _kprobe_blacklist there (nokprobe_s()).
    src_s = workdir / "kp_module.s"
    _run([cc, *flags, "-S", str(src), "-o", str(src_s)], "the module's runtime")
    asm_c = src_s.read_text()
    src_s.write_text(asm_c + nokprobe_s(asm_c, table.trap_path))
    _run([cc, *flags, "-c", str(src_s), "-o", str(obj_c)], "the module's runtime")
    _run([cc, "-c", str(asm), "-o", str(obj_s)], "the module's detours")
    ours = [obj_c, obj_s]
    for i, (name, text) in enumerate(table.events):
        c = workdir / name
        c.write_text(text)
        o = workdir / f"kp_rt{i}.o"
        _run([cc, *flags, "-c", str(c), "-o", str(o)], f"the module's runtime ({name})")
        ours.append(o)
    if table.events:                    # the runtime's fetch and trace code, for the events
        ours += runtime
    # Our code first linked alone, its hidden symbols made local: the module's own references
    # (its memcmp, a handler's name) never bind to ours, nor ours to the module's.
    rt = workdir / "kp_runtime.o"
    _run([linker(s.arch), "-r", "-o", str(rt), *map(str, ours), *map(str, objs)], "ld -r (the runtime)")
    _run(["objcopy", "--localize-hidden", str(rt)], "objcopy --localize-hidden")
    around = ([], [])
    if lay.orc_own is not None:
        # The runtime's and handlers' code (frame-pointer code) in a section of its own, framed by
        # an object with the frame-pointer entry at its start and one with a terminator at its end.
        code = [sc.name for sc in read_sections(rt.read_bytes(), str(rt)) if sc.flags & 0x6 == 0x6   # SHF_ALLOC|EXEC
                and sc.name != ".text.kprewrite" and not sc.name.startswith((".init", ".exit"))]
        if code:
            _run(["objcopy", *(f"--rename-section={n}={orc.C_SECTION}" for n in code), str(rt)],
                 "objcopy --rename-section")
        for k, text in enumerate((orc.c_begin_s(fmt), orc.c_end_s(fmt))):
            src_s, obj = workdir / f"kp_orc_{k}.S", workdir / f"kp_orc_{k}.o"
            src_s.write_text(text)
            _run([cc, "-c", str(src_s), "-o", str(obj)], "the module's ORC entries")
            around[k].append(str(obj))
    orig = workdir / "orig.ko"
    orig.write_bytes(mod.data)
    versions = _versions(mod, rt, workdir, cc)
    linked = workdir / "linked.ko"
    _run([linker(s.arch), "-r", "-o", str(linked), str(orig), *around[0], str(rt), *around[1],
          *([str(versions)] if versions else [])], "ld -r")
    return Linked(ModuleBlob(linked, linked.read_bytes(), table.placeholders))


def emit(s, code, lay: ModuleLayout, blob: ModuleBlob, unlinked) -> tuple[bytearray, list]:
    """targets.base.Target.emit() for a module: the linked module's bytes with its relocations
    pointed at our code (_redirect(): the probed sites, the copies' placeholders, struct
    module's init and exit); no patches beside."""
    sites = [(i, lay.section(site.addr), lay.mod.place(site.addr)[1], site.decision)
             for i, (site, _, _) in enumerate(lay.sites)]
    return _redirect(bytearray(blob.data), str(blob.path), sites, blob.placeholders), []


def _redirect(data: bytearray, path: str, sites, placeholders: dict | None = None) -> bytearray:
    """In the linked module: each ftrace site's `call __fentry__` relocation to its detour, its
    __mcount_loc entry's relocation to R_X86_64_NONE; each optimized site's first five bytes a
    `jmp` to its detour (a relocation added, the ones its bytes cover made R_X86_64_NONE), its
    copy's placeholder relocations pointed at what optprobe.py says; struct module's init and
    exit to ours.  The module's bytes (a relocation section that grows moves to the end)."""
    secs = read_sections(bytes(data), path)
    symtab, syms = symbols(bytes(data), secs)
    strtab = secs[symtab.link]

    def sym_name(i):
        n = syms[i][0]
        end = data.index(b"\0", strtab.offset + n)
        return data[strtab.offset + n:end].decode()
    index = {}
    for i in range(len(syms)):
        index.setdefault(sym_name(i), i)
    by_name = {sc.name: sc for sc in secs}

    def target(sym, addend):
        """(section index, offset) a relocation's S + A names."""
        _, _, _, shndx, value, _ = syms[sym]
        return (shndx, value + addend) if 0 < shndx < SHN_LORESERVE else None

    def relas_of(sec_name):
        r = next((sc for sc in secs if sc.type == SHT_RELA and secs[sc.info].name == sec_name), None)
        return [] if r is None else list(relas(data, r))

    def set_rela(at, off, sym, typ, addend):
        RELA.pack_into(data, at, off, (sym << 32) | typ, addend)

    def section_symbol(name):
        shndx = by_name[name].index
        return next(i for i, (_, info, _, sh, _, _) in enumerate(syms) if info & 0xF == 3 and sh == shndx)
    # The copies' fields first: a carried relocation is read before a jump's bytes drop it.
    table: dict[str, dict] = {}         # section -> {offset: (symbol, type, addend)}, read once

    def rela_at(sec_name, off):
        if sec_name not in table:
            table[sec_name] = {o2: (s2, t2, a2) for _, o2, s2, t2, a2 in relas_of(sec_name)}
        return table[sec_name].get(off)
    ours = [r for sec_name in (".text.kprewrite", ".rodata.kprewrite") for r in relas_of(sec_name)]
    for at, r_off, sym, _, _ in ours if placeholders else []:
        fl = placeholders.get(sym_name(sym))
        if fl is None:
            continue
        if fl.carry is not None:
            orig = rela_at(fl.section, fl.carry)
            if orig is None:
                raise KprewriteError(f"{path}: {fl.section}+{fl.carry:#x} has no relocation to carry")
            set_rela(at, r_off, orig[0], orig[1], orig[2] + fl.addend)
        else:
            set_rela(at, r_off, section_symbol(fl.section), R_X86_64_PC32, fl.addend)
    extra: dict[str, list] = {}
    by_offset: dict[str, dict] = {}     # section -> {offset: [where its relocations are]}
    mcount = None                       # __mcount_loc's entries by the place each names
    for i, sec, off, decision in sites:
        if decision == BREAKPOINT:            # the breakpoint, in place from load (kp_module_init())
            data[by_name[sec].offset + off] = 0xCC
            continue
        if decision == OPTIMIZED:
            toff = by_name[sec].offset + off
            data[toff:toff + 5] = b"\xe9\0\0\0\0"
            if sec not in by_offset:
                by_offset[sec] = {}
                for at, r_off, _, typ, _ in relas_of(sec):
                    by_offset[sec].setdefault(r_off, []).append((at, FIELD_SIZE.get(typ, 4)))
            # the fields the jump's bytes cover (one starting up to 7 bytes before: a quad)
            for r_off in range(off - 7, off + 5):
                for at, size in by_offset[sec].get(r_off, []):
                    if r_off + size > off:
                        set_rela(at, r_off, 0, R_X86_64_NONE, 0)
            extra.setdefault(sec, []).append((off + 1, index[f"kp_detour_{i}"], R_X86_64_PC32, -4))
            continue
        shndx = by_name[sec].index
        done = False
        for at, r_off, sym, typ, addend in relas_of(sec):
            if r_off == off + 1 and sym_name(sym) == "__fentry__":
                set_rela(at, r_off, index[f"kp_detour_{i}"], typ, addend)
                done = True
        if not done:
            raise KprewriteError(f"{path}: {sec}+{off:#x} has no `call __fentry__` relocation")
        if mcount is None:              # read once: only this loop changes __mcount_loc's entries
            mcount = {}
            for at, r_off, sym, _, addend in relas_of("__mcount_loc"):
                mcount.setdefault(target(sym, addend), []).append((at, r_off))
        for at, r_off in mcount.get((shndx, off), []):
            set_rela(at, r_off, 0, R_X86_64_NONE, 0)
    for at, r_off, sym, typ, addend in relas_of(THIS_MODULE):
        n = sym_name(sym)
        if n in ("init_module", "cleanup_module"):
            set_rela(at, r_off, index["kp_module_init" if n == "init_module" else "kp_module_exit"],
                     typ, addend)
    return _append_relas(data, path, secs, extra)


