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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kprewrite")
def main():
    """kprewrite: Linux-style kprobes compiled ahead of time into ELF images.

    The probes are the kernel's (kprobes, kretprobes, kprobe_events lines, perf probe
    definitions), given as options or in a spec file; the output runs as the input did.
    `kprewrite COMMAND -h` shows a command's options and examples, `man kprewrite` (or
    `kprewrite man | man -l -`) the manual."""
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
                      help="json: one JSON document, its schema named by its \"format\" key")


def probe_options(fn):
    """--spec and the probes given on the command line, which add to the spec file's."""
    for opt in reversed([
        click.option("--spec", "spec_path", metavar="SPEC.toml", help="probe spec (optional with probe options)"),
        click.option("--kprobe", "kprobes", multiple=True, metavar="SYM",
                     help="a kprobe: 'SYM[+OFFS] [KEY=VALUE]...', SYM a symbol, glob or address, KEY a "
                          "[[kprobe]] key (pre_handler=NAME, fetch=ARGS...)"),
        click.option("--kretprobe", "kretprobes", multiple=True, metavar="SYM",
                     help="a kretprobe: 'SYM [KEY=VALUE]...' (handler=NAME, maxactive=N...)"),
        click.option("--event", "events", multiple=True, metavar="LINE", help="a kprobe_events line"),
        click.option("--probe", "probes", multiple=True, metavar="DEF",
                     help="a perf probe definition (FUNC:RLN VAR..., from DWARF)"),
        click.option("--graph", "graphs", multiple=True, metavar="GLOB",
                     help="trace entries and returns of the matching functions ([[function_graph]])"),
        click.option("--handlers", "handlers", multiple=True, metavar="FILE",
                     help="a C source or object file with handlers"),
    ]):
        fn = opt(fn)
    return fn


def _probes(kw: dict) -> dict:
    """The probe options' values, for api.check() and api.instrument()."""
    return {k: kw.pop(k) for k in ("events", "probes", "kprobes", "kretprobes", "graphs", "handlers")}


def _json(doc) -> None:
    import json
    click.echo(json.dumps(doc, sort_keys=True))


@main.command()
@click.argument("input_path", metavar="INPUT")
@probe_options
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
def instrument(input_path, spec_path, output, no_optimize, system_map, fmt, depfile, quiet, **kw):
    """Write OUTPUT: INPUT with the probes (options, --spec or both) compiled in."""
    from . import api
    t = time.monotonic()
    r = api.instrument(input_path, spec_path, output, optimize=not no_optimize, system_map=system_map,
                       progress=not quiet, depfile=depfile, **_probes(kw))
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
@probe_options
@click.option("--no-optimize", is_flag=True, help="no jump optimization (debug.kprobes_optimization=0)")
@click.option("--system-map", metavar="FILE", help="a kernel image's symbols from this System.map")
@FORMAT
@_guard
def check(input_path, spec_path, no_optimize, system_map, fmt, **kw):
    """Print the plan: each probe's decision and, if not optimized, why."""
    from . import api, report
    r = api.check(input_path, spec_path, optimize=not no_optimize, system_map=system_map, progress=True,
                  **_probes(kw))
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


@main.command()
@click.argument("input_path", metavar="IMAGE")
@click.argument("pattern", metavar="[GLOB]", default="*")
@click.option("--no-optimize", is_flag=True, help="no jump optimization (debug.kprobes_optimization=0)")
@click.option("--system-map", metavar="FILE", help="a kernel image's symbols from this System.map")
@FORMAT
@_guard
def funcs(input_path, pattern, no_optimize, system_map, fmt):
    """What a kprobe on each function's entry would be, like perf probe -F.

    One line per function whose name matches GLOB (fnmatch; default *), in address order:
    check's line for `--kprobe FUNC` (optimized, ftrace, int3, refused, and why), each
    function planned alone."""
    from . import funcs as F
    kw = dict(optimize=not no_optimize, system_map=system_map)
    if fmt == "json":
        _json(F.doc(input_path, pattern, **kw))
        return
    for line in F.lines(input_path, pattern, **kw):
        click.echo(line)


@main.command(name="probe-vars")
@click.argument("input_path", metavar="INPUT")
@click.argument("point", metavar="POINT")
@FORMAT
@_guard
def probe_vars(input_path, point, fmt):
    """Variables at a probe point (FUNC[:RLN|+OFFS], SRC:ALN) and their fetch args, like perf probe -V."""
    from .probes import perfprobe
    if fmt == "json":
        _json(perfprobe.vars_doc(input_path, point))
        return
    for line in perfprobe.list_vars(input_path, point):
        click.echo(line)


@main.command(name="probe-lines")
@click.argument("input_path", metavar="INPUT")
@click.argument("function", metavar="FUNC[@SRC]")
@FORMAT
@_guard
def probe_lines(input_path, function, fmt):
    """A function's source lines that can be probed as FUNC:RLN, like perf probe -L."""
    from .probes import perfprobe
    if fmt == "json":
        _json(perfprobe.lines_doc(input_path, function))
        return
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
    _trace_text(trace_file, fmt, output)


def _trace_text(trace_file, fmt, output, records=None):
    import json
    from .trace import formats as tracefmt
    if output:
        from .output import refuse_same
        refuse_same(output, {"FILE": trace_file})
    if records is None and fmt == "graph":
        from .trace import stream
        plan = stream.read(trace_file)
        if plan is not None:        # a binary trace read a thread at a time, not into memory
            _streamed(output, lambda write: stream.graph(plan, write))
            return
    if records is None:
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


def _streamed(output, produce) -> None:
    """Text made a part at a time (produce(write)), to OUT or standard output."""
    if output:
        from .output import write_streamed
        umask = os.umask(0o022)
        os.umask(umask)
        write_streamed(output, produce, 0o666 & ~umask)
    else:
        produce(lambda s: click.echo(s, nl=False))


@main.command()
@click.argument("trace_file", metavar="TRACE")
@click.option("--plot", metavar="FILE.svg", help="also write the histograms as an SVG plot")
@FORMAT
@_guard
def report(trace_file, plot, fmt):
    """Per-event counts, calls (total/self time per function, the slowest) and log2 histograms of trace lines."""
    from .trace import formats as tracefmt, report as tracereport, stream
    from .output import write_atomically
    if plot and not plot.lower().endswith(".svg"):
        raise KprewriteError(f"{plot}: --plot writes SVG; name the file *.svg")
    if plot:
        from .output import refuse_same
        refuse_same(plot, {"TRACE": trace_file})
    plan = stream.read(trace_file)     # a binary trace read a thread at a time, not into memory
    s = stream.summary(plan) if plan is not None else tracereport.summary(tracefmt.read(trace_file))
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


@main.command(context_settings={"allow_interspersed_args": False})
@probe_options
@click.option("-o", "output", metavar="FILE", default="kprewrite.data", show_default=True,
              help="the recording (binary records); an existing FILE is renamed FILE.old")
@click.option("--no-optimize", is_flag=True, help="no jump optimization (debug.kprobes_optimization=0)")
@click.option("--lib", "libs", multiple=True, metavar="LIB",
              help="also rewrite this library PROG loads (a path, or a name as ldd lists it: libz.so.1, libz), "
                   "with the probes whose functions it has")
@click.option("-v", "--verbose", is_flag=True, help="say whether the rewrite came from the cache, and what "
                                                    "the globs skipped")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- PROG [ARGS]...")
@_guard
def record(spec_path, output, no_optimize, libs, verbose, command, **kw):
    """Rewrite PROG with the probes (cached), run it, and record its hits into FILE.

    As `uftrace record` and `perf record`: PROG is rewritten into kprewrite's cache (keyed by its
    bytes and the probes, so a second record starts at once), run with ARGS and its own input and
    output, and its hits stored as binary records in FILE, for `kprewrite replay`, `trace` and
    `report`. With no probes, --graph '*': the calls of every function. The exit status is PROG's."""
    from . import record as R
    R.check_output(output)
    t = time.monotonic()
    exe, tmp, cached, lib_dir = R.rewrite(command[0], spec_path, _probes(kw), optimize=not no_optimize,
                                          progress=True, verbose=verbose, libs=libs)
    try:
        if verbose:
            click.echo(f"kprewrite: {'cached' if cached else 'rewrote'} {command[0]} as {exe} "
                       f"({time.monotonic() - t:.2f} s)", err=True)
        status = R.run(exe, list(command), output, lib_dir)
    finally:
        if tmp is not None:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        click.echo(f"kprewrite: {command[0]} exited with status {status}; recorded into {output}", err=True)
    sys.exit(status)


@main.command()
@click.argument("trace_file", metavar="[FILE]", default="kprewrite.data")
@click.option("--format", "fmt", type=click.Choice(["graph", "text", "jsonl", "chrome"]), default="graph",
              show_default=True, help="graph: the calls nested with their durations, other events as comments; "
                                      "text: the trace lines; jsonl, chrome: as trace prints them")
@_guard
def replay(trace_file, fmt):
    """Print a recording (of record, or any trace): its call graph, or its trace lines.

    What `trace FILE --format graph` (or text) prints, as `uftrace replay` prints a record's calls."""
    from .trace import formats as tracefmt, stream
    plan = stream.read(trace_file) if fmt == "graph" else None
    records = None if plan is not None else tracefmt.read(trace_file)
    if (plan.nrecords == 0) if plan is not None else not records:
        # a binary recording whose probes wrote no trace line: say why rather than print nothing
        click.echo(f"kprewrite: {trace_file}: nothing recorded (a --kprobe or --kretprobe without fetch= only "
                   f"counts its hits; trace lines come from --event, --probe, --graph or fetch=)", err=True)
        return
    if plan is not None:
        _streamed(None, lambda write: stream.graph(plan, write))
        return
    _trace_text(trace_file, fmt, None, records)


@main.command(name="man")
@click.argument("command", metavar="[COMMAND]", required=False)
@click.option("-o", "--output-dir", metavar="DIR", help="write every page (kprewrite.1, kprewrite-COMMAND.1) into DIR")
@_guard
def man(command, output_dir):
    """Print the manual page of kprewrite (or of COMMAND) in roff.

    With -o DIR, write every page (kprewrite.1, kprewrite-COMMAND.1) into DIR instead.
    A wheel installs them into share/man/man1, where `man kprewrite` finds them."""
    from . import manpage
    if output_dir:
        if command:
            raise KprewriteError("give COMMAND or --output-dir, not both")
        for path in manpage.write(output_dir, main):
            click.echo(path)
        return
    if command is None:
        click.echo(manpage.main_page(main), nl=False)
    elif command in main.commands:
        click.echo(manpage.command_page(main, command), nl=False)
    else:
        raise KprewriteError(f"no such command: {command!r} (the commands: {', '.join(sorted(main.commands))})")


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--print-path", is_flag=True, help="print the path of the gdb helper script and exit")
@click.argument("args", nargs=-1, type=click.UNPROCESSED, metavar="[PROG [ARGS]...]")
@_guard
def gdb(print_path, args):
    """Run PROG under gdb with kprewrite's gdb helper loaded.

    The helper's `kp-run` and `kp-continue` pass the SIGTRAPs of breakpoint (int3) probes
    on to the program, and still stop at gdb's own breakpoints."""
    import shutil
    from .link.resources import gdb_helper
    helper = gdb_helper()
    if print_path:
        click.echo(str(helper))
        return
    if not args:
        raise KprewriteError("name the program to debug: kprewrite gdb PROG [ARGS]...")
    exe = shutil.which("gdb")
    if exe is None:
        raise KprewriteError("gdb: not found on PATH")
    os.execv(exe, [exe, "-x", str(helper), "--args", *args])


@main.command()
@click.argument("image", metavar="IMAGE")
@click.option("--run", "commands", multiple=True, metavar="CMD",
              help="a shell command the initramfs runs after mounting proc, sysfs, debugfs and tracefs "
                   "(repeatable; then it powers off)")
@click.option("--initrd", metavar="FILE", help="boot with this initramfs instead of the busybox one")
@click.option("--write-initrd", metavar="FILE", help="write the busybox initramfs to FILE and boot nothing")
@click.option("--busybox", default="/bin/busybox", show_default=True, metavar="PATH",
              help="a static busybox of the image's architecture (Debian's busybox-static)")
@click.option("--append", default="", metavar="ARGS", help="more kernel command-line parameters")
@click.option("-m", "--memory", default=512, show_default=True, metavar="MiB")
@click.option("--smp", default=2, show_default=True, metavar="N")
@click.option("--timeout", default=300, show_default=True, metavar="SECONDS", help="kill QEMU after this long")
@click.option("--accel", type=click.Choice(["tcg", "kvm"]), default="tcg", show_default=True,
              help="QEMU's accelerator (kvm: where the host's KVM boots guests)")
@_guard
def boot(image, commands, initrd, write_initrd, busybox, append, memory, smp, timeout, accel):
    """Boot a kernel image in QEMU with a minimal busybox initramfs; print its console.

    IMAGE is a bzImage or vmlinux (x86-64) or an arm64 Image, rewritten or not.  The
    initramfs mounts /proc, /sys, debugfs and tracefs, runs each --run command, and
    powers the machine off; the exit status is 0 when it did."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path
    from . import boot as B
    from .arch import host_machine
    from .targets import load
    loaded = load(image)
    if loaded.target.name != "linux_kernel":
        raise KprewriteError(f"{image}: not a kernel image (boot takes a vmlinux, a bzImage or an arm64 Image)")
    machine = loaded.machine
    runner = ()
    if machine != host_machine() and shutil.which(f"qemu-{machine}"):
        runner = (f"qemu-{machine}",)
    with tempfile.TemporaryDirectory(prefix="kprewrite-boot-") as tmp:
        if initrd is None:
            data = B.initramfs(list(commands), busybox, runner)
            if write_initrd:
                Path(write_initrd).write_bytes(data)
                click.echo(write_initrd)
                return
            initrd = os.path.join(tmp, "initrd.gz")
            Path(initrd).write_bytes(data)
        cmd = B.command(image, machine, initrd, append, memory, smp, accel)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        done = False
        try:
            for raw in proc.stdout:
                line = raw.decode("utf-8", errors="replace").replace("\r", "")
                done = done or B.DONE in line
                click.echo(line, nl=False)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise KprewriteError(f"{image}: QEMU still running after {timeout} s: killed")
    if not done:
        raise KprewriteError(f"{image}: the boot did not reach the initramfs' end (QEMU exit {proc.returncode})")


# Each command's help ends with examples (and so does its manual page).
EXAMPLES = {
    "instrument": """\
kprewrite instrument prog --kprobe work -o prog.kp
kprewrite instrument prog --event 'p:ev work x=$arg1:s32' -o prog.kp
kprewrite instrument prog --probe 'parse_line:4 sum buf:string' -o prog.kp
kprewrite instrument prog --handlers h.c --kprobe 'work pre_handler=pre' -o prog.kp
kprewrite instrument prog --spec probes.toml -o prog.kp
KPREWRITE_PROFILE=- ./prog.kp""",
    "check": """\
kprewrite check prog --kprobe 'work*' --kretprobe main
kprewrite check prog --spec probes.toml --format json
kprewrite check vmlinuz --spec probes.toml""",
    "record": """\
kprewrite record -- ./prog input.txt
kprewrite record --graph 'parse_*' -o parse.rec -- ./prog input.txt
kprewrite record --event 'p:ev work x=$arg1:s32' -- ./prog
kprewrite record --graph 'deflate*' --graph main --lib libz.so.1 -- ./prog
kprewrite replay parse.rec""",
    "replay": """\
kprewrite replay
kprewrite replay parse.rec --format text
kprewrite report parse.rec""",
    "funcs": """\
kprewrite funcs prog
kprewrite funcs prog 'parse_*' --format json
kprewrite funcs vmlinuz 'do_sys_*'""",
    "list": """\
kprewrite list prog.kp
kprewrite list prog.kp --format json""",
    "blacklist": """\
kprewrite blacklist prog
kprewrite blacklist vmlinuz --format json""",
    "trace": """\
KPREWRITE_TRACE=trace.txt ./prog.kp
kprewrite trace trace.txt --format graph
kprewrite trace trace.txt --format chrome -o trace.json    # open in ui.perfetto.dev""",
    "diff": """\
kprewrite diff prog prog.kp
kprewrite diff prog prog.kp --format json""",
    "report": """\
KPREWRITE_TRACE=trace.txt ./prog.kp
kprewrite report trace.txt --plot trace.svg""",
    "probe-vars": """\
kprewrite probe-vars prog parse_line:4
kprewrite probe-vars prog 'parse_line%return' --format json""",
    "probe-lines": """\
kprewrite probe-lines prog parse_line
kprewrite probe-lines prog parse_line@prog.c --format json""",
    "man": """\
kprewrite man check | man -l -
kprewrite man -o ~/.local/share/man/man1""",
    "boot": """\
kprewrite boot vmlinuz.kp --run 'cat /sys/kernel/debug/kprewrite/profile'
kprewrite boot vmlinuz.kp --append kprewrite.enabled=0 --run 'cat /sys/kernel/debug/kprewrite/enabled'
kprewrite boot vmlinuz --write-initrd initrd.gz""",
    "gdb": """\
kprewrite gdb ./prog.kp 2
gdb -x "$(kprewrite gdb --print-path)" --args ./prog.kp 2""",
}

for _name, _text in EXAMPLES.items():
    if _name in main.commands:
        main.commands[_name].epilog = "Examples:\n\n\b\n" + _text


def command(prog_name: str = "kprewrite") -> None:
    """The `kprewrite` command and `python -m rewriter`: main(), then the process ends
    without the interpreter's teardown, which frees every object one at a time (a kernel
    rewrite's millions of them: 0.7 s of the command; libpython's 0.05 s).  The exit
    handlers run (the analysis' cache writer is waited for), standard output and error
    are flushed, and the status is main()'s, as sys.exit() would give it.  main() itself
    is left to return as click's commands do (in-process callers: the fuzzer)."""
    try:
        main(prog_name=prog_name)
        code = 0
    except SystemExit as e:
        code = e.code
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    import threading
    if threading.active_count() > 1:        # the interpreter would wait for it: so do we
        sys.exit(code)
    import atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):         # as the interpreter's exit reports a failed flush
            code = code or 120
    os._exit(code)
