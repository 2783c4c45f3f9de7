"""The safety rules: every check that keeps a rewritten program correct, the
kernel's (kernel/kprobes.c and its arch/*/kernel/kprobes/) and kprewrite's own, with
where each lives and the test whose program breaks without it.

Each rule with a switch is consulted at its check as `safety.enabled("name")`.
A rule is switched off only for the test suite, to prove that it matters: the
environment variable KPREWRITE_UNSAFE_OFF=rule1,rule2 is honoured only when
KPREWRITE_TEST_SUITE is set too (tests/conftest.py sets it); in any other run
setting KPREWRITE_UNSAFE_OFF is refused (the CLI exits with a one-line error
before doing anything, and the library raises the same KprewriteError).

can_optimize() (opt.c's, and <arch>.optprobe's) is not a rule of its own but the place
where the jump optimizer's rules are checked: function_bounds, decode, direction_flag,
indirect_jump and jump_into_region in its body, boostable, call_in_region and
rsp_relative_call in copy_region().  Its one remaining check, MAX_OPTIMIZED_LENGTH
(region_size), bounds the kernel's fixed buffer, not correctness: a longer region is copied
as faithfully.  So it has no entry: switching the umbrella off would only switch off
rules that are proven one by one.

A back end's own rules (those only its code checks) sit in its folder,
rewriter/arch/<arch>/safety_rules.py, and rules() adds them to RULES: a new
architecture registers its rules without editing this file.

tests/test_safety_rules.py holds, for each rule with a switch, a small program
that the rewrite with the rule on leaves printing what the original prints and
that crashes, hangs or prints something else with the rule off; and it checks
that this registry, the `safety.enabled()` calls in rewriter/ and its own test
functions agree.  A kernel's rule (`kernel=True`) is proven instead by
tests/kernel/test_kernel_safety_rules.py: a clean boot with every rule on, an oops with
the rule off.  A rule with no such program says why in `unproven`.  docs/safety.md
tabulates them.
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
    test: str | None = None   # the test whose program breaks with the rule off: in tests/test_safety_rules.py,
                              # or (kernel) in tests/kernel/test_kernel_safety_rules.py
    breaks: str = ""          # what that program does with the rule off
    unproven: str = ""        # no program yet (test None): why
    switch: bool = True       # consulted as safety.enabled(name) at `where`
    kernel: bool = False      # proven by a kernel boot: `test` is in tests/kernel/test_kernel_safety_rules.py
    arch: str | None = None   # a back end's own rule (`where` in rewriter/arch/<arch>), proven under
                              # qemu-<arch>: `test` is in tests/test_<arch>_safety_rules.py


RULES: dict[str, Rule] = {r.name: r for r in [
    # --- the kernel's -------------------------------------------------------------------------
    Rule("decode",
         "a function is decoded from its start to its end before a region in it is jump-optimized: "
         "the instruction boundaries and jump targets the other rules read come from that decoding",
         "<arch>.optprobe:can_optimize", KERNEL, "test_decode",
         "a byte that is no instruction, jumped over, stops the decoding: the loop branch after "
         "it, back inside the probe's 5-byte jump, is never read, and lands there: SIGSEGV"),
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
         "<arch>.optprobe:can_optimize", KERNEL, "test_function_bounds",
         "a 4-byte function's region runs on into the nameless code after it, which the program "
         "calls through a pointer computed at run time: the call lands inside the 5-byte jump "
         "and crashes (SIGTRAP)"),
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
         "signal return trampoline, kprewrite's own runtime, the inside of an ftrace site)",
         "planner.register:register_refusal", KERNEL, "test_blacklist",
         "a NOKPROBE_SYMBOL function running on a stack with no room below its return address "
         "(as a kernel's entry code before the stack switch) is probed: the detour's first "
         "write below %rsp faults in the guard page, SIGSEGV"),
    Rule("exception_tables",
         "no region or breakpoint over a kernel instruction with an exception-table entry (its copy "
         "would fault where no entry names it), and, as can_optimize()'s "
         "search_exception_tables(), no jump-optimized probe in a function with one",
         "targets.linux_kernel.reserved:rules", KERNEL, "test_exception_tables",
         "kernel: a jump-optimized probe on strncpy_from_user's word load; a handler reads user "
         "address 16 with strncpy_from_user_nofault(): the load faults in the detour's copy, "
         "which no fixup names, and the kernel oopses", kernel=True),
    # --- ours ---------------------------------------------------------------------------------
    Rule("red_zone",
         "a light detour keeps registers in the red zone below %rsp (AArch64's templates use x16/x17, "
         "IP0/IP1, unsaved) only at a function's entry, never in its middle nor in a .cold part, where "
         "the function may be using it",
         "<arch>.optprobe:red_zone_free_at", OURS, "test_red_zone",
         "a leaf keeping data at -8(%rsp) across the probe reads the detour's saved %rax: wrong sum"),
    Rule("lsda_landing_pads",
         "C++ landing pads (the LSDA's call-site table) are known jump targets",
         "analysis.functions:landing_pad_targets", OURS, "test_lsda_landing_pads",
         "the unwinder lands inside the probe's 5-byte jump: SIGTRAP"),
    Rule("jump_table_bounds",
         "a jump table's entries are trusted as its jump's only targets only when its index is "
         "bounded on every path to the jump",
         "<arch>.jumptable:_bound", OURS, "test_jump_table_bounds",
         "an entry past the bound of one path is no known target, and a region covers it: SIGSEGV"),
    Rule("return_regions",
         "a return hook's region (grown backwards from a ret) holds no jump target but at its start, "
         "unless every jump landing there is a plain jmp/jcc of the function hooked as an exit of its own",
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
         "<arch>.retprobe:entry_frame_refusal", OURS, "test_entry_frame",
         "the return-address swap at the unnamed cold block's entry overwrites its parent's saved "
         "%rbx: it loops (timeout) or prints another sum"),
    Rule("trampoline_unsafe",
         "an exit no jump fits takes the return-address trampoline (instead of a breakpoint return "
         "hook) only where the function's CFA rules prove no instruction addresses its return-address "
         "slot, and where it calls nothing if the image unwinds exceptions (the trampoline has no FDE); "
         "a function whose exits cannot all be named has its kretprobe refused there (planner.register)",
         "<arch>.retprobe:trampoline_refusal", OURS, "test_trampoline_unsafe",
         "the function reads its return-address slot and sees the trampoline: prints ra_ok=0"),
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
         "all): else the whole region goes to a breakpoint",
         "planner.sites:split_segments", OURS, "test_shared_regions",
         "a rider's post_handler on a jcc runs only when the jcc falls through: fewer post lines"),
    Rule("probe_in_region",
         "another probe's bytes inside a region keep the region's site unoptimized (the kernel's "
         "pre-optimization check), unless the region is shared",
         "planner:plan", KERNEL, "test_probe_in_region",
         "kernel (where regions are not shared): probes at do_sys_openat2+0x5 and +0x7 both get "
         "5-byte jumps, the second written over the first's: the first open jumps to garbage, "
         "and the kernel oopses", kernel=True),
    Rule("eviction",
         "an evicted neighbour's region holds no exit of its function (no ret, no indirect or "
         "outward jump): a kretprobe's return hook could not see it run in the copy",
         "<arch>.optprobe:can_evict", OURS, "test_eviction",
         "a kretprobe'd neighbour's ret runs in the evicted copy (its return hook, a breakpoint at the "
         "ret, lies under the probe's jump): the return handler never runs, or SIGSEGV"),
    Rule("retargeting",
         "a direct branch is retargeted to a detour only where the decoding vouches for it: in a "
         "function decoded to its end, at an instruction boundary, in code an FDE describes",
         "planner.retarget:retarget_branches", OURS, "test_retargeting",
         "bytes in .text that only look like a `call` of the probed function (data, no FDE) are "
         "rewritten: the program prints other bytes"),
    Rule("boot_patched_tables",
         "no region or breakpoint over a site the kernel patches at boot or looks up by its address "
         "(alternatives, paravirt, retpolines, return sites, static calls, jump labels, "
         ".smp_locks, ftrace sites, BUG sites)",
         "analysis.rules:Rules.reserved_sites", KERNEL, "test_boot_patched_tables",
         "kernel: a jump-optimized probe at do_exit+0x2d, over the paravirt call the "
         "alternatives patch at boot: apply_alternatives() writes over the jump, and the first "
         "exit jumps to garbage", kernel=True),
]}


@functools.lru_cache(maxsize=1)
def rules() -> dict[str, Rule]:
    """Every rule: the generic registry (RULES) and each back end's own, which its folder
    registers (rewriter/arch/<arch>/safety_rules.py's RULES, read when first asked: an
    arch's checks run after its package is imported)."""
    from importlib import import_module
    from importlib.util import find_spec

    from .arch import MACHINES
    out = dict(RULES)
    for machine in sorted(set(MACHINES.values())):
        name = f"{__package__}.arch.{machine}.safety_rules"
        if find_spec(name) is not None:
            out.update({r.name: r for r in import_module(name).RULES})
    return out


def _switched_off(raw: str, suite: bool) -> frozenset:
    if not suite:
        raise KprewriteError(f"{OFF_VAR} switches safety rules off for the test suite only; "
                             f"unset it (it is refused outside tests/conftest.py's runs)")
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    every = rules()
    unknown = sorted(n for n in names if n not in every or not every[n].switch)
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
    if name not in RULES and name not in rules():
        raise ValueError(f"safety.enabled(): no rule named {name!r} in rewriter/safety.py")
    raw = os.environ.get(OFF_VAR)
    return not raw or name not in _switched_off(raw, bool(os.environ.get(SUITE_VAR)))


def check_environment() -> None:
    """Raise KprewriteError if KPREWRITE_UNSAFE_OFF is set outside the test suite (the CLI
    calls this first)."""
    switched_off()
