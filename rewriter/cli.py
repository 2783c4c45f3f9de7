"""The command line (interface.md): instrument, check, list, blacklist."""
from __future__ import annotations

import os
import sys
import time
import warnings

import click

from .errors import KprewriteError


def _fail(lines) -> None:
    for line in lines:
        click.echo(f"kprewrite: {line}", err=True)
    sys.exit(1)


def _guard(fn):
    def run(*a, **kw):
        # LIEF reads an unknown enum value (a section type, a dynamic tag of a damaged or
        # newer ELF) as its number, warning as it does: a number is all kprewrite needs.
        warnings.filterwarnings("ignore", r"\d+ is not a valid", RuntimeWarning)
        try:
            return fn(*a, **kw)
        except KprewriteError as e:
            _fail(e.lines)
        except KeyboardInterrupt:
            _fail(["interrupted"])
        except Exception as e:   # a bug: still one line, traceback only on request
            if os.environ.get("KPREWRITE_DEBUG"):
                raise
            _fail([f"internal error: {type(e).__name__}: {e} (set KPREWRITE_DEBUG=1 for a traceback)"])
    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


@click.group()
@click.version_option(package_name="kprewrite")
def main():
    """kprewrite: Linux-style kprobes compiled ahead of time into ELF images."""


@main.command()
@click.argument("input_path", metavar="INPUT")
@click.option("--spec", "spec_path", required=True, metavar="SPEC.toml", help="probe spec")
@click.option("-o", "output", required=True, metavar="OUTPUT", help="rewritten image")
@click.option("--no-optimize", is_flag=True, help="no jump optimization (debug.kprobes_optimization=0)")
@click.option("--system-map", metavar="FILE", help="a kernel image's symbols from this System.map")
@_guard
def instrument(input_path, spec_path, output, no_optimize, system_map):
    """Write OUTPUT: INPUT with the spec's probes compiled in."""
    from . import pipeline, report
    if os.path.abspath(output) == os.path.abspath(input_path):
        raise KprewriteError(f"{output}: OUTPUT must differ from INPUT (INPUT is never modified)")
    t = time.monotonic()
    s = pipeline.instrument(input_path, spec_path, output, no_optimize, system_map)
    for line in report.skipped_summary(s.plan):
        click.echo(f"kprewrite: {line}", err=True)
    if os.environ.get("KPREWRITE_VERBOSE"):
        click.echo(f"kprewrite: wrote {output} in {time.monotonic() - t:.2f} s", err=True)


@main.command()
@click.argument("input_path", metavar="INPUT")
@click.option("--spec", "spec_path", required=True, metavar="SPEC.toml")
@click.option("--no-optimize", is_flag=True)
@click.option("--system-map", metavar="FILE", help="a kernel image's symbols from this System.map")
@_guard
def check(input_path, spec_path, no_optimize, system_map):
    """Print the plan: each probe's decision and, if not optimized, why."""
    from . import pipeline, report
    s = pipeline.prepare_for_check(input_path, spec_path, no_optimize, system_map)
    for line in report.check_lines(s.plan):
        click.echo(line)
    for line in report.skipped_summary(s.plan):
        click.echo(f"kprewrite: {line}", err=True)
    if s.plan.errors:
        _fail(s.plan.errors)


@main.command(name="list")
@click.argument("binary", metavar="BINARY")
@_guard
def list_(binary):
    """Probes compiled into a rewritten binary (debugfs kprobes/list form)."""
    from . import report
    for line in report.list_lines(binary):
        click.echo(line)


@main.command()
@click.argument("input_path", metavar="INPUT")
@click.option("--system-map", metavar="FILE", help="a kernel image's symbols from this System.map")
@_guard
def blacklist(input_path, system_map):
    """What cannot be probed in INPUT, and why."""
    from . import report
    for line in report.blacklist_lines(input_path, system_map):
        click.echo(line)


@main.command()
@click.argument("trace_file", metavar="FILE")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "chrome"]), default="jsonl", show_default=True,
              help="jsonl: one JSON object per trace line; chrome: trace-event JSON for Perfetto / chrome://tracing")
@click.option("-o", "output", metavar="OUT", help="write here instead of standard output")
@_guard
def trace(trace_file, fmt, output):
    """Convert trace lines (KPREWRITE_TRACE output) to JSON lines or a Chrome/Perfetto timeline."""
    import json
    from . import tracefmt
    records = tracefmt.read(trace_file)
    if fmt == "jsonl":
        text = tracefmt.jsonl(records)
    else:
        text = json.dumps(tracefmt.chrome(records, os.path.basename(trace_file)), sort_keys=True) + "\n"
    if output:
        try:
            with open(output, "w") as f:
                f.write(text)
        except OSError as e:
            raise KprewriteError(f"{output}: cannot write: {e.strerror}")
    else:
        click.echo(text, nl=False)
