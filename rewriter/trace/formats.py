"""Reading trace lines: `kprewrite trace FILE [--format jsonl|chrome|graph|text]`.

Parses the lines a rewritten program writes (the kernel's tracing/trace
format, see runtime/kp_trace.c; or its binary records, KPREWRITE_TRACE_FORMAT=binary,
formatted into the same lines by rewriter/trace/binary.py), or a saved copy of a rewritten kernel's
tracing/trace (our events, and the kernel's own kprobe events between them;
its other events are skipped), into JSON lines, into the Chrome trace-event
format that Perfetto (ui.perfetto.dev) and chrome://tracing open, or into
function_graph's nested text.  Entry events (a kprobe on FUNC+0x0, or past the
landing pad the arch skips: x86-64's 4-byte ENDBR) and return events (`<- FUNC`,
a kretprobe) of one thread are paired into calls by rewriter/trace/callgraph.py; a call
is one duration slice ("ph": "X") of the timeline, any other event an instant on
its thread.
"""
from __future__ import annotations

import json

from ..errors import KprewriteError, file_error
from . import binary as tracebin, callgraph
from .record import LINE, SYM, Record, parse_args, parse_line

__all__ = ["LINE", "SYM", "Record", "parse_args", "parse_line", "read", "text", "jsonl", "chrome"]


def read(path: str) -> list[Record]:
    """Trace records of a file ("-": standard input); other lines are skipped.  A binary
    trace (KPREWRITE_TRACE_FORMAT=binary, recognized by its magic) is formatted into the
    lines the program would have written as text (rewriter/trace/binary.py)."""
    import sys
    try:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(path, "rb") as f:
                data = f.read()
    except OSError as e:
        raise file_error(path, e) from None
    if tracebin.is_binary(data):
        return tracebin.records(data, path)
    lines = data.decode("utf-8", errors="replace").splitlines()
    out, other = [], 0
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        r = parse_line(line)
        if r is not None:        # other output of the program (its own stderr) is skipped
            out.append(r)
        else:
            other += 1
    if other and not out:        # text, but not one trace line: the wrong file
        raise KprewriteError(f"{path}: no trace lines in it ({other} other lines); "
                             "expected the output of KPREWRITE_TRACE, standard error of a rewritten program, "
                             "or a kernel's tracing/trace")
    return out


def text(records: list[Record]) -> str:
    """The trace lines themselves (a binary trace's formatted as the runtime writes text)."""
    return "".join(r.line + "\n" for r in records)


def jsonl(records: list[Record]) -> str:
    return "".join(json.dumps(r.to_json(), sort_keys=True) + "\n" for r in records)


def chrome(records: list[Record], process: str = "kprewrite") -> dict:
    """Chrome trace-event JSON (the JSON Object Format): ts and dur in microseconds."""
    return callgraph.chrome(records, process)
