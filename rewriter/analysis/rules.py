"""Which addresses may be probed and which regions jump-optimized: a target's
answer (targets/*), used by the planner.

- blacklist: registration refusals (check_kprobe_address_safe(): the kprobe
  blacklist, and for a kernel jump labels, static calls, BUG sites, alternatives);
- reserved: sites patched at load or boot (the kernel's alternatives, paravirt,
  retpoline and return sites, .smp_locks, ftrace sites, ...): a detoured region
  overlapping one is refused, naming the table (copy_optimized_instructions()'s
  *_text_reserved() checks);
- function_refusal: what refuses a whole function (a kernel function with an
  exception-table entry: can_optimize()'s search_exception_tables());
- ftrace: function-entry sites a probe takes as KPROBE_FLAG_FTRACE does;
- share_ftrace / take_ftrace: such a probe leaves the site to the kernel's ftrace and jumps
  after it (a kernel whose own tracers must keep working on the function), and whether it may
  take the site where it cannot;
- ftrace_ops_globs: a glob's probes reach functions through an ftrace_ops the image registers
  at boot (no code per site), and only functions ftrace reaches, as ftrace's own filters do;
- shared_regions: whether probes inside one region share its detour (the
  runtime then maps an ip inside a region to its copy, kp_region_ip());
- breakpoints / kretprobes: whether breakpoint probes and kretprobes exist for the target yet;
- kretprobe_exits: whether a kretprobe's exits are hooked (the user-space design), or
  every kretprobe swaps the return address for the trampoline, as the kernel's own do;
- return_jumps: addresses of `jmp`s that are returns, not tail calls (a kernel's
  `jmp __x86_return_thunk` at its .return_sites entries); a return region may cover its
  own return jump although it is reserved: the target points the table entry at the
  jump's copy in the detour (exit_region_refusal());
- kretprobe_breakpoint_exits: an exit no jump fits gets a breakpoint return hook where the
  trampoline is unsafe for its function (else the function takes the trampoline); without
  (a kernel) the function always keeps the trampoline, with the check that refused the exit;
- kretprobe_branch_exits: before that, an exit whose region jumps land in takes it, each of
  those jumps hooked as an exit of its own (a jump to the exit's hook, in its own region);
- short_jumps / evict_neighbours: a site with no room for a 5-byte jump takes a short
  jump to one in dead padding, or in a neighbouring region moved out of the way;
- retarget_branches: direct branches to a detoured region's start enter its detour;
- singlestep_breakpoint: a single-stepped instruction's copy ends with a breakpoint (the
  kernel's own kprobes since 5.14) rather than running with the trap flag;
- breakpoint_refusal: the target's own refusal of a breakpoint site (a module's, whose
  out-of-line copy must carry the module's relocations);
- fast_forms: whether detours may inline the dispatch (templates: the thread lookup, the
  hit counter and the handler call in the detour itself).  Clean calls (no pt_regs for a
  handler that never reads it, through the runtime's shared clean entry) are always allowed.
- light_hits / red_zone: in an image where no handler can run, templates only count
  hits; where the ABI's red zone is free (a user function's entry), without moving the stack pointer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .. import safety
from .blacklist import BlacklistEntry, Index

# The reserved entries of an exception table (the faulting instruction, its fixup): not
# patched at boot, but an instruction copied to a detour faults where no entry names it.
EX_TABLE = ("__ex_table", "__ex_table fixup")


NEVER_RETURNS = "never returns to its caller"
RETURNS_TWICE = "returns twice (a return handler would fire for a call that never entered)"
SWITCHES = "does not return to its caller (it switches the stack)"


@dataclass
class Rules:
    blacklist: Index
    reserved: Index = field(default_factory=lambda: Index([]))
    ftrace: dict = field(default_factory=dict)          # site address -> what to drop from the image's table
    function_refusal: Callable | None = None            # (analysis, func) -> arch Refusal | None
    breakpoints: bool = True
    kretprobes: bool = True
    kretprobe_exits: bool = True
    return_jumps: frozenset = frozenset()
    kretprobe_breakpoint_exits: bool = True
    # A tail call through a pointer leaves the instances pending when its target turns out
    # at run time to be a hooked entry (kp_kretprobe_tail_pointer(), a user process), else
    # the return address is swapped for the trampoline (the kernel's way, every time).
    kretprobe_pointer_tails: bool = False
    # An exit whose region other jumps land in (a `ret` two `je` reach, with no padding
    # after it) takes its region anyway, each of those jumps hooked as an exit of its own
    # (planner/returns.py's _branch_exits()), before the breakpoint or the trampoline.
    kretprobe_branch_exits: bool = False
    # A detour runs a post_handler after the copied instruction (beyond the kernel); off: the
    # kernel's optimize_kprobe() rule, no kprobe with a post_handler is optimized.
    optimized_post_handler: bool = True
    # A boosted breakpoint copy runs a post_handler through a probe stub after it (beyond the
    # kernel); off: setup_singlestep()'s rule, a kprobe with a post_handler is single-stepped.
    boost_post_handler: bool = True
    # A kretprobe's entry takes the clean call where its entry_handler never reads regs (the
    # runtime's kp_kretprobe_clean_entry passes the return-address slot instead of pt_regs).
    kretprobe_clean_entry: bool = False
    # Probes on consecutive instructions share one detour (planner.sites.share_regions())
    # instead of the second one being refused inside the first one's region.
    shared_regions: bool = False
    # A site with no room for a 5-byte jump takes a short jump to one in dead
    # padding nearby (planner.short_jumps.short_jumps()).
    short_jumps: bool = False
    # With no dead padding in reach, the short jump's slot is made in a neighbouring
    # region moved to a detour of its own (planner.short_jumps.evict_neighbour(), E9Patch's T3).
    evict_neighbours: bool = False
    # A direct branch to a detoured region's start names the detour instead
    # (planner.retarget.retarget_branches()).
    retarget_branches: bool = False
    singlestep_breakpoint: bool = False
    # With breakpoint sites, the image's system calls that set a signal mask or action go
    # to the runtime, which keeps SIGTRAP unblocked and its handler ours (a user process:
    # arch.signal_syscalls(), planner.signal_syscalls()).
    signal_syscalls: bool = False
    # (arch, Site) -> arch Refusal | None: why a breakpoint site the target cannot write is
    # refused (a module's out-of-line copy that cannot carry its relocations), so `check` says so.
    breakpoint_refusal: Callable | None = None
    fast_forms: bool = True          # inlined templates (else detours call the runtime's shared entries)
    # In an image with no handler at all, a template only counts the hit (emit.light_detour).
    light_hits: bool = False
    # The ABI's red zone (below the stack pointer; x86-64: 128 bytes) is free at a function
    # entry: a detour may save registers there without moving the stack pointer (a user ELF; a kernel has none).
    red_zone: bool = False
    # kretprobe_blacklist (the kernel's holds __switch_to): the target's functions whose
    # return does not match their call, name -> why (NEVER_RETURNS, RETURNS_TWICE, SWITCHES).
    kretprobe_blacklist: dict = field(default_factory=dict)
    jump_target_sources: list = field(default_factory=list)   # analysis.TargetSource, beyond the defaults
    # Read indirect jumps (jump tables, stored code pointers) instead of refusing their
    # functions as the kernel does; off where decoding every function costs too much.
    read_indirect_jumps: bool = True
    # The bytes of an ftrace site a probe's jump goes past, leaving the site to the kernel's
    # ftrace (planner.sites.share_ftrace_site()); 0: the jump takes the site.
    share_ftrace: int = 0
    # Where a site cannot be shared, the jump may take it (not where the kernel rewrites the
    # site at boot whatever it holds: arm64's ftrace_init_nop()); else the probe is refused.
    take_ftrace: bool = True
    # A site whose probes all come from globs is reached through an ftrace_ops registered at
    # boot (planner.sites.optimize_site(): Site.ftrace_ops), a glob's probe off an ftrace site
    # is skipped: room for a detour per function there is not (arm64's ~54 KiB).
    ftrace_ops_globs: bool = False
    # Every trace event's hit passes the probed context's pt_regs, whatever its fetch args read:
    # perf's samples and BPF programs on the event read them (a kernel's events).
    events_pt_regs: bool = False

    def region_refusal(self, arch, analysis, func, lo: int, hi: int):
        """Why the region [lo, hi) of func cannot be detoured, or None."""
        if self.function_refusal is not None:
            r = self.function_refusal(analysis, func)
            if r is not None:
                return r
        e = next(iter(self.reserved_sites(lo, hi)), None)
        if e is not None:
            return arch.Refusal(e.reason, e.start, f"the region [{lo:#x}, {hi:#x}) overlaps a site patched at boot "
                                                   f"({e.symbol})")
        return None

    def reserved_sites(self, lo: int, hi: int) -> list[BlacklistEntry]:
        """The reserved entries overlapping [lo, hi), by start: sites the kernel patches at
        boot or looks up by address (alternatives, paravirt, retpolines, return sites, static
        calls, jump labels, .smp_locks, ftrace and BUG sites) and instructions with an
        exception-table entry, each kept only while its safety rule (boot_patched_tables,
        exception_tables) is on."""
        return [e for e in self.reserved.all_overlapping(lo, hi)
                if (safety.enabled("exception_tables") if e.reason in EX_TABLE
                    else safety.enabled("boot_patched_tables"))]

    def exit_region_refusal(self, arch, analysis, func, lo: int, hi: int, exit_addr: int):
        """Why the return region [lo, hi) ending with the exit at exit_addr cannot be
        detoured, or None: region_refusal(), except that the exit's own return jump
        (return_jumps) may lie in it, alone among the reserved sites on its bytes."""
        if self.function_refusal is not None:
            r = self.function_refusal(analysis, func)
            if r is not None:
                return r
        for e in self.reserved_sites(lo, hi):
            if e.start == exit_addr and exit_addr in self.return_jumps and e.reason == ".return_sites":
                continue
            return arch.Refusal(e.reason, e.start, f"the return region [{lo:#x}, {hi:#x}) overlaps a site patched "
                                                   f"at boot ({e.symbol})")
        return None


__all__ = ["Rules", "BlacklistEntry", "Index"]
