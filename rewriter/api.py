"""The Python API: the CLI's commands as functions, with the same semantics.

    from rewriter import instrument, check, read_probes, read_blacklist, KprewriteError

Each returns the records that `--format json` prints (docs/reference/json.md;
the API: docs/reference/python-api.md); every failure is a KprewriteError whose `lines` are the CLI's error
lines (str(e) joins them).  Nothing here prints.  The CLI (cli.py) only formats
what these return.
"""
from __future__ import annotations

from dataclasses import dataclass, field



@dataclass
class CheckResult:
    """`check`: each probe's decision and, if not optimized, why (report.check_records)."""
    input: str
    probes: list[dict]
    skipped: dict[str, int] = field(default_factory=dict)   # glob probes skipped, by check name
    errors: list[str] = field(default_factory=list)          # what makes `instrument` refuse the spec
    format: str = "kprewrite-check-1"
    compiled: list[dict] = field(default_factory=list)       # the spec's `probes` as kprobe_events lines
    notes: list[str] = field(default_factory=list)           # what the target says of the output (standard error)

    @property
    def ok(self) -> bool:
        """instrument would succeed (register_kprobes() all or nothing)."""
        return not self.errors

    def as_dict(self) -> dict:
        d = {"format": self.format, "input": self.input, "probes": self.probes,
             "skipped": self.skipped, "errors": self.errors}
        if self.compiled:
            d["compiled"] = self.compiled
        if self.notes:
            d["notes"] = self.notes
        return d

    def lines(self) -> list[str]:
        from .report import check_line
        return [check_line(r) for r in self.probes] + [f"{c['table']}: {c['event']}" for c in self.compiled]


@dataclass
class InstrumentResult:
    """`instrument`: what was written, and the plan it was written from."""
    output: str
    probes: list[dict]               # as check's, for the placed probes
    skipped: dict[str, int]
    summary: dict                    # report.instrument_summary
    skipped_lines: list[str]         # the text summary the CLI prints on standard error
    deps: list[str] = field(default_factory=list)   # every file the rewrite read (what --depfile lists)


def _progress(on: bool):
    from .progress import NoProgress, Progress
    return Progress() if on else NoProgress()


def _spec(spec, options: dict):
    """The spec file's path as a string, or with probes given as options (the CLI's
    --kprobe, --event...), the spec they and the file make (spec.from_options)."""
    from .probes.spec import from_options
    if spec is not None and not any(options.values()):
        return str(spec)
    return from_options(None if spec is None else str(spec), **options)


def check(input_path, spec=None, *, optimize: bool = True, system_map=None, progress: bool = False,
          events=(), probes=(), kprobes=(), kretprobes=(), graphs=(), handlers=()) -> CheckResult:
    """The plan, nothing written.  Refused probes are in `probes` (decision
    "refused") and, when named exactly, in `errors`; a bad spec or image raises.
    progress: show each stage on standard error if it is a terminal.
    events, probes, kprobes, kretprobes, graphs, handlers: probes added to the spec
    file's (or instead of one, spec=None), as the command line's --event, --probe,
    --kprobe, --kretprobe, --graph and --handlers give them."""
    from . import pipeline, report
    spec = _spec(spec, dict(events=events, probes=probes, kprobes=kprobes, kretprobes=kretprobes,
                            graphs=graphs, handlers=handlers))
    s, handler_errors = pipeline.prepare_for_check(str(input_path), spec, not optimize,
                                                   str(system_map) if system_map else None,
                                   _progress(progress))
    d = report.check_doc(s.plan, s.image.label)
    return CheckResult(d["input"], d["probes"], d["skipped"], d["errors"] + handler_errors,
                       compiled=[{"table": t, "event": line} for t, line in s.spec.compiled], notes=_notes(s))


def instrument(input_path, spec, output, *, optimize: bool = True, system_map=None,
               progress: bool = False, depfile=None, events=(), probes=(), kprobes=(), kretprobes=(),
               graphs=(), handlers=()) -> InstrumentResult:
    """Write `output`: `input_path` with the spec's probes compiled in, atomically,
    all or nothing.  Raises KprewriteError (every failing probe named) and
    writes nothing if any probe named exactly cannot be placed.  depfile: also
    write a make/ninja depfile there, naming every file the rewrite read.
    events, probes, kprobes, kretprobes, graphs, handlers: as for check()."""
    from . import pipeline, report
    input_path, output = str(input_path), str(output)
    from .output import refuse_same
    spec = _spec(spec, dict(events=events, probes=probes, kprobes=kprobes, kretprobes=kretprobes,
                            graphs=graphs, handlers=handlers))
    spec_file = spec if isinstance(spec, str) else (str(spec.path) if spec.path else None)
    # Compared as files (device and inode), not names: a symbolic or hard link to INPUT is INPUT.
    inputs = {"INPUT": input_path, "the spec": spec_file, "the System.map": str(system_map) if system_map else None}
    refuse_same(output, inputs)
    if depfile:
        refuse_same(str(depfile), {**inputs, "OUTPUT": output})
    read: list[str] = []
    s = pipeline.instrument(input_path, spec, output, not optimize,
                            str(system_map) if system_map else None, _progress(progress),
                            str(depfile) if depfile else None, read)
    return InstrumentResult(output, report.check_records(s.plan), report.skipped_counts(s.plan),
                            report.instrument_summary(s.plan, output), _notes(s) + report.skipped_summary(s.plan),
                            deps=read)


def _notes(s) -> list[str]:
    """A target's one-line notes on what it writes (a module's events without the kernel's
    BTF: linux_module.notes())."""
    return s.target.notes(s.image, s.traces)


def read_probes(binary) -> list[dict]:
    """The probes compiled into a rewritten image (`list`), from its .kprewrite.meta."""
    from . import report
    return report.list_records(str(binary))


@dataclass
class DiffResult:
    """`diff`: every change `rewritten` made to `original`, attributed (changes.diff)."""
    doc: dict

    @property
    def ok(self) -> bool:
        """Every changed byte is explained (`kprewrite diff` exits 0)."""
        return not self.doc["unattributed"] and not self.doc["problems"]

    @property
    def changes(self) -> list[dict]:
        return self.doc["changes"]

    @property
    def errors(self) -> list[str]:
        from .changes import diff_errors
        return diff_errors(self.doc, self.doc["rewritten"])

    def lines(self) -> list[str]:
        from .changes import diff_lines
        return diff_lines(self.doc)


def diff(original, rewritten, *, system_map=None) -> DiffResult:
    """Which bytes of `original` the rewrite `rewritten` changed, and which probe
    site (or known part of the rewrite) explains each; what it added."""
    from . import changes
    return DiffResult(changes.diff(str(original), str(rewritten), str(system_map) if system_map else None))


def read_blacklist(input_path, *, system_map=None) -> list[dict]:
    """What cannot be probed in an image, and why (`blacklist`)."""
    from . import report
    return report.blacklist_records(str(input_path), str(system_map) if system_map else None)
