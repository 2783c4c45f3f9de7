"""The pipeline: load the image -> resolve probes -> analyse functions -> plan
(sites, return sites) -> compile the handlers and finish the plan (forms) ->
lay out -> generate tables -> link handlers and runtime -> emit code -> write.
Each stage is its own module; this one only passes plain data between them:
prepare() ends with the plan `check` prints, compile_handlers() completes it,
build() carries it out and decides nothing: the same back half for every target,
each step asked of the target (targets/base.py declares them, with the defaults of an
image laid out in place).  The CLI is a thin layer over prepare(), instrument() and the
report module."""
from __future__ import annotations

import contextlib
import copy
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .emit import emission, meta
from .probes import events
from .link import handlers
from . import link, planner, targets
from .analysis.functions import Analysis
from .arch import get_arch
from .errors import KprewriteError
from .elf.image import Image
from .output import write_all
from .progress import NoProgress
from .report import blacklist_lines, check_lines, list_lines, read_metadata, skipped_summary

__all__ = ["Session", "prepare", "prepare_for_check", "compile_handlers", "build", "instrument",
           "check_lines", "list_lines", "blacklist_lines", "read_metadata", "skipped_summary"]
from .probes.resolve import Probe, is_entry, resolve
from .probes.spec import Spec, load_spec


@dataclass(frozen=True)
class Session:
    """Everything up to the plan (what `check` prints)."""
    image: Image
    spec: Spec
    arch: object
    target: object
    analysis: Analysis
    probes: list[Probe]
    plan: planner.Plan
    rules: object                      # rules.Rules: the target's answer
    traces: dict                       # events.trace_key -> events.TraceEvent
    handler_symbols: dict              # handler name -> link symbol
    handler_exports: dict              # C source -> handler names it exports


def prepare(input_path: str, spec_path: str | Spec, no_optimize: bool = False, strict: bool = True,
            system_map: str | None = None, progress=None) -> Session:
    """Everything up to the plan.  strict: refused probes and missing handlers are
    errors (instrument); otherwise refused probes stay in the plan to be printed (check).
    progress: a progress.Progress told each stage as it starts."""
    progress = progress or NoProgress()
    # A Spec made by the caller (spec.from_options()) is completed here as a loaded one is: a copy
    spec = copy.deepcopy(spec_path) if isinstance(spec_path, Spec) else load_spec(spec_path)
    if not (spec.kprobes or spec.kretprobes or spec.events or spec.probes):
        # An output with no probes in it is a copy: most likely the wrong spec was given.
        raise KprewriteError(f"{spec.name}: the spec defines no probes (no [[kprobe]], [[kretprobe]] or "
                             "[[function_graph]] table, no events or probes); nothing to instrument")
    progress.stage("loading", os.path.basename(input_path))
    image = targets.load(input_path)   # unwrapped from its container, its target detected
    if image.section_named(meta.META_SECTION) is not None:
        # A second runtime and probe table beside the first (two profiles, two sets of
        # detours over one another's code): not supported, refused.
        raise KprewriteError(f"{input_path}: already rewritten by kprewrite (it has a {meta.META_SECTION} "
                             "section); instrument the original file instead")
    arch = get_arch(image.machine)
    errors = []
    if spec.probes:                   # perf probe definitions become kprobe_events lines (DWARF: pyelftools)
        from .probes import perfprobe
        errors += perfprobe.expand(spec, image, arch)
    errors += events.expand(spec, arch)  # kprobe_events lines become probe tables
    target = image.target
    target.load_symbols(image, system_map)
    if strict:
        target.runtime_probes(spec)     # probes the runtime itself needs (a kernel's boot hooks)
    progress.stage("resolving", f"{len(image.functions)} functions")
    rules = target.rules(image, arch)
    probes, res_errors = resolve(image, spec, arch)
    errors += res_errors
    progress.stage("analysing", f"{len(image.functions)} functions, {len(probes)} probes")
    analysis = Analysis(image, arch, extra_sources=rules.jump_target_sources,
                        read_indirect_jumps=rules.read_indirect_jumps,
                        probed_functions=len({p.func.start for p in probes if p.func is not None}))
    progress.stage("planning", f"{len(probes)} probes, {len(analysis.targets)} jump targets")
    plan = planner.plan(image, analysis, arch, probes, rules, spec.optimize and not no_optimize, spec.name)
    if strict:
        errors += plan.errors
    traces, trace_errors = events.compile_all(image, arch, [p for p in probes if not is_entry(p)],
                                              [p for _, p, _ in plan.kretprobes], spec.name, errors,
                                              pt_regs=rules.events_pt_regs)
    errors += trace_errors
    errors += target.refusals(image, plan, traces, spec.name)
    symbols, exports = {}, {}
    if strict:
        symbols, exports, handler_errors = handlers.resolve(spec, arch, target.RUNTIME_HANDLERS)
        errors += handler_errors
    if errors:
        raise KprewriteError(*errors)
    return Session(image, spec, arch, target, analysis, probes, plan, rules, traces, symbols, exports)


def prepare_for_check(input_path: str, spec_path: str | Spec, no_optimize: bool = False,
                      system_map: str | None = None, progress=None) -> tuple[Session, list[str]]:
    """`check`'s plan (refused probes kept in it), and the lines of what instrument's
    handler stage would refuse (check_handlers)."""
    progress = progress or NoProgress()
    try:
        s = prepare(input_path, spec_path, no_optimize, strict=False, system_map=system_map, progress=progress)
        progress.stage("compiling", f"{len(s.spec.handlers)} handler files")
        return s, check_handlers(s)
    finally:
        progress.done()


def check_handlers(s: Session) -> list[str]:
    """What instrument's handler stage would refuse, for `check`: each handler the spec
    names defined in a handler file (handlers.resolve), and every handler file compiled
    (to a temporary folder, then dropped).  The error lines; none if instrument would
    get past it."""
    symbols, exports, errors = handlers.resolve(s.spec, s.arch, s.target.RUNTIME_HANDLERS)
    if errors or not s.spec.handlers:
        return errors
    with tempfile.TemporaryDirectory(prefix="kprewrite-") as d:
        workdir = Path(d)
        headers = workdir / "include"
        for rel, text in s.target.handler_headers(s.image).items():
            (headers / rel).parent.mkdir(parents=True, exist_ok=True)
            (headers / rel).write_text(text)
        try:
            handlers.compile_and_read(s.spec, s.arch, symbols, exports, workdir, s.target.name, headers)
        except KprewriteError as e:
            return list(e.lines)
    return []


def compile_handlers(s: Session, workdir: Path, progress=None, deps: list | None = None) -> list[Path]:
    """The handlers' objects, and the plan finished with them: each site's and
    return hook's form follows from what the compiled handlers read and clobber
    (planner.choose_forms).  After this the plan is complete, and build() only
    carries it out.  deps: gets every file the compilation read."""
    progress = progress or NoProgress()
    progress.stage("compiling", f"{len(s.spec.handlers)} handler files")
    headers = workdir / "include"       # headers the target makes from the image (a kernel's types)
    for rel, text in s.target.handler_headers(s.image).items():
        (headers / rel).parent.mkdir(parents=True, exist_ok=True)
        (headers / rel).write_text(text)
    objs, code = handlers.compile_and_read(s.spec, s.arch, s.handler_symbols, s.handler_exports, workdir,
                                           s.target.name, headers, deps)
    planner.choose_forms(s.plan, s.image, s.arch, code, {k: t.reads_regs for k, t in s.traces.items()}, s.rules)
    return objs


def build(s: Session, objs: list[Path], workdir: Path, progress=None) -> bytes:
    """The output image's bytes, from the finished plan and the handlers' objects: the
    same steps for every target, each asked of it (targets/base.py says what each answers
    and its default): lay out (beside the plan, which stays as it is), generate the
    tables, build the runtime (link/runtime.py's builder and cache, from the target's
    recipe), link, emit, write."""
    progress = progress or NoProgress()
    t = s.target
    c = emission.Code(s.image, s.arch, s.plan, s.handler_symbols, set(s.traces), t.thread_key(s.image))
    progress.stage("emitting", f"{len(s.plan.sites)} sites, {len(s.plan.ret_sites)} return sites")
    lay = t.lay_out(s, c)
    progress.stage("linking")
    # What the target computes from the layout alone (a user image's unwind programs)
    # starts first, in worker processes forked while no other thread runs: they work
    # beside the table's generation, then beside the link (which may run in a thread:
    # link/blob.py), while this one makes the metadata and what emit() needs that the
    # link does not change.
    pending = t.before_link(s.image, s.arch, lay, s.plan)
    linking = None
    try:
        cc = link.compiler(s.arch)             # the image's arch, not the host's
        table = t.tables(s, c, lay)
        variant = t.runtime_variant(s, lay)     # False: the target links no runtime of link/runtime.py's
        runtime = [] if variant is False else link.compile_runtime(cc, workdir, s.arch, t.name, variant)
        linking = t.link(s, lay, table, runtime, objs, workdir, cc)
        metadata = meta.metadata(s.plan, lay, s.image.label)
        unlinked = t.unlinked(s, c, lay)
        early = pending.result() if pending is not None else None
    finally:
        if pending is not None:
            pending.close()
        if linking is not None:
            linking.join()
    blob = linking.result()
    rx, patches = t.emit(s, c, lay, blob, unlinked)
    progress.stage("writing")
    return t.write(s.image, s.arch, lay, rx, patches, blob, metadata, s.plan, early)


def instrument(input_path: str, spec_path: str | Spec, output: str, no_optimize: bool = False,
               system_map: str | None = None, progress=None, depfile: str | None = None,
               read: list | None = None) -> Session:
    """Write OUTPUT; with depfile, also a make/ninja depfile of every file read:
    INPUT, the spec, the System.map, the handlers and the headers they include,
    the runtime's sources.  `read`: a list those files' paths are added to."""
    progress = progress or NoProgress()
    spec_file = spec_path.path if isinstance(spec_path, Spec) else spec_path
    deps = [input_path] + ([str(spec_file)] if spec_file is not None else []) + ([system_map] if system_map else [])
    try:
        s = prepare(input_path, spec_path, no_optimize, system_map=system_map, progress=progress)
        deps += s.spec.handlers
        keep = os.environ.get("KPREWRITE_KEEP")   # debugging: keep the linked runtime (gdb add-symbol-file)
        with (contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory(prefix="kprewrite-")) as d:
            workdir = Path(d)
            workdir.mkdir(parents=True, exist_ok=True)
            objs = compile_handlers(s, workdir, progress, deps)
            data = build(s, objs, workdir, progress)
        deps += link.runtime_sources()
        if read is not None:
            read += [str(d) for d in deps]
        files = [(output, data, os.stat(input_path).st_mode & 0o7777)]
        if depfile:             # OUTPUT and its depfile both, or neither (make would take OUTPUT as up to date)
            from . import depfile as df
            files.append(df.entry(depfile, output, deps, input_path))
        write_all(files)
    finally:
        progress.done()
    return s
