"""AArch64's own safety rules, registered from this folder (rewriter/safety.py's
rules() reads RULES here): each checked in this back end, proven under qemu-aarch64 by
tests/test_aarch64_safety_rules.py."""
from __future__ import annotations

from ...safety import KERNEL, OURS, Rule

RULES = [
    Rule("exclusive_monitor",
         "no probe inside an ldxr ... stxr sequence (arm64 is_probed_address_atomic()): a trap, or "
         "a detour's handler, clears the exclusive monitor",
         "arch.aarch64.optprobe:can_probe_insn", KERNEL, "test_exclusive_monitor",
         "a breakpoint between an ldxr and its stxr: each trap's return clears the monitor, the "
         "stxr fails and the loop retries forever (timeout)", arch="aarch64"),
    Rule("pc_relative",
         "a PC-relative instruction (adr, adrp, ldr literal, b, bl, b.cond, cbz, tbz) copied to a "
         "detour is re-encoded for its new address (simulate-insn.c, Frida's relocator)",
         "arch.aarch64.emit:relocate", OURS, "test_pc_relative",
         "an adrp copied unchanged computes the detour's page: the program reads another word, "
         "prints another sum", arch="aarch64"),
    Rule("landing_pad",
         "in a BTI-guarded image no B is written over a landing pad (bti, paciasp): an indirect "
         "branch to it must land on one; the site is a brk instead",
         "arch.aarch64.optprobe:can_optimize", OURS, "test_landing_pad",
         "under qemu-aarch64 -cpu max the indirect call of a probed paciasp entry lands on the B: "
         "SIGILL", arch="aarch64"),
]
