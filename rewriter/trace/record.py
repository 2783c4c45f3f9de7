"""A trace line and its record: the kernel's tracing/trace line of one event
(trace_print_context() + print_kprobe_event()/print_kretprobe_event()) parsed into
a Record, the one type every reader of traces shares (trace/formats.py reads files
into records, trace/binary.py formats binary records into the same lines,
trace/callgraph.py pairs records into calls, trace/report.py sums them up)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

# trace_print_context() + print_kprobe_event()/print_kretprobe_event().  A kernel's
# tracing/trace adds the irq-info flags column ("d..1.") and, with options/record-tgid,
# the TGID column ("(  123)"); a kernel writes our events as trace_printk() entries,
# whose text follows the probe address's symbol ("do_sys_openat2: kp_open: (...)");
# before the ring buffer exists they go to printk, behind its "[    0.123456] ".
LINE = re.compile(r"^(?:\[\s*\d+\.\d+\]\s)?\s*(?P<comm>.*?)-(?P<pid>\d+)\s+(?:\(\s*[-\d]+\)\s+)?"
                  r"\[(?P<cpu>\d+)\]\s+(?:\S{4,5}\s+)?(?P<ts>\d+\.\d+):\s+"
                  r"(?:(?P<ip>[^\s:()]+):\s+)?(?P<event>[^\s:]+):\s+\((?P<loc>[^()]*)\)(?P<args>.*)$")
SYM = re.compile(r"^(?P<sym>.+?)\+(?P<off>0x[0-9a-f]+)/(?P<size>0x[0-9a-f]+)$")


@dataclass
class Record:
    comm: str
    pid: int
    cpu: int
    ts: str                  # seconds.fraction, as printed: 9 digits (ns) from a user
                             # program, 6 (us) from a kernel's tracing/trace
    event: str
    loc: str
    args: dict
    line: str = ""           # the trace line, as written (or formatted from a binary record)

    # What the readers ask of a record, each computed once (a reader of a large trace asks
    # every record several times; a binary trace's reader sets them from its cache).
    @property
    def ts_us(self) -> int:
        return self.ts_ns // 1000

    @cached_property
    def ts_ns(self) -> int:
        sec, frac = self.ts.split(".")
        return int(sec) * 1_000_000_000 + int(frac.ljust(9, "0")[:9])

    @cached_property
    def is_return(self) -> bool:
        return " <- " in self.loc

    @cached_property
    def func(self) -> str:
        """The function: FUNC of a return event, else the symbol of the probe address."""
        if self.is_return:
            return self.loc.split(" <- ", 1)[1]
        m = SYM.match(self.loc)
        return m.group("sym") if m else self.loc

    @cached_property
    def is_entry(self) -> bool:
        m = SYM.match(self.loc)
        return not self.is_return and m is not None and int(m.group("off"), 16) in (0, 4)

    def to_json(self) -> dict:
        d = {"comm": self.comm, "pid": self.pid, "cpu": self.cpu, "ts": float(self.ts), "ts_us": self.ts_us,
             "ts_ns": self.ts_ns,
             "event": self.event}
        if self.is_return:
            caller, func = self.loc.split(" <- ", 1)
            d.update(kind="return", caller=caller, func=func)
        else:
            d.update(kind="probe", ip=self.loc, func=self.func)
        d["args"] = self.args
        return d


def _value(text: str):
    """A printed value: "string" -> str, {a,b} -> list, decimal -> int, anything else as printed."""
    if text.startswith('"') and text.endswith('"') and len(text) >= 2:
        return _unescape(text[1:-1])
    if text.startswith("{") and text.endswith("}"):
        return [_value(t) for t in _split(text[1:-1], ",")]
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return text


def _unescape(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            n = s[i + 1]
            if n == "n":
                out.append("\n"); i += 2; continue
            if n == "t":
                out.append("\t"); i += 2; continue
            if n == "x" and re.fullmatch(r"[0-9a-fA-F]{2}", s[i + 2:i + 4]):
                out.append(chr(int(s[i + 2:i + 4], 16))); i += 4; continue
            out.append(n); i += 2; continue
        out.append(c)
        i += 1
    return "".join(out)


def _split(text: str, sep: str) -> list[str]:
    """Split on `sep` outside quotes and braces."""
    parts, cur, depth, quote, i = [], [], 0, False, 0
    while i < len(text):
        c = text[i]
        if quote:
            cur.append(c)
            if c == "\\" and i + 1 < len(text):
                cur.append(text[i + 1]); i += 1
            elif c == '"':
                quote = False
        elif c == '"':
            quote = True; cur.append(c)
        elif c == "{":
            depth += 1; cur.append(c)
        elif c == "}":
            depth -= 1; cur.append(c)
        elif c == sep and depth == 0:
            parts.append("".join(cur)); cur = []
        else:
            cur.append(c)
        i += 1
    if cur or parts:
        parts.append("".join(cur))
    return parts


def parse_args(text: str) -> dict | None:
    args = {}
    for word in _split(text.strip(), " "):
        if not word:
            continue
        name, eq, value = word.partition("=")
        if not eq or not name:
            return None
        args[name] = _value(value)
    return args


def parse_line(line: str) -> Record | None:
    m = LINE.match(line.rstrip("\n"))
    if not m:
        return None
    args = parse_args(m.group("args"))
    if args is None:
        return None
    return Record(m.group("comm"), int(m.group("pid")), int(m.group("cpu")), m.group("ts"),
                  m.group("event"), m.group("loc"), args, line.rstrip("\n"))
