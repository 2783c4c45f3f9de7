"""The plan's data: decisions, sites, return sites, kretprobe groups and
branch retargets, as plain dataclasses that every later stage reads (the
kernel's struct kprobe / optimized_kprobe / kretprobe state, decided ahead of time).
What the plan says is what to patch; where the new code goes is the layout's own
result (layout.Layout), so nothing after planner.choose_forms() writes here."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..probes.resolve import EntryProbe, Probe, is_entry

# A breakpoint probe's decision is written "int3", the word of `check`'s contract (its AArch64 form
# is a brk: the arch names it where it is shown, `diff`'s lines).
OPTIMIZED, FTRACE, BREAKPOINT, REFUSED = "optimized", "ftrace", "int3", "refused"
JUMPS = (OPTIMIZED, FTRACE)         # decisions that write a jump to a detour
TRAMPOLINE = "trampoline"           # a kretprobe whose returns only the trampoline catches
# How an exit reaches the kretprobe return path (the runtime's KP_KRET_HOOK_*):
# a ret; a tail call to a function whose own returns are hooked (the instance
# stays pending for them); a tail call to anything else (the return address is
# swapped for the trampoline, as the kernel's kretprobes always do); a tail
# call through a pointer, where the arch can read the pointer at the hook:
# pending when its target is a hooked entry, else swapped (decided at run time).
HOOK_RET, HOOK_PENDING, HOOK_SWAP, HOOK_POINTER = "ret", "pending", "swap", "pointer"
HOOK_LIGHT = "light"                # a light kretprobe's exit: nothing runs there (Group.light)
HOOK_KIND = {HOOK_RET: 1, HOOK_PENDING: 2, HOOK_SWAP: 3, HOOK_POINTER: 3}   # a breakpoint hook swaps


@dataclass
class Site:
    """One probed address: the kernel's aggregator kprobe, and its optimized_kprobe."""
    addr: int
    probes: list[Probe]
    decision: str = REFUSED
    reason: object = None            # arch Refusal, or str
    dcr: list | None = None          # the detoured code region, if optimized
    index: int = -1
    xol: object = None               # breakpoint fallback: the arch's out-of-line plan
    kret_hook: int = 0               # a breakpoint return hook at this exit (HOOK_KIND)
    ret_hooks: dict = field(default_factory=dict)   # exits inside this DCR -> (Group, hook kind)
    branch_blocks: dict = field(default_factory=dict)   # of those, branch exits -> what they land on
    # Forms (choose_forms):
    clean: bool = False              # clean call: no handler here reads pt_regs
    template: bool = False           # one probe, no post_handler: dispatch inlined in the detour
    clobbers: set | None = None      # call-clobbered registers the handlers write (None: unknown)
    aligned: bool = False            # template: the ABI has the stack 16-byte aligned at the site
    flags_live: bool = True          # clean: the arithmetic flags are live at the site
    # Template, not clean: the pt_regs fields (byte offsets) its pre_handler can read, when
    # it only loads from regs at constant offsets (a partial pt_regs, emit.clean_detour's
    # regs_fields); None: a whole pt_regs (full_detour).
    regs_fields: frozenset | None = None
    light: bool = False              # template of a probe in an image with no handler: count only
    red_zone: bool = False           # template: room the ABI leaves free here, a function entry (the arch's red_zone_free_at)
    # A region shared by several probes (share_regions): the head takes the jump and
    # holds the whole region in dcr; each site copies only seg, its own part of it.
    head: "Site | None" = None
    riders: list = field(default_factory=list)
    seg: list | None = None
    # A region under 5 bytes (short_jumps()): a short jump at addr to the jump
    # to the detour, in the dead padding at `slot`.
    slot: int = 0
    # Direct branches among the copied instructions whose target is a detoured
    # region's start: address -> the Site or RetSite whose detour they enter instead.
    branch_to: dict = field(default_factory=dict)
    # No dead padding in reach (evict_neighbour()): the slot is the second 5 bytes
    # of a neighbouring region moved to a detour of its own.
    evicted: "EvictedRegion | None" = None
    # An ftrace site shared with the kernel's ftrace (Rules.share_ftrace): the site stays
    # for ftrace and the jump takes the instructions after it, at jump_at (0: at addr).
    jump_at: int = 0
    # An ftrace site reached through the ftrace_ops the image registers at boot
    # (Rules.ftrace_ops_globs): no jump, no detour; the site stays ftrace's.
    ftrace_ops: bool = False
    # No addresses of new code: those are the layout's (layout.Layout, by index).

    @property
    def with_post(self) -> bool:
        return any(p.spec.post_handler for p in self.probes)

    @property
    def post_ip(self) -> int:
        return self.dcr[0].addr + len(self.dcr[0].code) if self.dcr else self.addr

    @property
    def segment(self) -> list:
        """The instructions this site's detour copies."""
        return self.seg if self.seg is not None else self.dcr

    @property
    def segment_end(self) -> int:
        seg = self.segment
        return seg[-1].addr + len(seg[-1].code) if seg else self.addr + 1

    @property
    def region_end(self) -> int:
        return self.dcr[-1].addr + len(self.dcr[-1].code) if self.dcr else self.addr + 1

    @property
    def jump_addr(self) -> int:
        """Where the jump to the detour is written: the site, or past a shared ftrace site."""
        return self.jump_at or self.addr


@dataclass
class EvictedRegion:
    """Beyond the kernel (E9Patch's neighbour eviction, T3): an optimized region
    carrying no kprobe.  Its first 5 bytes jump to a detour that runs its
    relocated copy and jumps back to its end (no handler, no hit count); its
    next 5 bytes, dead now (the only way into the region is its start), hold
    the jump of the short-jump probe that needed them (`for_site`)."""
    addr: int
    dcr: list
    for_site: "Site"

    @property
    def region_end(self) -> int:
        return self.dcr[-1].addr + len(self.dcr[-1].code)


@dataclass
class RetSite:
    """A return site with its own detour: a 5-byte jmp at `addr`."""
    exit: object                 # arch Exit
    dcr: list
    addr: int
    region_end: int
    hook: str = HOOK_RET         # HOOK_RET / HOOK_PENDING / HOOK_SWAP / HOOK_POINTER
    group: object = None
    # A branch exit (planner/returns.py): the dcr ends with a jump to the exit's own
    # region; block, the instructions from where it lands to the exit, run in its detour.
    block: list | None = None
    branch: int = 0                 # that jump's address (the dcr's last instruction, or its first)


@dataclass
class Group:
    """The kretprobes of one function, and how its returns are caught."""
    func: object
    entry: int
    site: Site                       # the entry's site
    probes: list[EntryProbe]
    mode: str = OPTIMIZED
    reason: object = None
    exits: list = field(default_factory=list)
    sites: list[RetSite] = field(default_factory=list)
    embedded: list = field(default_factory=list)     # (kprobe Site, Exit): exits inside a kprobe's DCR
    breakpoint_exits: list = field(default_factory=list)   # (Exit, why no jump): breakpoint return hooks
    hooks: dict = field(default_factory=dict)        # exit addr -> HOOK_*
    pointer_slots: dict = field(default_factory=dict)  # exit addr -> the GOT slot a PLT stub jumps through
    branch_exits: dict = field(default_factory=dict)   # exit addr -> the jumps into its region, hooked as exits
    embedded_branches: list = field(default_factory=list)  # (Site, jump addr, block, Exit): such jumps in a DCR
    ret_template: dict | None = None  # the inlined return hook's parameters (choose_forms)
    # A light kretprobe (planner.forms.light_kretprobes()): nothing runs at its returns,
    # no instance is taken; its entry only counts the hit.  Exits are listed, not hooked.
    light: bool = False

    @property
    def ret_clean(self) -> bool:
        """No handler of its kretprobes reads regs at return."""
        return all(p.ret_clean for p in self.probes)


@dataclass(slots=True)             # 52,000 of them in libpython
class Retarget:
    """A direct branch (x86-64: call, jmp, jcc rel32) to the start of a detoured region,
    sent straight to its detour (Rules.retarget_branches): the jump at the region
    would take it there anyway, one taken jump later."""
    src: int
    size: int                        # the branch instruction's length
    target: int                      # the region it named
    to: "Site | RetSite"             # whose detour it enters


@dataclass
class Plan:
    sites: list[Site] = field(default_factory=list)          # placed, in address order
    errors: list[str] = field(default_factory=list)
    skipped: dict[str, list[Probe]] = field(default_factory=lambda: defaultdict(list))
    # (probe, decision, reason, check name, address of the instruction that made it fail)
    rejected: list[tuple[Probe, str, str, str, int]] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)        # functions with kretprobes, by entry
    ret_sites: list[RetSite] = field(default_factory=list)   # by address
    hooked_entries: list[int] = field(default_factory=list)  # entries whose returns are all hooked (pending)
    kprobes: list[tuple[Site, Probe]] = field(default_factory=list)          # kp_probes[], by slot
    kretprobes: list[tuple[Site, EntryProbe, Group]] = field(default_factory=list)   # kp_kretprobes[]
    retargets: list[Retarget] = field(default_factory=list)   # by source address
    # System calls that set a signal mask or action, sent to the runtime where the image
    # has breakpoint sites (arch.base.SignalSyscall; Rules.signal_syscalls), by address.
    signal_syscalls: list = field(default_factory=list)

    def hit_slot(self, p: Probe) -> int:
        """A probe's hit counter: kp_probes[] first, then each kretprobe's rp->kp."""
        return len(self.kprobes) + p.slot if is_entry(p) else p.slot


@dataclass
class HandlerCode:
    """What the arch's handler_abi read in a handler's compiled code."""
    reads_regs: bool                 # may read its pt_regs argument (unknown code may)
    clobbers: set[str] | None        # call-clobbered registers it writes (None: unknown)
    symbol: str | None = None        # its link symbol
    # The pt_regs fields (byte offsets) it can read when its only uses of regs are loads
    # at constant offsets (handler_abi.regs_loads()); None: unknown, or it may write or
    # pass on regs.  Meaningful when reads_regs.
    regs_fields: frozenset | None = None


NO_HANDLER = HandlerCode(False, set())
