"""The kernel target for arm64 images (linux_kernel.for_arch() picks it by the image's arch): the
kernel target's reading, rules and planning as they are, and its own answers to the back half's
steps (pipeline.build(); build.py) until the generic back half (the runtime's tables, boot hooks,
per-CPU data, KASLR table) knows arm64.

What differs from the x86-64 kernel target:
- no boot or shutdown hooks of the generic back half (build.py adds its own: the break hooks,
  the ftrace_ops, the command line, and the loader of the runtime's part an arm64 Image has,
  the debugfs views and the trace events, placed in module memory at boot: runtime.py);
- the back half's steps (build.py says where and why): lay_out(), the sites as the detours take
  them, the hook probes of ours added (nothing has an address before the link); tables(),
  kp_detours.S and kp_dispatch.c; runtime_variant() False, no runtime of link/runtime.py's
  (the runtime's part is linked per rewrite, in link()); link(), the handlers and a detour per
  jump-optimized site linked into the Image's own text padding and init-data tail; emit(), the
  displaced instructions relocated, a `B` (or `brk`) at each site and free_initmem()'s `adrp`;
  write(), Image in, Image out (no metadata);
- thread_key(): None (the detours run on the kernel stack, with no per-CPU data of ours)."""
from __future__ import annotations

import rewriter.targets.linux_kernel as _base

globals().update({k: v for k, v in vars(_base).items() if not k.startswith("__") and k != "for_arch"})

RUNTIME_HANDLERS = frozenset()
# The bounds symbols of the tables tables.py finds (sites.TABLES' names for them).
TABLE_SYMBOLS = {"__ex_table": ("__start___ex_table", "__stop___ex_table"),
                 "__bug_table": ("__start___bug_table", "__stop___bug_table"),
                 "__jump_table": ("__start___jump_table", "__stop___jump_table"),
                 ".altinstructions": ("__alt_instructions", "__alt_instructions_end")}


def load_symbols(image, system_map: str | None = None) -> None:
    """As the kernel target's, but kallsyms as the Image reader read them (image.py), and the
    bounds of the tables found in the Image (tables.py) added as data symbols where the
    symbols (kallsyms, or a System.map without them) do not give them."""
    img = image.container
    if img is None or not hasattr(img, "kallsyms"):
        return _base.load_symbols(image, system_map)
    from ..elfview import ElfView
    from ..kallsyms import KSym, functions
    from . import tables
    if system_map is not None:
        _base.load_symbols(image, system_map)
        syms, source = list(image.kernel_symbols), image.kernel_symbols_source
    else:
        syms, source = list(img.kallsyms.symbols), "kallsyms"
    have = {s.name for s in syms}
    if not all(n in have for pair in TABLE_SYMBOLS.values() for n in pair):
        for t, (a, b) in sorted(tables.find(img, image.data[image.offset_of(img.text):]).items()):
            lo, hi = TABLE_SYMBOLS[t]
            if lo not in have or hi not in have:
                syms += [KSym(a, "d", lo), KSym(b, "d", hi)]
    image.kernel_symbols = syms
    image.kernel_symbols_source = source
    image._link_symbols = None
    image.set_functions([(f.start, f.end, f.name) for f in functions(syms, ElfView(image.data, image.path))],
                        source)


def rules(image, arch):
    """The kernel target's rules, with breakpoint probes where no jump fits (build.py: brk, the
    kernel's break hooks, an out-of-line copy).  Every ftrace site stays one: where the
    instruction after a function's NOPs cannot take the jump, the planner's share_ftrace_site()
    refuses its entry probe naming the check (the site itself is never taken: ftrace_init_nop()),
    and a glob reaches it through the ftrace_ops (Rules.ftrace_ops_globs)."""
    r = _base.rules(image, arch)
    r.breakpoints = True
    return r


def refusals(image, plan, traces, spec_name: str) -> list[str]:
    """targets.base.Target.refusals(): what build.py does not write on arm64 yet, one line per
    probe, asked by `check` and `instrument` alike (so they agree): a region shared between sites,
    a post_handler after a branch, a trace event on a glob's probes (an `events` line or a `fetch`
    on probes reached through the ftrace_ops: their one struct kprobe has no event per function),
    and a probe compiled in disabled (`disabled = true`: nothing arms it later, as
    enable_kprobe() would)."""
    from ....arch.aarch64 import insn as I
    from ....planner import BREAKPOINT, FTRACE, OPTIMIZED
    from ....probes.resolve import is_entry
    from ....probes.spec import where
    lines, seen = [], set()
    for site in plan.sites:
        # What build.py writes of a site: its region (past the ftrace NOPs at an entry), alone.
        dcr = site.dcr[1:] if site.decision == FTRACE and getattr(site, "jump_at", 0) else \
            site.dcr if site.decision in (OPTIMIZED, BREAKPOINT) else []
        shared = site.decision in (OPTIMIZED, BREAKPOINT) and \
            (site.head is not None or site.riders or site.slot or site.evicted)
        for p in site.probes:
            if is_entry(p):
                continue
            head = f"{where(spec_name, p.spec.table)} ({p.label})"
            if shared:
                lines.append(f"{head}: a region shared between sites is not written on arm64 kernels yet")
            if p.spec.post_handler and any(insn.info.kind in I.BRANCHES for insn in dcr):
                lines.append(f"{head}: a post_handler after a branch is not written on arm64 kernels yet")
    globs = {id(p) for site in plan.sites if getattr(site, "ftrace_ops", False) for p in site.probes}
    probes = [p for site in plan.sites for p in site.probes if not is_entry(p)]
    probes += [p for _s, p, _g in plan.kretprobes]
    for p in probes:
        if id(p) in seen:
            continue
        seen.add(id(p))
        what = getattr(p, "kret", None) or p.spec
        head = f"{where(spec_name, what.table)} ({p.label})"
        if what.fetch is not None and id(p) in globs:
            if ("glob", what.table) not in seen:        # one line for the glob, not one per function
                seen.add(("glob", what.table))
                lines.append(f"{where(spec_name, what.table)} ({what.symbol_name}): a trace event on a glob's "
                             "probes (through the ftrace_ops) is not written on arm64 kernels yet")
        if what.disabled:
            lines.append(f"{head}: a probe compiled in disabled is not written on arm64 kernels yet "
                         "(nothing would arm it)")
    return lines


def runtime_probes(spec) -> None:
    """None: the runtime is not linked into an arm64 image yet."""
    return None


def thread_key(image):
    """None: the detours find no thread (the generic emitter's templates are not used)."""
    return None


# The back half's steps (targets.base.Target: pipeline.build() asks them in order).
from .build import emit, lay_out, link, runtime_variant, tables, unlinked, write  # noqa: E402,F401
