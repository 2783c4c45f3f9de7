"""perf probe's syntax: probes by function, source line and variable name,
resolved ahead of time from the image's DWARF (docs/reference/spec.md#probes).

    syntax.py   the probe definition (parse_perf_probe_command())
    dwarf.py    the debug information's functions, lines and variables in scope
                (probe-finder.c's part); dwarfloc.py where a variable is at an
                address (convert_variable_location()); dwarfaux.py DIEs and types
                (dwarf-aux.c); debugfile.py the separate debug file; debugframe.py
                .debug_frame's CFA
    compile.py  the addresses and fetch args: probe records (compile.Compiled)
    listing.py  what `probe-vars` and `probe-lines` print (perf probe -V / -L)
    btfprobe.py a kernel image's definitions from its BTF instead, where its debug
                vmlinux is not found: parameters at the entry, members, $retval (the
                target's PROBES_BY_NAME = "btf"; with the debug vmlinux, dwarf.py reads
                it one compilation unit at a time)

The spec's `probes` strings become the records events.parse_line() makes of `p`/`r`
lines (an EventDef, its kprobe or kretprobe table, its fetch programs), made from the
data with no line written and read back: the trace events, handlers and reports are
those of `events` lines.  The equivalent line is kept for the user (spec.compiled).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from elftools.common.exceptions import DWARFError, ELFError, ELFParseError

from .. import events as E
from .. import fetch as F
from ...errors import KprewriteError
from . import compile as C
from . import dwarf as D
from ..spec import where as spec_where
from .syntax import ProbeSyntaxError, parse


@dataclass
class ProbeEventDef(E.EventDef):
    """An event compiled from the spec's probes[N] (named so in errors); `text` and
    `words` are the equivalent kprobe_events line's, for errors."""
    source: int = 0
    args: list = field(default_factory=list)    # (NAME, fetch.Fetch or a raw fetch arg as written)

    @property
    def table(self) -> str:
        return self.label or f"probes[{self.source}]"

    def fetch_args(self, flags: F.ParseFlags) -> list[F.ProbeArg]:
        """The fetch programs, made from the data (a raw fetch arg: parsed as written)."""
        out: list[F.ProbeArg] = []
        for (name, body), (word, col) in zip(self.args, self.words):
            out.append(F.parse_arg(word, col, flags, out) if isinstance(body, str) else
                       F.build_arg(name, body, col, flags, out))
        return out


def _event(c: C.Compiled, source: int, regs) -> ProbeEventDef:
    """The EventDef of a compiled probe, checked as events.parse_line() checks a line."""
    words = c.words()
    wcol = words[1][1]
    if c.symbol is not None and ":" in c.symbol:
        raise E.LineError(wcol, "NO_MODULE")
    if c.is_return and c.offset:
        raise E.LineError(wcol, "BAD_RETPROBE")
    E.check_group(c.group, 2)
    E.check_event(c.event, 2 + len(c.group) + 1)
    ev = ProbeEventDef(0, c.line, c.is_return, c.group, c.event, c.symbol, c.offset, c.addr, 0, words[2:],
                       source=source, args=c.args)
    ev.fetch_args(F.ParseFlags(is_return=c.is_return, fentry=True, regs=regs))
    return ev


def debug_info(image, arch):
    """The image's DWARF (D.DebugInfo), or for a target that names them from BTF (a
    kernel) its types (btfprobe.Types) when no DWARF of it is found; KprewriteError if
    it has neither."""
    cached = getattr(image, "_kp_debug_info", None)
    if cached is not None:
        return cached
    target = image.target
    mode = target.PROBES_BY_NAME
    if not mode:
        raise KprewriteError(f"{image.label}: probes by name (`probes`) are read from a user "
                             f"program's or library's DWARF; this image's target does not have them")
    regs = getattr(arch.fetch_regs, "DWARF_REGS", None)
    if regs is None:
        if mode == "btf":
            return btf_types(image)
        raise KprewriteError(f"{image.label}: probes by name are not supported on {arch.name} "
                             f"(no DWARF register map)")
    if mode == "btf":
        from .btfprobe import KERNEL_GROUP
        data, kw = image.data, dict(names=target.debug_file_names(image), by_address=True,
                                    group=KERNEL_GROUP)
    else:
        with open(image.path, "rb") as f:
            data = f.read()
        kw = {}
    try:
        dbg = D.DebugInfo(image.path, data, regs, getattr(arch.fetch_regs, "DWARF_REG_NAMES", None), **kw)
    except D.NoDebugInfo as e:
        if mode == "btf" and not os.environ.get(D.DEBUG_FILE_ENV):
            image._kp_debug_info = btf_types(image)    # no vmlinux with DWARF: the parameters, from BTF
            return image._kp_debug_info
        raise KprewriteError(str(e)) from None
    except Exception as e:          # pyelftools on a damaged file: one line, not a traceback
        raise KprewriteError(f"{image.label}: cannot read its debug information: "
                             f"{type(e).__name__}: {' '.join(str(e).split())}") from None
    image._kp_debug_info = dbg
    return dbg


def btf_types(image):
    """A kernel image's own BTF, for probes by parameter name (btfprobe.py)."""
    from .btfprobe import Types
    cached = getattr(image, "_kp_probe_btf", None)
    if cached is None:
        types = image.target.probe_btf(image)
        if types is None:
            raise KprewriteError(f"{image.label}: probes by name need the kernel's BTF (.BTF, "
                                 f"CONFIG_DEBUG_INFO_BTF), which this image does not have")
        cached = image._kp_probe_btf = Types(types, image.label)
    return cached


def _compile(dbg, image, d, taken, arch):
    from .btfprobe import Types, compile_def
    if isinstance(dbg, Types):
        return compile_def(dbg, image, d, taken, arch.fetch_regs)
    return C.compile_def(dbg, image, d, taken)


def expand(spec, image, arch) -> list[str]:
    """Compile the spec's `probes` into kprobe and kretprobe tables (appended to
    the spec, as events.expand() does for `events`), recording each compiled line
    in spec.compiled.  Returns the error lines."""
    if not spec.probes:
        return []
    name = spec.name
    errors: list[str] = []
    taken: set[tuple[str, str]] = set()
    for text in spec.events:
        try:
            ev = E.parse_line(text, 0, arch.fetch_regs)
            taken.add((ev.group, ev.event))
        except Exception:
            pass                   # events.expand() reports it
    dbg = None
    for i, text in enumerate(spec.probes, 1):
        where = spec_where(name, spec.table("probes", i))
        try:
            d = parse(text)
        except ProbeSyntaxError as e:
            errors += E.caret_lines(where, text, e.column, e.message)
            continue
        try:
            if dbg is None:
                dbg = debug_info(image, arch)
            compiled = _compile(dbg, image, d, taken, arch)
        except C.ProbeError as e:
            errors.append(f"{where}: {e}")
            continue
        except (ELFError, DWARFError, ELFParseError) as e:      # damaged debug information
            errors.append(f"{where}: cannot read the debug information of {image.label}: "
                          f"{' '.join(str(e).split())}")
            break
        except KprewriteError as e:
            errors += [f"{where}: {line}" for line in e.lines]
            break
        for c in compiled:
            try:
                ev = _event(c, i, arch.fetch_regs)
            except (E.LineError, F.FetchError) as e:
                errors += E.caret_lines(where + ": compiled to", c.line, e.column, e.message)
                continue
            ev.label = spec.labels.get(f"probes[{i}]", "")
            spec.compiled.append((spec.table("probes", i), c.line))
            fetch = c.line[ev.words[0][1]:] if ev.words else ""
            common = dict(table=ev.table, symbol_name=ev.symbol, addr=ev.addr, offset=ev.offset,
                          name=ev.event, fetch=fetch, is_glob=False, event=ev)
            if ev.is_return:
                spec.kretprobes.append(E.EventKretprobeSpec(maxactive=ev.maxactive, **common))
            else:
                spec.kprobes.append(E.EventKprobeSpec(**common))
    return errors


def _load(path: str):
    from ... import targets
    from ...arch import get_arch
    image = targets.load(path)
    return image, get_arch(image.machine)


def list_vars(path: str, point: str) -> list[str]:
    """`probe-vars`: the variables at each address of a probe point."""
    from .listing import vars_lines
    return vars_lines(*_load(path), point)


def list_lines(path: str, function: str) -> list[str]:
    """`probe-lines`: a function's probe-able lines."""
    from .listing import lines_lines
    return lines_lines(*_load(path), function)


def vars_doc(path: str, point: str) -> dict:
    """`probe-vars --format json`."""
    from .listing import vars_doc as records
    return {"format": "kprewrite-probe-vars-1", "input": os.path.basename(path), "point": point,
            "sites": records(list_vars(path, point))}


def lines_doc(path: str, function: str) -> dict:
    """`probe-lines --format json`."""
    from .listing import lines_doc as doc
    return {"format": "kprewrite-probe-lines-1", "input": os.path.basename(path), **doc(*_load(path), function)}
