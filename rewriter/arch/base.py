"""What every architecture back end provides, and the types the generic stages share.

The generic stages (resolve, analysis, planner, layout, emission, tables) see an
architecture only through this interface, as kernel/kprobes.c sees
arch/*/kernel/kprobes/ through arch_prepare_kprobe(), arch_prepare_optimized_kprobe()
and friends.  A second architecture is a folder beside x86_64/ whose package
provides an `Arch` (see x86_64/__init__.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol


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


class FtraceSiteInsn(DcrInsn):
    """An ftrace site as the first instruction of a DCR (ftrace_site_insn()): the nop it is
    when not traced.  A kernel's detour copies nothing for it (the next copy, or the jump
    back, resumes past it)."""


@dataclass(frozen=True)
class SignalSyscall:
    """A system call setting a signal mask or action (rt_sigprocmask, rt_sigaction) that
    a rewritten user image with breakpoint probes sends to the runtime: its bytes from
    addr (the load of the call's number) to end (after the system call instruction)."""
    addr: int
    end: int
    nr: int             # 0: known at run time only (the C library's syscall(2))
    insns: tuple        # DcrInsn: the number's load, what sets the arguments, the system call


class LinkSym(int):
    """A runtime symbol's placeholder address while the layout sizes the detours
    (emission.Far): an int that remembers the symbol's name and the list of links
    of the detour being built.  An arch with an Emit.relink logs there
    each field of the code that reaches the symbol (x86-64: every rel32), so
    emission patches the layout's code for the linked runtime (the linker's
    relocations, in small) rather than building each detour again.  An offset
    added keeps the name (a probe is kp_probes + its slot's offset)."""
    name: str
    links: list       # address of a field, its symbol's name, ...: as the arch logs them (flat:
                      # a layout keeps one tuple of them a detour, not one a field, for the collector)

    @staticmethod
    def of(value: int, name: str, links: list) -> "LinkSym":
        s = LinkSym(value)      # (no __new__ of its own: one is made per reference laid out)
        s.name, s.links = name, links
        return s

    def __add__(self, offset: int) -> "LinkSym":
        return LinkSym.of(int(self) + offset, self.name, self.links)

    __radd__ = __add__


RET, TAIL = "ret", "tail"
COND = "cond"                 # a conditional direct jump (RetProbe.exit_kind(); not an Exit's kind)


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
    count drops to zero with a reschedule pending (None: the image cannot preempt).
    red_zone: whether the platform's code may keep data below the stack pointer (the
    psABI's red zone; not a kernel, built without one), which a detour's call into the
    runtime must step over (x86-64: emit.probe_stub(); without, emit.short_stub())."""
    base: str
    disp: int
    preempt: int | None = None
    resched: int | None = None
    red_zone: bool = True


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


# Breakpoint-probe modes, in the kernel's words (an arch uses the subset it has):
# emulate -- the trap handler does the instruction's work from a descriptor
# (x86 prepare_emulation(), arm64 simulate-insn.c); boost -- a copy followed by a
# jump back, one trap a hit (x86 can_boost()); single-step -- a copy run with a
# trace trap after it (x86 resume_singlestep(), arm64's XOL slot).
EMULATE, BOOST, SINGLESTEP = "emulate", "boost", "single-step"


class Xol(Protocol):
    """How one breakpoint site runs its probed instruction (the arch's prepare()):
    plan data, no address (where its slot goes is the layout's XolSlot)."""
    mode: str                 # EMULATE, BOOST or SINGLESTEP
    insn: DcrInsn             # the probed instruction


@dataclass(frozen=True)
class XolSlot:
    """Where the layout put a boosted or single-stepped site's out-of-line slot (the
    insn slot get_insn_slot() gives the kernel), as the arch's place_slot() found it."""
    addr: int                 # where the copy is
    size: int
    post: int                 # where the jump back is (after a boosted site's post stub)
    ss_end: int = 0           # single-step: the address right after the copy
    desc: int = 0             # the site's descriptor index (number_descriptors())


class OptProbe(Protocol):
    """arch/*/kernel/kprobes/opt.c at rewrite time: which instructions may be
    probed, which regions jump-optimized, and the facts a detour's form needs."""
    SHORT_JUMP_SIZE: int | None   # a short jump to a JUMP_SIZE one in reach (E9Patch T1); None: none

    def adjust_kprobe_addr(self, image, sym_addr: int, offset: int) -> int:
        """arch_adjust_kprobe_addr(): a function's entry past its landing pad."""

    def can_probe_insn(self, image, addr: int) -> Refusal | None:
        """can_probe(): the instruction at addr may take a breakpoint."""

    def can_optimize(self, image, analysis, func, addr: int, min_end: int | None = None,
                     jump_size: int = 5) -> list[DcrInsn] | Refusal:
        """can_optimize(): the detoured code region from addr, or why not."""

    def short_jump_slot(self, image, analysis, addr: int, busy) -> int | None:
        """Dead padding within a short jump's reach of addr for a JUMP_SIZE jump."""

    def evict_candidates(self, image, analysis, addr: int) -> Iterable[tuple[Any, int]]:
        """(function, start) of neighbouring regions a short jump at addr reaches."""

    def can_evict(self, image, analysis, func, n0: int) -> list[DcrInsn] | Refusal:
        """The region at n0 that an evicted neighbour's detour would copy."""

    def stack_aligned_at(self, image, func, addr: int) -> bool:
        """The stack pointer has the ABI's call alignment at addr (a function entry)."""

    def red_zone_free_at(self, image, func, addr: int) -> bool:
        """The ABI's red zone below the stack pointer is free at addr."""

    def arith_flags_dead(self, image, func, addr: int, limit: int = 32) -> bool:
        """No instruction from addr reads the arithmetic flags before writing them."""


class KprobeXol(Protocol):
    """arch_prepare_kprobe() and the out-of-line slots of breakpoint probes."""
    def prepare(self, image, addr: int, ss_breakpoint: bool = False, boost: bool = True) -> Xol:
        """How the instruction at addr runs when its breakpoint hits (ss_breakpoint: a single-stepped
        copy ends with a breakpoint; boost False: nothing boosted, Rules.boost_post_handler)."""

    def emulates_refused(self, image, addr: int) -> bool:
        """can_probe() refuses the instruction but the trap handler emulates it."""

    def place_slot(self, x: Xol, site_index: int, with_post: bool, at: int, desc: int = 0) -> XolSlot:
        """x's slot placed at `at` (desc: the site's descriptor index)."""

    def slot_code(self, x: Xol, site_index: int, with_post: bool, at: int, post_entry: int,
                  desc: int = 0) -> bytes:
        """The slot's bytes at `at` (the copy, a post stub, the jump back)."""

    # The descriptor table (emit/breakpoints.py: the numbering, the hash, the single-step
    # entries are arch-neutral) asks the arch for its rows.
    NO_SLOT: XolSlot                   # the slot of a site whose trap does the work (emulated)
    TABLE_INCLUDES: tuple[str, ...]    # lines before the table (headers of its struct)
    EMPTY_DESCRIPTOR: str | None       # the one row of a table with no site (None: empty)
    SS_BREAKPOINT_SPAN: bool                 # single-stepped copies may end with a breakpoint

    def descriptor(self, s, x: Xol, slot: XolSlot) -> str:
        """Site s's row of kp_breakpoints[] (the arch's struct kp_breakpoint_site), as C."""


class RetProbe(Protocol):
    """The arch half of kretprobes (rethook): exits of a function, return hooks,
    the entry's return-address handling."""
    KRET_ENTRY_USES: tuple[str, ...]   # registers the kretprobe entry body clobbers
    JUMP_WORD: str                     # what the arch calls a jump, in refusals ("jump", "branch")
    # The return hooks free a tail-calling caller's handler-less instance inline (they read
    # kp_kretprobes[] and kp_kret_handlers[]: the hooks' kretprobes and handlers arguments).
    FREES_CALLERS_INLINE: bool
    # The runtime has the clean kretprobe entry in user processes (kp_kretprobe_clean_entry:
    # the return-address slot passed instead of a pt_regs; Rules.kretprobe_clean_entry).
    CLEAN_ENTRY_IN_USER: bool

    # The generic exit walk (planner/exits.py: find_exits()) asks these.
    def exits_refusal(self, image, func) -> Refusal | None:
        """Why no exit of func can take a return hook at all (the trampoline then), or None."""

    def unknown_exits(self, image, analysis, part) -> Refusal | None:
        """An indirect jump of `part` (func or a cold part) that leaves its exits unknown, or None."""

    def exit_insn(self, image, analysis, part, addr: int) -> DcrInsn:
        """The instruction at addr in `part`: an exit candidate Analysis decoded, or an indirect jump."""

    def exit_kind(self, insn: DcrInsn) -> tuple[str, int | None] | Refusal | None:
        """What an exit candidate is: (RET, None) a return, (TAIL, target) a direct jump,
        (COND, target) a conditional one; a Refusal: an exit no hook can take; None: no exit."""

    def mid_frame_part(self, image, func) -> bool:
        """func (not a PLT) is a block of another function entered mid-frame (a stripped cold part)."""

    def exit_region(self, image, analysis, part, exit: Exit, busy, landed=None) -> tuple[list[DcrInsn], int] | Refusal:
        """The region a jump at an exit may take, and where it starts.  landed(addr): the
        jumps landing at addr are hooked as exits of their own (branch exits, below), so the
        region may hold addr; an arch without branch exits is never given one."""

    def hook_then_exit(self, exit: DcrInsn, hook, at: int) -> bytes:
        """A call of the return hook, then the exit itself, at `at`."""

    def ret_detour(self, dcr: list[DcrInsn], hook: tuple[int, int | None], at: int) -> bytes:
        """A return region's detour: its copy up to the exit, the hook, the exit."""

    def hook_copy(self, hooks: dict[int, tuple[int, int | None]], blocks: dict | None = None) -> Callable:
        """A copy function for a detour whose region holds exits: each exit calls its hook.
        blocks: the branch exits among them (below); an arch without them is never given any."""

    # Optional (x86-64), branch exits (planner/returns.py's _branch_exits(), where the
    # target's Rules.kretprobe_branch_exits is on): exit_region(..., landed=f) lets a
    # region hold an address whose jumps f vouches for; hook_copy(hooks, blocks=...)
    # runs a jump's block, hook and exit in a detour's copy; and:
    #
    # def branch_exit(self, insn: DcrInsn) -> bool:
    #     """A jump that may stand for the exit it lands on (a plain jmp or jcc)."""
    #
    # def branch_ret_detour(self, dcr, block, hook, at: int, branch: int) -> bytes:
    #     """A branch exit's detour: its region's copy, the jump (a jcc inverted) to what
    #     it lands on, the hook and the exit."""

    def kret_entry_body(self, *, rp: int, tramp: int, entry_handler: int | None, enter_c: int,
                        aligned: bool, inline: bool = True, regs: bool = False) -> bytes:
        """The code a kretprobe's entry runs (arch_prepare_kretprobe())."""

    def clean_ret_hook(self, exit: DcrInsn, at: int, *, fast: int, table: int, key, rp: int,
                       handler: int | None, return_c: int, full_hook: tuple[int, int | None],
                       aligned: bool, handler_clobbers: set[str] | None, kretprobes: int = 0,
                       handlers: int = 0) -> bytes:
        """A return hook that saves only what its handler clobbers."""

    def full_ret_hook(self, exit: DcrInsn, at: int, *, fast: int, table: int, key, rp: int,
                      handler: int | None, return_c: int, aligned: bool, kretprobes: int = 0,
                      handlers: int = 0) -> bytes:
        """A return hook that saves a whole pt_regs."""


class Emit(Protocol):
    """arch_prepare_optimized_kprobe() and the code kprewrite writes: detours,
    templates, patches, start-up stubs; the runtime's struct offsets (asm-offsets)."""
    EmitError: type
    # relink(buf, base, links, sym, placeholder): the code in buf (address a at buf[base + a]),
    # built with every runtime symbol at `placeholder` (emission.Far's LinkSyms, each field
    # of the code that reaches one logged in `links` as address, symbol...), moved to sym's
    # addresses: the bytes a build with sym gives.  None: the arch logs no links (each
    # detour is built again).
    relink: Callable | None

    # Runtime struct sizes and offsets, generated from the C headers (kp_asm_offsets.c).
    KPROBE_SIZE: int
    KPROBE_FLAGS: int
    KRETPROBE_SIZE: int
    THREAD_ACTIVE: int
    THREAD_HITS: int
    THREAD_TABLE_MASK: int
    THREAD_KRET: int
    KRET_DEPTH: int
    KRET_TAIL_SLOT: int
    KRET_STACK: int
    RP_MAXACTIVE: int
    RP_STRIDE: int
    RP_POOL: int
    RP_HINT: int
    RI_RP: int
    RI_RET_ADDR: int
    RI_FP: int
    RI_STATE: int
    RI_FLAGS: int
    RI_TRAMP: int

    def relocate(self, insn: DcrInsn, new: int) -> bytes:
        """The instruction's copy at `new` (PC-relative operands fixed)."""

    def detour(self, site: int, dcr: list[DcrInsn], with_post: bool, at: int, entry: int,
               post_entry: int, copy=None, back: int | None = None, short: bool = False) -> tuple[bytes, int, int]:
        """The optprobe detour buffer through the runtime's common entry (short: through
        its short entries, where the thread key has no red zone: a kernel's)."""

    def clean_detour(self, site: int, dcr: list[DcrInsn], at: int, *, fast: int, table: int, key,
                     probe: int, probe_index: int, handler: int | None, callback: int, flags_live: bool,
                     aligned: bool, handler_clobbers: set[str] | None = None, copy=None, body=None,
                     back: int | None = None, regs_fields: frozenset[int] | None = None,
                     red_zone: bool = False) -> tuple[bytes, int]:
        """A detour that saves only what its handler clobbers (regs_fields: and the
        pt_regs fields a pre_handler that only loads from regs reads, passed to it;
        red_zone: a function's entry, where the ABI leaves room free: optprobe.red_zone_free_at())."""

    def full_detour(self, site: int, dcr: list[DcrInsn], at: int, *, fast: int, table: int, key,
                    probe: int, probe_index: int, handler: int, callback: int, resume_regs: int,
                    aligned: bool, copy=None, body=None, back: int | None = None,
                    red_zone: bool = False) -> tuple[bytes, int]:
        """A detour that saves a whole pt_regs in line (red_zone: as clean_detour's)."""

    def light_detour(self, site: int, dcr: list[DcrInsn], at: int, *, fast: int, base: int, key,
                     counter: int, slow_entry: int, flags_live: bool, red_zone: bool, copy=None,
                     back: int | None = None, hits: int | None = None) -> tuple[bytes, int]:
        """A detour that only counts the hit (base: kp_light_base, the pointer to kp_light_hits,
        hits: the array itself).  An arch whose runtime rewrites light detours at start-up
        for the CPU it runs on (AArch64: LSE atomics) also has
        light_alternatives_c(image, [(detour, red_zone)...], address_c) -> str: the runtime's
        table of them, as C (emit/tables.py); an arch without it gets no such table."""

    def light_counter(self, slot: int) -> int:
        """The byte offset of a light site's hit counter."""

    def evicted_detour(self, dcr: list[DcrInsn], at: int) -> bytes:
        """An evicted neighbour's detour: its copy and the jump back."""

    def evict_patch(self, addr: int, region_len: int, detour: int, probe_detour: int) -> bytes:
        """The bytes over an evicted region: its jump, then the probe's."""

    def jump_patch(self, addr: int, region_len: int, target: int) -> bytes:
        """The optimized probe's jump (JUMP_SIZE bytes), the region's rest filled."""

    def short_jump_patch(self, addr: int, region_len: int, slot: int) -> bytes:
        """A short jump to a JUMP_SIZE jump at slot."""

    def branch_disp(self, code: bytes) -> int | None:
        """The offset of a retargetable direct branch's displacement in code, or None."""

    def retarget_patch(self, addr: int, code: bytes, target: int) -> tuple[int, bytes]:
        """The direct branch at addr naming target instead."""

    def entry_stub(self, at: int, start_fn: int, orig_entry: int) -> bytes:
        """A new entry point: the runtime's start, then the original entry."""

    def chain_stub(self, at: int, fn: int, then: int) -> bytes:
        """A call of fn, then a jump to then (a DT_INIT-style chain)."""

    def call_stub(self, at: int, fn: int) -> bytes:
        """A function that calls fn and returns (a DT_FINI of our own)."""

    def signal_syscall_stub(self, at: int, sc, hook: int) -> bytes:
        """Where a SignalSyscall's jump goes: its instructions but the system call, then
        hook(a0, a1, a2, a3, nr) in its place (nr 0: only for the two numbers), then a
        jump back to after it."""


class HandlerAbi(Protocol):
    """What a compiled handler does with the state a detour passes it."""
    VECTOR_STATE: str         # the register state detours do not save, as users know it

    def may_use_regs(self, code: bytes, start: int, end: int, relocs: dict[int, str] | None = None) -> bool:
        """The function may read its pt_regs argument."""

    def regs_loads(self, code: bytes, start: int, end: int, relocs: dict[int, str] | None = None,
                   limit: int | None = None) -> frozenset[int] | None:
        """The pt_regs fields (byte offsets) the function can read, when it only loads
        from its pt_regs argument at constant offsets below limit (default: pt_regs'
        size) (None: any other use)."""

    def vector_use(self, code: bytes, start: int) -> int | None:
        """The first instruction touching VECTOR_STATE registers, or None."""

    def clobbered_scratch(self, code: bytes, start: int, relocs: dict[int, str] | None = None) -> set[str] | None:
        """The call-clobbered registers the function writes (None: unknown)."""


class FetchRegs(Protocol):
    """The register names of kprobe_events fetch args, and pt_regs offsets."""
    PT_REGS: list[str]
    REG_OFFSET: dict[str, int]
    REGS_HINT: str
    PARAM_MAX_STACK: int
    DEFAULT_TYPE: str


class Toolchain(Protocol):
    """How C is compiled for the arch (link/toolchain.py, link/runtime.py)."""
    TRIPLE: str                            # the GNU toolchain's prefix: TRIPLE-gcc, TRIPLE-ld
    CFLAGS: dict[str, tuple[str, ...]]     # by kind of code ("user", "kernel"): the arch's own flags
    QEMU_SYSTEM: tuple[str, tuple[str, ...], str]   # `kprewrite boot`: emulator, machine options, package
    CONSOLE: str                           # the kernel's serial console (console=...)
    # The runtime's files a recipe names by role, in the arch's words: "breakpoint" (the
    # trap code), "breakpoint_signal" (its user SIGTRAP glue), "breakpoint_hook" (a kernel's #BP hook).
    RUNTIME_FILES: dict[str, str]


class Arch(Protocol):
    """An architecture back end: a package under rewriter/arch/ with these members
    (tests/test_arch.py checks every back end against this declaration)."""
    name: str                 # also the runtime's folder: runtime/arch/<name>
    e_machine: int            # ELF e_machine
    r_relative: int           # the ELF relocation type of a base-relative word
    r_got_slot: tuple[int, ...]   # relocation types of GOT slots (GLOB_DAT, JUMP_SLOT)
    r_irelative: int          # the ELF relocation type whose addend is an IFUNC resolver
    # The image's system calls that set a signal mask or action (SignalSyscall list).
    signal_syscalls: Callable
    breakpoint: bytes         # the breakpoint instruction a breakpoint probe writes
    breakpoint_name: str      # what diff calls it: int3, brk
    JUMP_SIZE: int            # the bytes of the jump an optimized probe writes
    JUMP_REACH: int           # how far that jump reaches, either way
    FTRACE_NOP: bytes         # the nop an ftrace site holds when not tracing
    NOP1: bytes | None        # the smallest nop, as -fpatchable-function-entry pads with it
    USER_THREAD_KEY: ThreadKey    # how a Linux user thread is found (the psABI's thread pointer)
    Refusal: type

    optprobe: OptProbe
    kprobe_xol: KprobeXol
    retprobe: RetProbe
    emit: Emit
    handler_abi: HandlerAbi
    fetch_regs: FetchRegs
    toolchain: Toolchain
    jumptable: Any            # resolve(image, analysis, func) -> each indirect jump's kind and targets

    def decode_function(self, code: bytes, start: int) -> Any:
        """A function's instructions: boundaries, branches, indirect jumps, code references."""

    def is_branch(self, insn: DcrInsn) -> bool:
        """A branch: its copy goes elsewhere, so no post_handler can follow it."""

    def direct_branch_target(self, insn: DcrInsn) -> int | None:
        """Where a direct call, jump or conditional jump goes (None: not one)."""

    def with_branch_target(self, insn: DcrInsn, target: int) -> DcrInsn:
        """insn, a direct branch, naming `target` instead (its copy relocates there)."""

    def ftrace_site_insn(self, addr: int) -> DcrInsn:
        """The DCR of a probe on an ftrace site: the site as the nop it is when not traced."""


def unwind_info(arch):
    """The arch's unwind module, an optional member (`unwind`): how its detours
    look to an unwinder (CIE_INSNS, RA_COLUMN, CODE_ALIGN, DATA_ALIGN and
    fde_program(code, at, hit), the call frame program of a detour at `at` whose
    hit is at `hit`).  None: the arch has none yet, and a target writes no unwind
    tables for new code (a backtrace in a handler stops at the detour)."""
    return getattr(arch, "unwind", None)


# The C++ runtime's and the unwinder's: an image that names one unwinds exceptions.
EXCEPTION_SYMBOLS = ("__gxx_personality_v0", "__cxa_throw", "_Unwind_RaiseException", "_Unwind_Resume",
                     "__gcc_personality_v0")


def unwinds_exceptions(image, analysis) -> str:
    """Whether an exception may be unwound through this image's frames (which would
    meet a return-address trampoline, which has no FDE): an FDE with an LSDA (C++, or
    C with -fexceptions and cleanups), or a symbol of the unwinder's or the C++
    runtime's.  Returns what says so, or ''.  The same on every arch."""
    def compute():
        lsda = next((f for f in image.fdes if f.lsda), None)
        if lsda is not None:
            return f"the FDE at {lsda.start:#x} has an LSDA"
        names = image.symbol_names()
        return next((f"it names {n}" for n in EXCEPTION_SYMBOLS if n in names), "")
    return analysis.memo("retprobe.unwinds", 0, compute)
