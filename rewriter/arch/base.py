"""What every architecture back end provides, and the types the generic stages share.

The generic stages (resolve, analysis, planner, layout, emission, tables) see an
architecture only through this interface, as kernel/kprobes.c sees
arch/*/kernel/kprobes/ through arch_prepare_kprobe(), arch_prepare_optimized_kprobe()
and friends.  A second architecture is a folder beside x86_64/ whose package
provides an `Arch` (see x86_64/__init__.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Refusal:
    """Why a probe stays unoptimized: the check's name and the offending address."""
    check: str
    addr: int
    detail: str

    def __str__(self) -> str:
        return f"{self.check} at {self.addr:#x}: {self.detail}"


@dataclass(frozen=True)
class DcrInsn:
    """One instruction of a detoured code region, with the arch's classification."""
    addr: int
    code: bytes
    info: Any


RET, TAIL = "ret", "tail"


@dataclass(frozen=True)
class ThreadKey:
    """What identifies the running thread to the runtime's thread table, as the
    platform defines it and the arch reads it: a word at `disp` from the thread
    pointer (base "thread": a user TCB's self pointer at 0) or from the CPU's
    per-CPU base (base "cpu": a kernel's this_cpu_off, the thread being the CPU
    with preemption off).
    preempt: for base "cpu", the per-CPU offset of the preemption count the templates
    raise before reading the key and drop after the handlers (optimized_callback()'s
    preempt_disable()/preempt_enable()); resched: what preempt_enable() calls when the
    count drops to zero with a reschedule pending (None: the image cannot preempt)."""
    base: str
    disp: int
    preempt: int | None = None
    resched: int | None = None


@dataclass(frozen=True)
class Exit:
    """One way out of a function: a ret, or a tail-call jmp to `target`."""
    addr: int
    kind: str                 # RET or TAIL
    insn: DcrInsn
    target: int | None = None


@dataclass
class Exits:
    exits: list[Exit]
    refusal: Refusal | None   # an exit that cannot be hooked at all (conditional tail call...)
    parts: list               # the function and its .cold parts


class Arch(Protocol):
    """An architecture back end (a module or object with these members)."""
    name: str                 # also the runtime's folder: runtime/arch/<name>
    e_machine: int            # ELF e_machine
    r_relative: int           # the ELF relocation type of a base-relative word
    breakpoint: bytes         # the breakpoint instruction an INT3-style probe writes
    Refusal: type

    decode_function: Any      # (code, start) -> decoded function (boundaries, branches, indirect jumps, code refs)
    jumptable: Any            # resolve(image, analysis, func) -> each indirect jump's kind, targets (bounded or not)
    optprobe: Any             # adjust_kprobe_addr, can_probe_insn, can_optimize, stack_aligned_at, arith_flags_dead
    kprobe_xol: Any           # prepare, emulates_refused, number_descriptors, place_slot, slot_code, table_c: breakpoint probes out of line
    retprobe: Any             # find_exits, exit_region, return-hook emitters
    emit: Any                 # detours, templates, jump_patch, branch_rel32/retarget_patch, start-up stubs
    handler_abi: Any          # what a compiled handler reads and clobbers
    fetch_regs: Any           # register names of FETCHARGS (%ax, $argN ...), see fetch.py

    def is_branch(self, insn: DcrInsn) -> bool: ...
