"""The safety rules: every check that keeps a rewritten program correct, the
kernel's (kernel/kprobes.c and its arch/*/kernel/kprobes/) and kprewrite's own, with
where each lives and the test whose program breaks without it.

Each rule with a switch is consulted at its check as `safety.enabled("name")`.
A rule is switched off only for the test suite, to prove that it matters: the
environment variable KPREWRITE_UNSAFE_OFF=rule1,rule2 is honoured only when
KPREWRITE_TEST_SUITE is set too (tests/conftest.py sets it); in any other run
setting KPREWRITE_UNSAFE_OFF is refused (the CLI exits with a one-line error
before doing anything, and the library raises the same KprewriteError).

tests/test_safety_rules.py holds, for each rule with a switch, a small program
that the rewrite with the rule on leaves printing what the original prints and
that crashes, hangs or prints something else with the rule off; and it checks
that this registry, the `safety.enabled()` calls in rewriter/ and its own test
functions agree.  A rule with no such program says why in `unproven`.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from .errors import KprewriteError

OFF_VAR = "KPREWRITE_UNSAFE_OFF"
SUITE_VAR = "KPREWRITE_TEST_SUITE"

KERNEL, OURS = "kernel", "ours"


@dataclass(frozen=True)
class Rule:
    name: str
    description: str          # one line
    where: str                # "module:function" holding the check: a module under rewriter/, or
                              # "<arch>.module" under each back end, rewriter/arch/<arch>/
    origin: str               # KERNEL (the kernel's own rule) or OURS (kprewrite's, beyond the kernel)
    test: str | None = None   # tests/test_safety_rules.py's test whose program breaks with the rule off
    breaks: str = ""          # what that program does with the rule off
    unproven: str = ""        # no program yet (test None): why
    switch: bool = True       # consulted as safety.enabled(name) at `where`


RULES: dict[str, Rule] = {r.name: r for r in [
    # --- the kernel's -------------------------------------------------------------------------
    Rule("can_optimize",
         "a detoured region lies inside one function and passes every check below (opt.c can_optimize())",
         "<arch>.optprobe:can_optimize", KERNEL, switch=False,
         unproven="an umbrella: its parts are the rules function_bounds, jump_into_region, indirect_jump, "
                  "boostable, call_in_region, direction_flag and rsp_relative_call, each proven on its own"),
    Rule("jump_into_region",
         "no known jump target (the JTPR) lies inside a region after its first byte",
         "<arch>.optprobe:can_optimize", KERNEL, "test_jump_into_region",
         "a loop's backward branch lands inside the probe's 5-byte jump: SIGSEGV or SIGILL"),
    Rule("indirect_jump",
         "a function with an indirect jump whose targets are not all known is not jump-optimized "
         "where the jump may land inside the region (insn_is_indirect_jump())",
         "<arch>.optprobe:can_optimize", KERNEL, "test_indirect_jump",
         "a computed jump lands inside the probe's 5-byte jump: SIGSEGV or SIGILL"),
    Rule("function_bounds",
         "a region stays inside its function, or runs on only into padding after it that nothing "
         "names (opt.c: the region inside one function)",
         "<arch>.optprobe:can_optimize", KERNEL, switch=False,
         unproven="switched off, it broke nothing: the next function's start is a known jump target "
                  "(its symbol, its callers, a pointer to it), so jump_into_region refuses the same "
                  "region; it stands alone only for code nothing names, which no program reaches"),
    Rule("call_in_region",
         "a call in a region is its last instruction (the kernel takes none): a call inside would "
         "return into the jump's bytes",
         "<arch>.optprobe:copy_region", OURS, "test_call_in_region",
         "`call *%rax` 2 bytes into the region returns into the middle of the 5-byte jump: SIGSEGV"),
    Rule("boostable",
         "every instruction of a region is boostable (can_boost()) or relocatable: a copy behaves "
         "the same at another address followed by more code",
         "<arch>.optprobe:copy_region", KERNEL, "test_boostable",
         "a copied `loop rel8` jumps relative to the detour: SIGSEGV or garbage"),
    Rule("can_probe",
         "no probe on an instruction the kernel cannot probe (int3, ud2, int n...: can_probe())",
         "planner.register:register_refusal", KERNEL, "test_can_probe",
         "a ud2 run out of line traps at another address: the program's trap table (as a kernel's "
         "BUG table) does not know it"),
    Rule("blacklist",
         "no probe in a blacklisted place (.kprobes.text, noinstr, NOKPROBE_SYMBOL, PLT stubs, the "
         "signal return trampoline, kprewrite's own runtime)",
         "planner.register:register_refusal", KERNEL, switch=False,
         unproven="switched off (tried on a static binary's signal return trampoline, the FDE one byte "
                  "before __restore_rt), nothing broke: glibc's lea of __restore_rt makes it a known "
                  "target, so jump_into_region leaves an int3 on a nop never run; the other entries "
                  "matter for recursion through a handler or a kernel's entry code, not shown yet"),
    Rule("exception_tables",
         "a kernel function with an exception-table entry is not jump-optimized "
         "(can_optimize()'s search_exception_tables())",
         "rules:Rules.region_refusal", KERNEL, switch=False,
         unproven="kernel only: a boot that faults in a copied instruction; no kernel-boot program yet"),
    # --- ours ---------------------------------------------------------------------------------
    Rule("red_zone",
         "a light detour keeps registers in the red zone below %rsp only at a function's entry, "
         "never in its middle nor in a .cold part, where the function may be using it",
         "<arch>.optprobe:red_zone_free_at", OURS, "test_red_zone",
         "a leaf keeping data at -8(%rsp) across the probe reads the detour's saved %rax: wrong sum"),
    Rule("lsda_landing_pads",
         "C++ landing pads (the LSDA's call-site table) are known jump targets",
         "analysis:landing_pad_targets", OURS, "test_lsda_landing_pads",
         "the unwinder lands inside the probe's 5-byte jump: SIGTRAP"),
    Rule("jump_table_bounds",
         "a jump table's entries are trusted as its jump's only targets only when its index is "
         "bounded on every path to the jump",
         "<arch>.jumptable:_bound", OURS, "test_jump_table_bounds",
         "an entry past the bound of one path is no known target, and a region covers it: SIGSEGV"),
    Rule("return_regions",
         "a return hook's region (grown backwards from a ret) holds no jump target but at its start",
         "<arch>.retprobe:exit_region", OURS, "test_return_regions",
         "a branch to the ret lands inside the return hook's 5-byte jump: SIGSEGV or SIGILL"),
    Rule("cold_parts",
         "no kretprobe on a .cold part: it is entered by a jump with its parent's frame live, "
         "and has no return address of its own",
         "planner.register:kretprobe_refusal", OURS, "test_cold_parts",
         "the return-address swap overwrites the parent's saved %rbx: it loops (timeout)"),
    Rule("entry_frame",
         "a kretprobe's entry is where a call lands: the FDE's rule there is CFA = %rsp+8 with the "
         "return address at CFA-8 (a stripped cold part's FDE starts mid-frame)",
         "<arch>.retprobe:entry_frame_refusal", OURS, switch=False,
         unproven="no switch yet: tests/test_kretprobe_floor.py rewrites a stripped hot/cold split "
                  "library with a kretprobe on every function and checks the output; before the rule, "
                  "the return-address swap at a cold block's \"entry\" overwrote its parent's frame "
                  "and the program looped"),
    Rule("trampoline_unsafe",
         "an exit no jump fits takes the return-address trampoline (instead of a breakpoint return "
         "hook) only where the function's CFA rules prove no instruction addresses its return-address "
         "slot, and where it calls nothing if the image unwinds exceptions (the trampoline has no FDE)",
         "<arch>.retprobe:trampoline_refusal", OURS, switch=False,
         unproven="no switch yet: tests/test_kretprobe_floor.py shows both sides (a function with no "
                  "CFI keeps its breakpoint, with the reason; those with CFI take the trampoline and "
                  "return what the breakpoint oracle sees); no program yet breaks with it off"),
    Rule("rsp_relative_call",
         "a region does not end with a call through %rsp or an %rsp-relative operand (the detour "
         "pushes the return address before the emulated call reads it)",
         "<arch>.optprobe:_indirect_call_relocatable", OURS, "test_rsp_relative_call",
         "the copied `call *8(%rsp)` reads one slot off: SIGSEGV"),
    Rule("direction_flag",
         "a function that sets DF (std) is not jump-optimized: the detour runs C code, which the ABI "
         "lets assume DF = 0",
         "<arch>.optprobe:can_optimize", OURS, "test_direction_flag",
         "the handler's `rep stos` runs backwards and tramples the stack: SIGSEGV or wrong output"),
    Rule("shared_regions",
         "a probe shares a head's region only at one of its instruction boundaries and, with a "
         "post_handler, not on a branch (the post_handler would run after the branch, or not at "
         "all): else the whole region goes to INT3",
         "planner.sites:split_segments", OURS, "test_shared_regions",
         "a rider's post_handler on a jcc runs only when the jcc falls through: fewer post lines"),
    Rule("probe_in_region",
         "another probe's bytes inside a region keep the region's site unoptimized (the kernel's "
         "pre-optimization check), unless the region is shared",
         "planner:plan", KERNEL, switch=False,
         unproven="not switched: a user image shares such regions (shared_regions), so the check is "
                  "reached only in a kernel, and a kernel boot was not set up for it"),
    Rule("eviction",
         "an evicted neighbour's region holds no exit of its function (no ret, no indirect or "
         "outward jump): a kretprobe's return hook could not see it run in the copy",
         "<arch>.optprobe:can_evict", OURS, "test_eviction",
         "a kretprobe'd neighbour's ret runs in the evicted copy (its return hook, an int3 at the "
         "ret, lies under the probe's jump): the return handler never runs, or SIGSEGV"),
    Rule("retargeting",
         "a direct branch is retargeted to a detour only where the decoding vouches for it: in a "
         "function decoded to its end, at an instruction boundary, in code an FDE describes",
         "planner.retarget:retarget_branches", OURS, "test_retargeting",
         "bytes in .text that only look like a `call` of the probed function (data, no FDE) are "
         "rewritten: the program prints other bytes"),
    Rule("boot_patched_tables",
         "no region or int3 over a site the kernel patches at boot (alternatives, paravirt, "
         "retpolines, return sites, .smp_locks, ftrace sites)",
         "rules:Rules.region_refusal", KERNEL, switch=False,
         unproven="kernel only: needs a kernel boot to show the patcher overwriting a jump"),
]}


@functools.lru_cache(maxsize=8)
def _switched_off(raw: str, suite: bool) -> frozenset:
    if not suite:
        raise KprewriteError(f"{OFF_VAR} switches safety rules off for the test suite only; "
                             f"unset it (it is refused outside tests/conftest.py's runs)")
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = sorted(n for n in names if n not in RULES or not RULES[n].switch)
    if unknown:
        raise KprewriteError(f"{OFF_VAR}: no switchable safety rule named {', '.join(unknown)}")
    return names


def switched_off() -> frozenset:
    """The rules switched off for this run (empty in any normal run; refused outside the suite)."""
    raw = os.environ.get(OFF_VAR)
    if not raw:
        return frozenset()
    return _switched_off(raw, bool(os.environ.get(SUITE_VAR)))


def enabled(name: str) -> bool:
    """Whether the safety rule `name` is on: always, but in the test suite's rule-off runs."""
    if name not in RULES:
        raise ValueError(f"safety.enabled(): no rule named {name!r} in rewriter/safety.py")
    raw = os.environ.get(OFF_VAR)
    return not raw or name not in _switched_off(raw, bool(os.environ.get(SUITE_VAR)))


def check_environment() -> None:
    """Raise KprewriteError if KPREWRITE_UNSAFE_OFF is set outside the test suite (the CLI
    calls this first)."""
    switched_off()
