"""The probe spec (docs/reference/spec.md): load and validate.

`load_spec` reads the TOML file, checks every key of every table, and either
returns a `Spec` or raises one `KprewriteError` with one line per problem found
anywhere in the file.  Every line names the file, the table and the key:

    probes.toml: [[kprobe]] #2: unknown key 'offest' (did you mean 'offset'?)

Only the shape of the spec is checked here; whether a symbol exists, a handler
is defined or a fetch/events string parses is decided later, by other stages.
"""
from __future__ import annotations

import datetime
import difflib
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import KprewriteError, file_error


@dataclass
class KprobeSpec:
    table: str                 # for messages, e.g. "[[kprobe]] #2" (1-based, in file order)
    symbol_name: str | None
    addr: int | None
    offset: int = 0
    pre_handler: str | None = None
    post_handler: str | None = None
    disabled: bool = False
    name: str | None = None
    fetch: str | None = None
    is_glob: bool = False      # symbol_name contains any of * ? [


@dataclass
class KretprobeSpec:
    table: str                 # "[[kretprobe]] #1"
    symbol_name: str | None
    addr: int | None
    offset: int = 0
    handler: str | None = None
    entry_handler: str | None = None
    maxactive: int = 0
    data_size: int = 0
    disabled: bool = False
    name: str | None = None
    fetch: str | None = None
    is_glob: bool = False


@dataclass
class Spec:
    path: Path | None                   # absolute path of the spec file; None: probes from the command line only
    handlers: list[Path]                # absolute, resolved relative to the spec's directory, in order
    optimize: bool
    kprobes: list[KprobeSpec] = field(default_factory=list)
    kretprobes: list[KretprobeSpec] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    probes: list[str] = field(default_factory=list)      # perf probe definitions (rewriter/probes/perfprobe)
    compiled: list[tuple[str, str]] = field(default_factory=list)  # (probes[N], kprobe_events line) each became
    # events[N] and probes[N] that came from the command line: their option as written
    # (`--event 'p:f f'`), which names them in messages instead of the spec file's name
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """What messages call the spec: its file's name."""
        return self.path.name if self.path is not None else "command line"

    def table(self, kind: str, i: int) -> str:
        """The label of events[i] or probes[i] (1-based): its option if it came from one."""
        t = f"{kind}[{i}]"
        return self.labels.get(t, t)


def where(spec_name: str, table: str) -> str:
    """The head of a message about a table: the spec file's name and the table, or for a
    probe given on the command line, its option alone (`--kprobe 'work'`)."""
    return table if table.startswith("--") else f"{spec_name}: {table}"


HANDLER_SUFFIXES = (".c", ".o")
GLOB_CHARS = "*?["

_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1
_S32 = (-(1 << 31), (1 << 31) - 1)


# --- field kinds: each returns None if `v` is acceptable, else what it must be ---------------

def _name(v):
    return None if isinstance(v, str) and v else "a non-empty string"


def _string(v):
    return None if isinstance(v, str) else "a string"


def _bool(v):
    return None if isinstance(v, bool) else "a boolean (true or false)"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _uint(limit: int):
    def check(v):
        if not _is_int(v) or v < 0:
            return "a non-negative integer"
        if v > limit:
            return f"at most {limit:#x}"
        return None
    return check


def _sint(lo: int, hi: int):
    def check(v):
        if not _is_int(v):
            return "an integer"
        if not lo <= v <= hi:
            return f"an integer between {lo} and {hi}"
        return None
    return check


_COMMON = {
    "symbol_name": _name,
    "addr": _uint(_U64),
    "offset": _uint(_U32),          # the kernel's `unsigned int offset`
    "disabled": _bool,
    "name": _name,
    "fetch": _string,               # FETCHARGS; "" is a trace line with no arguments
}
KPROBE_KEYS = {**_COMMON, "pre_handler": _name, "post_handler": _name}
KRETPROBE_KEYS = {**_COMMON, "handler": _name, "entry_handler": _name,
                  "maxactive": _sint(*_S32), "data_size": _uint(_S32[1])}
# [[function_graph]] (an extension): ftrace's function_graph tracer as probes, a kprobe and
# a kretprobe with a trace line and no arguments on each function it names, whose lines
# `kprewrite trace --format graph` and `report` pair into calls (rewriter/trace/callgraph.py).
# Its kretprobes' maxactive defaults to GRAPH_MAXACTIVE, not the kernel's max(10, 2 * CPUs): a
# recursion deeper than maxactive misses returns (nmissed), which a graph shows as calls with
# no return; function_graph's own return stack is 50 deep per task, uftrace's 1024.
GRAPH_MAXACTIVE = 64
GRAPH_KEYS = {"symbol_name": _name, "addr": _uint(_U64), "disabled": _bool, "maxactive": _sint(*_S32)}
TOP_KEYS = ("handlers", "optimize", "kprobe", "kretprobe", "function_graph", "events", "probes")
PROBE_TABLES = {"kprobe": (KPROBE_KEYS, KprobeSpec), "kretprobe": (KRETPROBE_KEYS, KretprobeSpec),
                "function_graph": (GRAPH_KEYS, None)}


# --- rendering values and names on one line ----------------------------------------------------

_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}
_SHOW_MAX = 60


def _esc(s: str, quote: str) -> str:
    """`s` with backslashes, `quote` and anything unprintable escaped: always one line."""
    out = []
    for c in s:
        if c == quote:
            out.append("\\" + c)
        elif c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif not c.isprintable():
            out.append(f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")
        else:
            out.append(c)
    return "".join(out)


def _q(s) -> str:
    """A key, path or file name for a message, in single quotes."""
    return "'" + _esc(str(s), "'") + "'"


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v) if abs(v) <= _U64 else hex(v)      # str() of a huge int can raise
    if isinstance(v, float):
        return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(repr(v), repr(v))
    if isinstance(v, str):
        return '"' + _esc(v, '"') + '"'
    if isinstance(v, (datetime.date, datetime.time)):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v[:8]) + (", ..." if len(v) > 8 else "") + "]"
    if isinstance(v, dict):
        items = [f"{_esc(str(k), '')} = {_toml(x)}" for k, x in list(v.items())[:8]]
        return "{" + ", ".join(items) + (", ..." if len(v) > 8 else "") + "}"
    return _esc(repr(v), "")


def _show(v) -> str:
    s = _toml(v)
    return s if len(s) <= _SHOW_MAX else s[:_SHOW_MAX - 3] + "..."


def _closest(key: str, known) -> list[str]:
    """difflib.get_close_matches(key, known, n=1), a tie going to the key listed first
    ('kprobes' is as close to 'probes' as to 'kprobe')."""
    best, score = [], 0.0
    for k in known:
        r = difflib.SequenceMatcher(None, key, k).ratio()
        if r >= 0.6 and r > score:
            best, score = [k], r
    return best


def _unknown(key: str, known, extra: str = "") -> str:
    close = _closest(key, known)
    hints = ([f"did you mean {_q(close[0])}?"] if close else []) + ([extra] if extra else [])
    return f"unknown key {_q(key)}" + (f" ({'; '.join(hints)})" if hints else "")


# --- loading -----------------------------------------------------------------------------------

_AT = re.compile(r"\s*\(at (line \d+, column \d+|end of document)\)\s*$")


def _parse(path: Path, label: str, given: str) -> dict:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise file_error(_esc(given, ""), e) from None      # the path as given
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KprewriteError(f"{label}: not UTF-8 text (byte {e.start})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        msg = " ".join(str(e).split())              # one line, whatever tomllib says
        m = _AT.search(msg)
        if m is None:
            raise KprewriteError(f"{label}: {msg}") from None
        where = m.group(1)
        if where == "end of document":
            lines = text.split("\n")
            where = f"line {len(lines)}, column {len(lines[-1]) + 1}"
        raise KprewriteError(f"{label}: {where}: {msg[:m.start()]}") from None
    except RecursionError:
        raise KprewriteError(f"{label}: nested too deeply to be a spec") from None
    except ValueError as e:                          # e.g. an integer literal too long to convert
        raise KprewriteError(f"{label}: {' '.join(str(e).split())}") from None


def _probe(kind: str, table: str, where: str, raw: dict, errors: list[str]):
    keys, cls = PROBE_TABLES[kind]
    ok = True
    for k, v in raw.items():
        if k not in keys:
            extra = "top-level keys go before the first [[...]] table" if k in TOP_KEYS else ""
            errors.append(f"{where}: {_unknown(k, keys, extra)}")
            ok = False
            continue
        must = keys[k](v)
        if must:
            errors.append(f"{where}: {_q(k)} must be {must}, got {_show(v)}")
            ok = False
    if ("symbol_name" in raw) == ("addr" in raw):
        errors.append(f"{where}: needs exactly one of 'symbol_name' or 'addr'")
        ok = False
    if not ok:
        return None
    values = {k: raw[k] for k in keys if k in raw}
    sym = values.pop("symbol_name", None)
    addr = values.pop("addr", None)
    glob = sym is not None and any(c in sym for c in GLOB_CHARS)
    if cls is None:         # [[function_graph]]: the entry and the return event of each function
        maxactive = values.pop("maxactive", GRAPH_MAXACTIVE)
        return (KprobeSpec(table=table, symbol_name=sym, addr=addr, fetch="", **values, is_glob=glob),
                KretprobeSpec(table=table, symbol_name=sym, addr=addr, fetch="", **values, is_glob=glob,
                              maxactive=maxactive))
    return cls(table=table, symbol_name=sym, addr=addr, **values, is_glob=glob)


def _handlers(value, base: Path, label: str, errors: list[str]) -> list[Path]:
    if not isinstance(value, list) or not all(isinstance(h, str) and h for h in value):
        errors.append(f"{label}: 'handlers' must be a list of file paths")
        return []
    out: list[Path] = []
    for h in value:
        p = Path(os.path.normpath(base / h))
        # the path as given (relative to the spec file, or to the current folder for --handlers)
        if p.is_dir():
            errors.append(f"{label}: handler file {_q(h)}: is a directory")
        elif p.suffix not in HANDLER_SUFFIXES:
            errors.append(f"{label}: handler file {_q(h)} must be a C source (.c) "
                          f"or a relocatable object (.o)")
        elif not p.exists():
            errors.append(f"{label}: handler file {_q(h)}: no such file")
        elif not p.is_file():
            errors.append(f"{label}: handler file {_q(h)}: not a regular file")
        elif p in out:
            errors.append(f"{label}: handler file {_q(h)} is listed more than once")
        else:
            out.append(p)
    return out


def load_spec(path: str | Path) -> Spec:
    """Load and validate the spec at `path`; raise KprewriteError naming every problem."""
    given = str(path)
    path = Path(os.path.abspath(path))
    label = _esc(path.name, "")
    doc = _parse(path, label, given)

    errors: list[str] = []
    handlers: list[Path] = []
    optimize = True
    events: list[str] = []
    perf_probes: list[str] = []
    probes: dict[str, list] = {"kprobe": [], "kretprobe": [], "function_graph": []}

    for key, value in doc.items():                   # file order
        if key == "handlers":
            handlers = _handlers(value, path.parent, label, errors)
        elif key == "optimize":
            if isinstance(value, bool):
                optimize = value
            else:
                errors.append(f"{label}: 'optimize' must be a boolean (true or false), got {_show(value)}")
        elif key == "events":
            if isinstance(value, list) and all(isinstance(e, str) for e in value):
                events = list(value)
            else:
                errors.append(f"{label}: 'events' must be a list of strings")
        elif key == "probes":
            if isinstance(value, list) and all(isinstance(e, str) for e in value):
                perf_probes = list(value)
            else:
                errors.append(f"{label}: 'probes' must be a list of strings")
        elif key in PROBE_TABLES:
            if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
                errors.append(f"{label}: {_q(key)} must be an array of tables ([[{key}]]), got {_show(value)}")
                continue
            for i, raw in enumerate(value, 1):
                table = f"[[{key}]] #{i}"
                p = _probe(key, table, f"{label}: {table}", raw, errors)
                if isinstance(p, tuple):
                    probes["kprobe"].append(p[0])
                    probes["kretprobe"].append(p[1])
                elif p is not None:
                    probes[key].append(p)
        else:
            errors.append(f"{label}: {_unknown(key, TOP_KEYS)}")

    if errors:
        raise KprewriteError(*errors)
    return Spec(path=path, handlers=handlers, optimize=optimize,
                kprobes=probes["kprobe"], kretprobes=probes["kretprobe"], events=events, probes=perf_probes)


# --- probes on the command line ----------------------------------------------------------------

OPTION_KINDS = {"--kprobe": "kprobe", "--kretprobe": "kretprobe", "--graph": "function_graph"}


def _option_value(text: str):
    """A KEY=VALUE word's value as TOML would type it: an integer (0x.. too), a boolean, else a string."""
    if text in ("true", "false"):
        return text == "true"
    try:
        return int(text, 0)
    except ValueError:
        return text


def _option_probe(option: str, text: str, errors: list[str]):
    """`--kprobe 'SYM[+OFFS] [KEY=VALUE ...]'` (SYM: a symbol, a glob or an address) as the
    table `[[kprobe]] symbol_name = SYM  offset = OFFS  KEY = VALUE` would be, its messages
    naming the option."""
    kind = OPTION_KINDS[option]
    label = f"{option} {_q(text)}"
    words = text.split()
    if not words:
        errors.append(f"{label}: names no symbol")
        return None
    raw: dict = {}
    head, plus, off = words[0].partition("+")
    if plus:
        try:
            raw["offset"] = int(off, 0)
        except ValueError:
            errors.append(f"{label}: offset {_q(off)} is not a number")
            return None
    addr = _option_value(head) if head[:1].isdigit() else head
    raw["addr" if isinstance(addr, int) else "symbol_name"] = addr
    for w in words[1:]:
        k, eq, v = w.partition("=")
        if not eq or k in ("symbol_name", "addr"):
            errors.append(f"{label}: {_q(w)} is not KEY=VALUE (a key of [[{kind}]] other than symbol_name and addr)")
            return None
        raw[k] = _option_value(v)
    return _probe(kind, label, label, raw, errors)


def from_options(spec_path: str | Path | None = None, *, events=(), probes=(), kprobes=(), kretprobes=(),
                 graphs=(), handlers=()) -> Spec:
    """The spec of a command line: the spec file's (if any) and the probes of the options
    added to it, as `--event LINE`, `--probe DEF`, `--kprobe SYM`, `--kretprobe SYM`,
    `--graph SYM` and `--handlers FILE` give them (handler files relative to the current
    folder).  Raises one KprewriteError naming every bad option; and if there is neither a
    spec file nor a probe."""
    if spec_path is None and not (events or probes or kprobes or kretprobes or graphs):
        raise KprewriteError("no probes: give --spec FILE, or probes as --kprobe SYM, --kretprobe SYM, "
                             "--event LINE or --probe DEF")
    spec = load_spec(spec_path) if spec_path is not None else Spec(path=None, handlers=[], optimize=True)
    errors: list[str] = []
    for h in _handlers(list(handlers), Path(os.getcwd()), "--handlers", errors):
        if h in spec.handlers:
            errors.append(f"--handlers: handler file {_q(h.name)} is listed more than once")
        else:
            spec.handlers.append(h)
    for option, texts in (("--kprobe", kprobes), ("--kretprobe", kretprobes), ("--graph", graphs)):
        for text in texts:
            p = _option_probe(option, text, errors)
            if isinstance(p, tuple):
                spec.kprobes.append(p[0])
                spec.kretprobes.append(p[1])
            elif p is not None:
                getattr(spec, option[2:] + "s").append(p)
    for kind, option, texts in (("events", "--event", events), ("probes", "--probe", probes)):
        got = getattr(spec, kind)
        for text in texts:
            got.append(text)
            spec.labels[f"{kind}[{len(got)}]"] = f"{option} {_q(text)}"
    if errors:
        raise KprewriteError(*errors)
    return spec
