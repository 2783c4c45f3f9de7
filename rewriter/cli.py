"""The command line (docs/reference/cli.md, with what it marks as extensions): instrument, check,
list, blacklist, trace, diff, report.  A thin layer: it formats what api.py returns."""
from __future__ import annotations

import gc
import os
import sys
import time
import warnings

import click

from . import __version__
from .errors import KprewriteError


def _fail(lines) -> None:
    for line in lines:
        click.echo(f"kprewrite: {line}", err=True)
    sys.exit(1)


def _reader_gone() -> None:
    """Standard output's reader has gone (`kprewrite blacklist IMAGE | head -1`): stop
    quietly, as a C program killed by SIGPIPE does (`perf list | head`), with its status
    (128 + SIGPIPE).  Standard output is pointed at /dev/null so that nothing still
    buffered for it fails again at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    sys.exit(128 + 13)


def _guard(fn):
    def run(*a, **kw):
        # LIEF reads an unknown enum value (a section type, a dynamic tag of a damaged or
        # newer ELF) as its number, warning as it does: a number is all kprewrite needs.
        warnings.filterwarnings("ignore", r"\d+ is not a valid", RuntimeWarning)
        try:
            r = fn(*a, **kw)
            sys.stdout.flush()          # a closed pipe is found here, not at the interpreter's exit
            return r
        except BrokenPipeError:
            _reader_gone()
        except KprewriteError as e:
            _fail(e.lines)
        except KeyboardInterrupt:       # Ctrl-C: 128 + SIGINT, as a shell reports a command it interrupted
            click.echo("kprewrite: interrupted", err=True)
            sys.exit(130)
        except Exception as e:   # a bug: still one line, traceback only on request
            if os.environ.get("KPREWRITE_DEBUG"):
                raise
            _fail([f"internal error: {type(e).__name__}: {e} (set KPREWRITE_DEBUG=1 for a traceback)"])
    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


@click.group()
@click.version_option(__version__, prog_name="kprewrite")
def main():
    """kprewrite: Linux-style kprobes compiled ahead of time into ELF images."""
    from . import safety
    # A rewrite allocates millions of small objects (decoded instructions, rows, plan
    # records) and frees few cycles: the cyclic collector's default pace (every 700
    # allocations, rescanning what survived) costs some 20% of a large rewrite's CPU.
    gc.set_threshold(100_000, 20, 100)
    try:
        safety.check_environment()      # KPREWRITE_UNSAFE_OFF: the test suite's only
        if os.environ.get("KPREWRITE_JOBS"):    # named at once, not only when no cached result skips decoding
            from .analysis.workers import jobs
            jobs()
    except KprewriteError as e:
        _fail(e.lines)


FORMAT = click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
                      help="json: one JSON document (docs/reference/json.md)")


def _json(doc) -> None:
    import json
    click.echo(json.dumps(doc, sort_keys=True))


@main.command()
@click.argument("input_path", metavar="INPUT")
@click.option("--spec", "spec_path", required=True, metavar="SPEC.toml", help="probe spec")
@click.option("-o", "output", required=True, metavar="OUTPUT", help="rewritten image")
@click.option("--no-optimize", is_flag=True, help="no jump optimization (debug.kprobes_optimization=0)")
@click.option("--system-map", metavar="FILE", help="a kernel image's symbols from this System.map "
              "(a kernel module: the kernel's Module.symvers)")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="json: the summary as JSON lines on standard output")
@click.option("--depfile", metavar="FILE",
              help="also write a make/ninja depfile: OUTPUT's prerequisites (spec, handlers and their headers, runtime)")
@click.option("-q", "--quiet", is_flag=True,
              help="print nothing on success, not even progress (errors still go to standard error)")
@_guard
def instrument(input_path, spec_path, output, no_optimize, system_map, fmt, depfile, quiet):
    """Write OUTPUT: INPUT with the spec's probes compiled in."""
    from . import api
    t = time.monotonic()
    r = api.instrument(input_path, spec_path, output, optimize=not no_optimize, system_map=system_map,
                       progress=not quiet, depfile=depfile)
    if quiet:
        return
    if fmt == "json":
        for check, n in r.skipped.items():
            _json({"type": "skipped", "check": check, "count": n})
        _json(r.summary)
        return
    for line in r.skipped_lines:
        click.echo(f"kprewrite: {line}", err=True)
    if os.environ.get("KPREWRITE_VERBOSE"):
        click.echo(f"kprewrite: wrote {output} in {time.monotonic() - t:.2f} s", err=True)


@main.command()
@click.argument("input_path", metavar="INPUT")
@click.option("--spec", "spec_path", required=True, metavar="SPEC.toml")
@click.option("--no-optimize", is_flag=True)
@click.option("--system-map", metavar="FILE", help="a kernel image's symbols from this System.map")
@FORMAT
@_guard
def check(input_path, spec_path, no_optimize, system_map, fmt):
    """Print the plan: each probe's decision and, if not optimized, why."""
    from . import api, report
    r = api.check(input_path, spec_path, optimize=not no_optimize, system_map=system_map, progress=True)
    if fmt == "json":
        _json(r.as_dict())
    else:
        for line in r.lines():
            click.echo(line)
        for line in r.notes:
            click.echo(f"kprewrite: {line}", err=True)
        for line in report.skipped_text(r.skipped, sum(1 for p in r.probes if p["decision"] != "refused")):
            click.echo(f"kprewrite: {line}", err=True)
    if r.errors:
        _fail(r.errors)


@main.command(name="list")
@click.argument("binary", metavar="BINARY")
@FORMAT
@_guard
def list_(binary, fmt):
    """Probes compiled into a rewritten binary (debugfs kprobes/list form)."""
    from . import report
    if fmt == "json":
        _json(report.list_doc(binary))
        return
    for line in report.list_lines(binary):
        click.echo(line)


@main.command()
@click.argument("input_path", metavar="INPUT")
@click.option("--system-map", metavar="FILE", help="a kernel image's symbols from this System.map")
@FORMAT
@_guard
def blacklist(input_path, system_map, fmt):
    """What cannot be probed in INPUT, and why."""
    from . import report
    if fmt == "json":
        _json(report.blacklist_doc(input_path, system_map))
        return
    for line in report.blacklist_lines(input_path, system_map):
        click.echo(line)


@main.command(name="probe-vars")
@click.argument("input_path", metavar="INPUT")
@click.argument("point", metavar="POINT")
@_guard
def probe_vars(input_path, point):
    """Variables at a probe point (FUNC[:RLN|+OFFS], SRC:ALN) and their fetch args, like perf probe -V."""
    from .probes import perfprobe
    for line in perfprobe.list_vars(input_path, point):
        click.echo(line)


@main.command(name="probe-lines")
@click.argument("input_path", metavar="INPUT")
@click.argument("function", metavar="FUNC[@SRC]")
@_guard
def probe_lines(input_path, function):
    """A function's source lines that can be probed as FUNC:RLN, like perf probe -L."""
    from .probes import perfprobe
    for line in perfprobe.list_lines(input_path, function):
        click.echo(line)


@main.command()
@click.argument("original", metavar="ORIGINAL")
@click.argument("rewritten", metavar="REWRITTEN")
@click.option("--system-map", metavar="FILE", help="a kernel image's symbols from this System.map")
@FORMAT
@_guard
def diff(original, rewritten, system_map, fmt):
    """Attribute every byte REWRITTEN changed in ORIGINAL to a probe site; exit 1 if one is not."""
    from . import api
    r = api.diff(original, rewritten, system_map=system_map)
    if fmt == "json":
        _json(r.doc)
    else:
        for line in r.lines():
            click.echo(line)
    if not r.ok:
        _fail([f"{e}" for e in r.errors])


@main.command()
@click.argument("trace_file", metavar="FILE")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "chrome", "graph", "text"]), default="jsonl",
              show_default=True,
              help="jsonl: one JSON object per trace line; chrome: trace-event JSON for Perfetto / chrome://tracing; "
                   "graph: nested calls with durations, as ftrace's function_graph prints them; "
                   "text: the trace lines (a binary trace's formatted as the kernel's trace lines)")
@click.option("-o", "output", metavar="OUT", help="write here instead of standard output")
@_guard
def trace(trace_file, fmt, output):
    """Convert trace lines or a binary trace (KPREWRITE_TRACE output) to JSON lines, a Chrome/Perfetto timeline,
    a call graph or text lines."""
    import json
    from .trace import formats as tracefmt
    if output:
        from .output import refuse_same
        refuse_same(output, {"FILE": trace_file})
    records = tracefmt.read(trace_file)
    if fmt == "jsonl":
        text = tracefmt.jsonl(records)
    elif fmt == "text":
        text = tracefmt.text(records)
    elif fmt == "graph":
        from .trace import callgraph
        text = callgraph.graph_text(callgraph.build(records))
    else:
        text = json.dumps(tracefmt.chrome(records, os.path.basename(trace_file)), sort_keys=True) + "\n"
    if output:
        from .output import write_all
        umask = os.umask(0o022)
        os.umask(umask)
        write_all([(output, text.encode(), 0o666 & ~umask)])
    else:
        click.echo(text, nl=False)


@main.command()
@click.argument("trace_file", metavar="TRACE")
@click.option("--plot", metavar="FILE.svg", help="also write the histograms as an SVG plot")
@FORMAT
@_guard
def report(trace_file, plot, fmt):
    """Per-event counts, calls (total/self time per function, the slowest) and log2 histograms of trace lines."""
    from .trace import formats as tracefmt, report as tracereport
    from .output import write_atomically
    if plot and not plot.lower().endswith(".svg"):
        raise KprewriteError(f"{plot}: --plot writes SVG; name the file *.svg")
    if plot:
        from .output import refuse_same
        refuse_same(plot, {"TRACE": trace_file})
    records = tracefmt.read(trace_file)
    s = tracereport.summary(records)
    if plot:
        data = tracereport.svg(s, f"kprewrite report {os.path.basename(trace_file)}").encode()
        d = os.path.dirname(os.path.abspath(plot))
        if not os.path.isdir(d):
            raise KprewriteError(f"{plot}: cannot write: no such directory")
        write_atomically(plot, data, trace_file if trace_file != "-" else d)
        os.chmod(plot, 0o644)
    if fmt == "json":
        _json({"format": "kprewrite-report-1", "events": [{"event": e, "count": n} for e, n in s["events"]],
               "calls": s["calls"],
               "histograms": [{"name": h["name"], "count": h["count"],
                               "buckets": [{"bucket": b, "count": n} for b, n in h["buckets"]]}
                              for h in s["histograms"]]})
    else:
        click.echo(tracereport.text(s), nl=False)
