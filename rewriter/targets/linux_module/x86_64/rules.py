"""The module target's x86 rules: a jump through a retpoline thunk is an indirect
jump, and a region's copy must carry the .ko's relocations (optprobe.py)."""
from __future__ import annotations


# The kernel's retpoline thunks, which a module calls or jumps to by name (the kernel
# image's [__indirect_thunk_start, __indirect_thunk_end) is not the module's to read).
THUNKS = ("__x86_indirect_thunk_", "__x86_indirect_jump_thunk_")


def adjust(image, arch, r) -> None:
    """The x86-64 module's part of its rules (linux_module.rules() has the kernel's and the
    init sections'), set on r."""
    r.function_refusal = thunk_jumps(image, arch, r.function_refusal)
    r.region_refusal = carried(image, r.region_refusal)
    # Breakpoint probes: the module's own die notifier takes their traps (writer.py), each
    # instruction run from a slot in the module's code (a copy carrying its relocations:
    # int3_copy()), a single-stepped one's ending with a breakpoint, as the kernel's own since
    # 5.14.  A post_handler makes a kprobe a breakpoint one, as the kernel's optimize_kprobe().
    # A kretprobe's entry is any of the three (an ftrace site, a jump, a breakpoint).
    r.breakpoints = True
    r.singlestep_breakpoint = True
    r.breakpoint_refusal = int3_copy(image)
    r.optimized_post_handler = False
    # setup_singlestep() boosts no kprobe with a post_handler: it runs at the trap after the
    # copy (the module's trap code has no probe stub to run it from a boosted copy).
    r.boost_post_handler = False
    # kretprobes the kernel's way: the return address swapped for a trampoline at entry (writer.py).
    r.kretprobe_exits = False
    # An entry probe takes its ftrace site through the site's relocation (writer.py), not a
    # jump after it.
    r.share_ftrace = 0


def thunk_jumps(image, arch, inner):
    """can_optimize()'s insn_is_indirect_jump() for a module: a `jmp` (not a call) to a
    retpoline thunk is an indirect jump, which refuses optimizing the whole function (its
    targets are unknown: one may be inside a region).  The kernel image's function_refusal
    (exception tables) first."""
    lo, hi = image.container.stand_in
    thunks = {a for n, a in image.all_symbols().items() if n.startswith(THUNKS) and lo <= a < hi}

    def refusal(analysis, func):
        why = inner(analysis, func) if inner is not None else None
        if why is not None or not thunks:
            return why
        for target, src in analysis.decoded(func).branches:
            if target in thunks and image.read(src, 1) != b"\xe8":
                return arch.Refusal("indirect_jump", src, f"{func.name} jumps through a retpoline thunk "
                                                          "(an indirect jump)")
        return None
    return refusal


def carried(image, inner):
    """Rules.region_refusal() for a module: the kernel's checks (inner), then whether the
    region's copy can carry its relocations (optprobe.py; `module_relocation`), so
    that `check` names what `instrument` would refuse."""
    from ....arch.base import DcrInsn
    from ....arch.x86_64 import insn as x86insn
    from . import optprobe

    def refusal(arch, analysis, func, lo, hi):
        why = inner(arch, analysis, func, lo, hi)
        if why is not None:
            return why
        mod = image.container
        relocs = optprobe.relocations(mod)
        pos = lo
        while pos < hi:
            code = image.read(pos, 16)
            try:
                info = x86insn.classify(code, pos)
                optprobe.copy(mod, relocs, DcrInsn(pos, code[:info.length], info))
            except ValueError:
                return None             # the planner's own decode check says so
            except optprobe.CopyRefused as e:
                return arch.Refusal(*e.args)
            pos += info.length
        return None
    return refusal


def int3_copy(image):
    """Rules.breakpoint_refusal() for a module: a breakpoint site's out-of-line copy lives in the
    module's own code (writer.py's int3_slot()), so it must carry the instruction's
    relocations (optprobe.copy(), `module_relocation`); an instruction the kernel emulates
    is run from its copy too (a relative branch re-encoded, a call pushing the original
    return address), so xbegin (whose abort target the copy would not move) is refused; under
    a post_handler a relative jmp, jcc or call is emulated in the trap (its target carried as
    a relocation, optprobe.branch_target()), any other branch refused, with the reason.
    (A boostable instruction under a post_handler comes here single-stepped already:
    Rules.boost_post_handler is off for modules.)"""
    from ....arch.base import EMULATE
    from ....arch.x86_64.kprobe_xol import K_CALL, K_JCC, K_JMP, K_XBEGIN
    from . import optprobe

    early = None

    def refusal(arch, site):
        nonlocal early
        x = site.xol
        if early is None:
            early = before_init(image)
        func = site.probes[0].func
        why = early.get(func.start) if func is not None else None
        if why is not None:
            return arch.Refusal("module_int3", site.addr, f"{func.name} {why}, before the module's init "
                                                          "registers the die notifier that takes its breakpoints")
        if x.mode == EMULATE and x.kind == K_XBEGIN:
            return arch.Refusal("module_int3", site.addr, "xbegin's copy in a module's breakpoint slot is not "
                                                          "written (its abort target would not move)")
        if x.mode == EMULATE and site.with_post and x.kind not in (K_JMP, K_JCC, K_CALL):
            return arch.Refusal("post_handler", site.addr, "a post_handler after this branch at a module's "
                                                           "breakpoint is not written yet (only a relative jmp, jcc "
                                                           "or call is emulated; the others run from their copy)")
        mod = image.container
        relocs = optprobe.relocations(mod)
        try:
            optprobe.copy(mod, relocs, x.insn)
            if x.mode == EMULATE and site.with_post:    # emulated in the trap (writer.py's _emulate_c())
                optprobe.branch_target(mod, relocs, x.insn)
        except optprobe.CopyRefused as e:
            return arch.Refusal(*e.args)
        return None
    return refusal


# struct kernel_param (include/linux/moduleparam.h): name, mod, ops, perm/level/flags, arg.
KERNEL_PARAM_SIZE, KERNEL_PARAM_OPS = 40, 16
# struct kernel_param_ops: flags, then set, get and free.
PARAM_OPS_FUNCS = ((8, "set"), (16, "get"), (24, "free"))


def before_init(image) -> dict[int, str]:
    """The module's functions the kernel may call before the module's init: a module parameter's
    own kernel_param_ops (load_module() runs parse_args(), which calls its `set`, and makes
    /sys/module/<module>/parameters/, whose reads call its `get`, after the text is live and
    before do_init_module()), by their start: why.  A breakpoint there would trap with no
    notifier of ours registered yet (an oops), so int3_copy() refuses it; the functions they
    call are not followed."""
    mod = image.container
    sec = mod.section_named("__param")
    a = mod.addr.get(sec.index) if sec is not None else None
    lo, hi = mod.stand_in
    out = {}
    if a is None:
        return out
    for at in range(a, a + sec.size - KERNEL_PARAM_SIZE + 1, KERNEL_PARAM_SIZE):
        ops = int.from_bytes(image.read(at + KERNEL_PARAM_OPS, 8), "little")
        if mod.place(ops) is None:      # the kernel's param_ops_*: not the module's code
            continue
        for off, name in PARAM_OPS_FUNCS:
            fn = int.from_bytes(image.read(ops + off, 8), "little")
            f = image.function_at(fn) if fn else None
            if f is not None and f.start == fn and not lo <= fn < hi:
                out.setdefault(f.start, f"is a module parameter's {name} (kernel_param_ops), which the kernel "
                                        f"may call at insmod (parse_args(), the parameter's sysfs file)")
    return out
