"""The user's handlers: which file defines each handler the spec names, their
compiled objects, and what their code does with its arguments (the arch's
handler_abi reads it), so that the planner can pick each detour's form."""
from __future__ import annotations

from pathlib import Path

from .. import link
from ..planner import HandlerCode
from ..probes.spec import where


def names(spec) -> set[str]:
    """Every handler the spec's kprobes and kretprobes name."""
    return ({n for k in spec.kprobes for n in (k.pre_handler, k.post_handler) if n}
            | {n for k in spec.kretprobes for n in (k.handler, k.entry_handler) if n})


def resolve(spec, arch, runtime_handlers=frozenset()) -> tuple[dict[str, str], dict, list[str]]:
    """(handler name -> link symbol, C source -> names it exports, error lines).
    runtime_handlers: names the runtime itself defines (a target's own probes).
    Every handler named must be defined in a handler file; detours save no
    vector state (the arch's handler_abi.VECTOR_STATE), so handler code must not touch it: C sources are compiled
    with -mgeneral-regs-only, prebuilt objects are read."""
    wanted = names(spec) - runtime_handlers
    own = {n: n for n in names(spec) & runtime_handlers}
    if not wanted:
        return own, {}, []
    symbols, exports, missing = link.resolve_handlers(link.compiler(arch), spec.handlers, wanted)
    symbols.update(own)
    lines = []
    for h in spec.handlers:
        if h.suffix == ".o":
            for sec in link.executable_sections(h):
                at = arch.handler_abi.vector_use(sec, 0)
                if at is not None:
                    lines.append(f"{spec.name}: handlers: {h.name} uses {arch.handler_abi.VECTOR_STATE} registers at "
                                 f"{at:#x}, which detours do not save; compile it with -mgeneral-regs-only")
                    break
    listed = ", ".join(h.name for h in spec.handlers) or "none listed"
    for tables, keys in ((spec.kprobes, ("pre_handler", "post_handler")), (spec.kretprobes, ("handler", "entry_handler"))):
        for k in tables:
            for key in keys:
                n = getattr(k, key)
                if n in missing:
                    lines.append(f"{where(spec.name, k.table)}: {key} '{n}' is not defined in any handler file ({listed})")
    return symbols, exports, lines


def compile_and_read(spec, arch, symbols: dict[str, str], exports: dict, workdir: Path,
                     platform: str = link.PLATFORM, headers: Path | None = None, deps: list | None = None
                     ) -> tuple[list[Path], dict[str, HandlerCode]]:
    """The handlers' objects (one per spec.handlers entry, in order), compiled for
    the runtime platform (headers: a folder searched first), and every handler's code
    read once.  deps: gets every file the compilation read (link.compile_handlers)."""
    objs = link.compile_handlers(link.compiler(arch), workdir, spec.handlers, exports, platform, headers, deps,
                                arch=arch)
    abi = arch.handler_abi
    funcs = link.object_functions(objs)
    code = {}
    for name, sym in symbols.items():
        fn = funcs.get(sym)
        if fn is None:
            code[name] = HandlerCode(True, None, sym)
        else:
            off, body, relocs = fn
            reads = abi.may_use_regs(body, off, off + len(body), relocs)
            code[name] = HandlerCode(reads, abi.clobbered_scratch(body, off, relocs), sym,
                                     abi.regs_loads(body, off, off + len(body), relocs) if reads else None)
    return objs, code
