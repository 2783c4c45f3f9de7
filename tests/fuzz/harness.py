"""Runs the real CLI in-process on one fuzz case and checks the contract of bad
input (docs/reference/cli.md, "Rules common to every command"): exit 0 or 1, no Python exception other than the
one-line KprewriteError, no "internal error", no hang, nothing on standard
error but `kprewrite: ` lines (a Python warning prints a source line; LIEF
or a C library writing to fd 2 shows up too: both file descriptors are
captured), every error line naming an input file, no output file left behind
by a failure, and every input byte-identical afterwards.

The fuzzer's settings (docs/testing.md, "Fuzzer"): how many cases each target runs and
whether they are the same every run.

KPREWRITE_FUZZ_EXAMPLES=N  cases per target (default: each target's own, about a minute in all);
KPREWRITE_FUZZ_RANDOM=1    new random cases each run (default: derandomized, the same cases every
                           run, so a CI failure is a regression of the change under test).
KPREWRITE_FUZZ_PROGRESS=FILE  a long run writes its counts so far to FILE every 100 cases.
KPREWRITE_FUZZ_MESSAGES=FILE  every error line of every case is appended to FILE (to read what users
                           would see: each names its input file).
The number of cases run is printed at the end of the session."""
from __future__ import annotations

import hashlib
import io
import os
import signal
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

from hypothesis import HealthCheck, settings


COUNTS: dict[str, int] = {}

settings.register_profile(
    "kprewrite-fuzz",
    derandomize=not os.environ.get("KPREWRITE_FUZZ_RANDOM"),
    deadline=None,                         # the harness has its own hang alarm
    database=None,                         # nothing written in the tree; a failure prints its reproducer
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)


def fuzz_settings(default_examples: int):
    """The profile with this target's number of cases (KPREWRITE_FUZZ_EXAMPLES overrides)."""
    n = int(os.environ.get("KPREWRITE_FUZZ_EXAMPLES") or default_examples)
    return settings(settings.get_profile("kprewrite-fuzz"), max_examples=n)


def count(target: str) -> None:
    COUNTS[target] = COUNTS.get(target, 0) + 1
    progress = os.environ.get("KPREWRITE_FUZZ_PROGRESS")     # a long run: the counts so far, in this file
    if progress and sum(COUNTS.values()) % 100 == 0:
        with open(progress, "w") as f:
            f.write(" ".join(f"{k}={v}" for k, v in sorted(COUNTS.items())) + "\n")



# A hang: 20 s of this process's CPU time (ITIMER_PROF: a loaded machine does not make
# a slow case look like a hang), or 180 s of wall time (waiting on something).
HANG_SECONDS = float(os.environ.get("KPREWRITE_FUZZ_HANG", "20"))
HANG_WALL_SECONDS = 180.0


class Hang(BaseException):
    """Raised by the alarm: a BaseException, so the CLI's guard does not turn it into a message."""


class Result:
    def __init__(self, code, out, err, exc):
        self.code, self.out, self.err, self.exc = code, out, err, exc

    def __repr__(self):
        return f"Result(code={self.code}, err={self.err!r}, exc={self.exc})"


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def invoke(args: list[str]) -> Result:
    """main(args) with fds 1 and 2 (and sys.stdout/stderr) captured, under an alarm."""
    from rewriter.cli import main
    saved_fds = os.dup(1), os.dup(2)
    saved_py = sys.stdout, sys.stderr
    out_f, err_f = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    code, exc = None, None
    # A warning the CLI lets through prints itself and a line of source on standard error:
    # recorded as such (the CLI's own warning filters apply, as in a real run).
    caught = warnings.catch_warnings()
    caught.__enter__()
    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: \
        os.write(2, f"{filename}:{lineno}: {category.__name__}: {message}\n".encode())
    warnings.resetwarnings()
    warnings.simplefilter("default")
    hang = lambda *_: (_ for _ in ()).throw(Hang())
    old = signal.signal(signal.SIGALRM, hang), signal.signal(signal.SIGPROF, hang)
    os.environ["KPREWRITE_DEBUG"] = "1"       # an internal error propagates here, with its traceback
    try:
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(out_f.fileno(), 1); os.dup2(err_f.fileno(), 2)
        sys.stdout = io.TextIOWrapper(open(os.dup(1), "wb", buffering=0), write_through=True)
        sys.stderr = io.TextIOWrapper(open(os.dup(2), "wb", buffering=0), write_through=True)
        signal.setitimer(signal.ITIMER_PROF, HANG_SECONDS)
        signal.setitimer(signal.ITIMER_REAL, HANG_WALL_SECONDS)
        try:
            main.main(args=[str(a) for a in args], prog_name="kprewrite", standalone_mode=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except KeyboardInterrupt:          # the user (or `timeout -s INT`) stops the run: not a finding
            raise
        except Hang:
            exc = f"hang: more than {HANG_SECONDS} s of CPU time or {HANG_WALL_SECONDS} s"
        except BaseException:
            exc = traceback.format_exc()
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        caught.__exit__(None, None, None)
        signal.signal(signal.SIGALRM, old[0])
        signal.signal(signal.SIGPROF, old[1])
        del os.environ["KPREWRITE_DEBUG"]
        for s in (sys.stdout, sys.stderr):
            if s is not saved_py[0] and s is not saved_py[1]:
                s.close()
        sys.stdout, sys.stderr = saved_py
        os.dup2(saved_fds[0], 1); os.dup2(saved_fds[1], 2)
        os.close(saved_fds[0]); os.close(saved_fds[1])
    out_f.seek(0); err_f.seek(0)
    out = out_f.read().decode("utf-8", "replace"); err = err_f.read().decode("utf-8", "replace")
    out_f.close(); err_f.close()
    return Result(code, out, err, exc)


def run_case(args: list, inputs: list[Path], workdir: Path, output: Path | None = None) -> Result:
    """invoke(args) and assert the bad-input contract.  `inputs` are the files the
    case reads (their names must appear in every error line); `output` is the
    file a successful `instrument` writes (removed afterwards)."""
    before = {p: _digest(p) for p in inputs}
    listing = set(os.listdir(workdir))
    r = invoke(args)
    if os.environ.get("KPREWRITE_FUZZ_MESSAGES") and r.code == 1:
        with open(os.environ["KPREWRITE_FUZZ_MESSAGES"], "a") as f:
            f.write(r.err if r.err.endswith("\n") or not r.err else r.err + "\n")
    problems = []
    if r.exc:
        problems.append(f"exception: {r.exc}")
    if r.code not in (0, 1):
        problems.append(f"exit code {r.code}")
    if "internal error" in r.err or "Traceback" in r.err:
        problems.append("internal error")
    stray = [l for l in r.err.splitlines() if not l.startswith("kprewrite: ")]
    if stray:
        problems.append(f"standard error has other lines than kprewrite's: {stray[:3]}")
    if r.code == 1:
        names = [p.name for p in inputs]
        for line in r.err.splitlines():
            # Indented lines continue a summary ("  12  reason"); the summary header names no file.
            body = line[len("kprewrite: "):]
            if body.startswith(" ") or " from globs skipped:" in body:
                continue
            if not any(n in line for n in names):
                problems.append(f"error line names no input file ({names}): {line!r}")
    for p, d in before.items():
        if _digest(p) != d:
            problems.append(f"input modified: {p}")
    after = set(os.listdir(workdir))
    new = after - listing
    if output is not None and r.code == 0 and output.name in new:
        new.discard(output.name)
        output.unlink()
    if new:
        problems.append(f"left behind: {sorted(new)}")
        for n in new:
            try:
                os.unlink(workdir / n)
            except OSError:
                pass
    if problems:
        raise AssertionError(f"kprewrite {' '.join(map(str, args))}:\n  " + "\n  ".join(problems)
                             + f"\n  stderr: {r.err[-2000:]!r}")
    return r
