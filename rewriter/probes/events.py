"""kprobe_events lines and per-probe `fetch` strings: from the spec to trace events.

Mirrors kernel/trace/trace_kprobe.c's __trace_kprobe_create():

    p[:[GRP/][EVENT]] SYM[+offs]|MEMADDR [FETCHARGS]
    r[MAXACTIVE][:[GRP/][EVENT]] SYM[+0] [FETCHARGS]

A `p` line becomes a kprobe in the plan (it aggregates with [[kprobe]] tables at
the same address); an `r` line becomes a kretprobe.  The event name defaults to
the kernel's `p_SYM_OFFS` / `r_SYM_OFFS` (or `p_0xADDR`), the group to
"kprobes".  Errors point at the offending column, like `error_log`:

    probes.toml: events[2]: column 22: Invalid register name
      Command: p:myprobe work x=%foo
                                  ^
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from . import fetch as F
from .spec import KprobeSpec, KretprobeSpec, Spec
from .spec import where as spec_where

MAX_EVENT_NAME_LEN = 64
KRETPROBE_MAXACTIVE_MAX = 4096
DEFAULT_GROUP = "kprobes"
CMD = "  Command: "

LINE_ERR = {
    "BAD_MAXACT_TYPE": "Maxactive is only for function exit",
    "BAD_MAXACT": "Invalid maxactive number",
    "MAXACT_TOO_BIG": "Maxactive is too big",
    "BAD_PROBE_ADDR": "Invalid probed address or symbol",
    "BAD_RETPROBE": "Retprobe address must be an function entry",
    "BAD_ADDR_SUFFIX": "Invalid probed address suffix",
    "NO_GROUP_NAME": "Group name is not specified",
    "GROUP_TOO_LONG": "Group name is too long",
    "BAD_GROUP_NAME": "Group name must follow the same rules as C identifiers",
    "NO_EVENT_NAME": "Event name is not specified",
    "EVENT_TOO_LONG": "Event name is too long",
    "BAD_EVENT_NAME": "Event name must follow the same rules as C identifiers",
    "EVENT_EXIST": "Given group/event name is already used by another event",
    "BAD_PROBE_TYPE": "Probe type must be 'p' or 'r' (kprobe_events lines only)",
    "NO_MODULE": "Module names are not supported (MOD:SYM); name a symbol of the input",
}


class LineError(Exception):
    def __init__(self, column: int, code: str, detail: str = ""):
        self.column = column
        self.message = (LINE_ERR.get(code) or F.ERR[code]) + (f" ({detail})" if detail else "")
        super().__init__(self.message)


def caret_lines(where: str, text: str, column: int, message: str) -> list[str]:
    """error_log's three lines: what and where, the command, a caret under the column."""
    # A control character (a newline in a TOML string) would break the one-line rule:
    # shown escaped, the caret still under the character it points at.
    shown = [c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text]
    caret = sum(len(c) for c in shown[:column]) + max(column - len(shown), 0)
    return [f"{where}: column {column + 1}: {message}", f"{CMD}{''.join(shown)}", " " * (len(CMD) + caret) + "^"]


@dataclass
class EventDef:
    """One parsed kprobe_events line."""
    index: int                  # 1-based position in `events`
    text: str
    is_return: bool
    group: str
    event: str
    symbol: str | None
    offset: int
    addr: int | None
    maxactive: int
    words: list[tuple[str, int]]        # FETCHARGS with their columns
    label: str = ""                     # its option, for a line given on the command line (--event)

    @property
    def table(self) -> str:
        return self.label or f"events[{self.index}]"

    def fetch_args(self, flags: F.ParseFlags) -> list[F.ProbeArg]:
        """Its FETCHARGS' fetch programs (flags: as the resolved address allows)."""
        return F.parse_args(self.words, flags)


@dataclass
class EventKprobeSpec(KprobeSpec):
    """A kprobe that comes from a `p` line."""
    event: EventDef | None = None


@dataclass
class EventKretprobeSpec(KretprobeSpec):
    """A kretprobe that comes from an `r` line."""
    event: EventDef | None = None


def _sanitize(name: str) -> str:
    """sanitize_event_name(): anything but [A-Za-z0-9_] becomes '_'."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def check_group(g: str, col: int) -> None:
    """A group name written at `col`, as traceprobe_parse_event_name() checks it."""
    if not g:
        raise LineError(col, "NO_GROUP_NAME")
    if len(g) + 1 > MAX_EVENT_NAME_LEN:
        raise LineError(col, "GROUP_TOO_LONG")
    if not F.is_good_name(g):
        raise LineError(col, "BAD_GROUP_NAME")


def check_event(ev: str, col: int) -> None:
    """An event name written at `col`, as traceprobe_parse_event_name() checks it."""
    if len(ev) > MAX_EVENT_NAME_LEN:
        raise LineError(col, "EVENT_TOO_LONG")
    if not F.is_good_name(ev):
        raise LineError(col, "BAD_EVENT_NAME")


def _event_name(ev: str, col: int) -> tuple[str | None, str | None]:
    """traceprobe_parse_event_name(): [GRP/][EVENT] -> (group, event); event None: generate."""
    group = None
    slash = min([i for i in (ev.find("/"), ev.find(".")) if i >= 0], default=-1)
    if slash >= 0:
        g = ev[:slash]
        check_group(g, col)
        group, ev, col = g, ev[slash + 1:], col + slash + 1
    if not ev:
        if group is not None:
            return group, None
        raise LineError(col, "NO_EVENT_NAME")
    check_event(ev, col)
    return group, ev


def parse_line(text: str, index: int, regs=None) -> EventDef:
    words = F.split_args(text)
    if not words:
        raise LineError(0, "BAD_PROBE_TYPE")
    head, hcol = words[0]
    if head[0] not in "pr":
        raise LineError(hcol, "BAD_PROBE_TYPE")
    is_return = head[0] == "r"
    colon = head.find(":")
    spec_part = head[1:colon] if colon >= 0 else head[1:]
    maxactive = 0
    if spec_part:
        if not spec_part[0].isdigit():
            raise LineError(hcol + 1, "BAD_PROBE_TYPE")
        if not is_return:
            raise LineError(hcol + 1, "BAD_MAXACT_TYPE")
        n = F.kstrtoul(spec_part)
        if not n:
            raise LineError(hcol + 1, "BAD_MAXACT")
        if n > KRETPROBE_MAXACTIVE_MAX:
            raise LineError(hcol + 1, "MAXACT_TOO_BIG")
        maxactive = n
    if len(words) < 2:
        raise LineError(len(text.rstrip()) + 1, "BAD_PROBE_ADDR", "no probe point")
    where, wcol = words[1]
    symbol, addr, offset = None, None, 0
    a = F.kstrtoul(where)
    if a is not None:
        addr = a
    else:
        pct = where.find("%")
        if pct >= 0:
            if where[pct:] != "%return":
                raise LineError(wcol + pct, "BAD_ADDR_SUFFIX")
            where, is_return = where[:pct], True
        if ":" in where:
            raise LineError(wcol, "NO_MODULE")
        m = re.search(r"[+-]", where)
        if m:
            o = F.kstrtol(where[m.start() + (where[m.start()] == "+"):])
            if o is None or o < 0 or o > 0xFFFFFFFF:
                raise LineError(wcol, "BAD_PROBE_ADDR")
            symbol, offset = where[:m.start()], o
        else:
            symbol = where
        if not symbol:
            raise LineError(wcol, "BAD_PROBE_ADDR")
        if is_return and offset:
            raise LineError(wcol, "BAD_RETPROBE")
    group, event = None, None
    if colon >= 0:
        group, event = _event_name(head[colon + 1:], hcol + colon + 1)
    if event is None:
        c = "r" if is_return else "p"
        event = _sanitize(f"{c}_{symbol}_{offset}" if symbol else f"{c}_0x{addr:x}")[:MAX_EVENT_NAME_LEN]
    ev = EventDef(index, text, is_return, group or DEFAULT_GROUP, event, symbol, offset, addr, maxactive, words[2:])
    # Syntax of the arguments now; $argN is checked again once the address is known.
    F.parse_args(ev.words, F.ParseFlags(is_return=is_return, fentry=True, regs=regs))
    return ev


def expand(spec: Spec, arch=None) -> list[str]:
    """Parse `events` into probe tables appended to the spec, and check the syntax
    of every table's `fetch` (register names: the arch's).  Returns the error lines."""
    regs = arch.fetch_regs if arch is not None else None
    name = spec.name
    errors: list[str] = []
    seen: dict[tuple[str, str], int] = {}
    for i, text in enumerate(spec.events, 1):
        where = spec_where(name, spec.table("events", i))
        if not text.strip() or text.lstrip().startswith("#"):
            continue                    # as in kprobe_events: blank lines and comments
        try:
            ev = parse_line(text, i, regs)
            ev.label = spec.labels.get(ev.table, "")
        except (LineError, F.FetchError) as e:
            errors += caret_lines(where, text, e.column, e.message)
            continue
        key = (ev.group, ev.event)
        if key in seen:
            col = text.find(ev.event) if ":" in F.split_args(text)[0][0] else 0
            errors += caret_lines(where, text, max(col, 0), LINE_ERR["EVENT_EXIST"] + f" ({spec.table('events', seen[key])})")
            continue
        seen[key] = i
        fetch = text[ev.words[0][1]:] if ev.words else ""
        common = dict(table=ev.table, symbol_name=ev.symbol, addr=ev.addr, offset=ev.offset,
                      name=ev.event, fetch=fetch, is_glob=False, event=ev)
        if ev.is_return:
            spec.kretprobes.append(EventKretprobeSpec(maxactive=ev.maxactive, **common))
        else:
            spec.kprobes.append(EventKprobeSpec(**common))
    for k in [*spec.kprobes, *spec.kretprobes]:
        if k.fetch is None or isinstance(k, (EventKprobeSpec, EventKretprobeSpec)):
            continue
        try:
            F.parse_args(F.split_args(k.fetch), F.ParseFlags(is_return=isinstance(k, KretprobeSpec), fentry=True, regs=regs))
        except F.FetchError as e:
            errors += caret_lines(f"{spec_where(name, k.table)}: fetch", k.fetch, e.column, e.message)
    return errors


# --- after resolution: compiled trace events -----------------------------------------------------

@dataclass
class TraceEvent:
    """One trace event: a trace_kprobe, its print format and its fetch programs."""
    name: str
    where: str                  # "(work+0x0/0x1b)" for a kprobe; "work" (FUNC) for a kretprobe
    args: list[F.ProbeArg]
    is_return: bool = False
    pt_regs: bool = False       # the target hands every hit pt_regs (Rules.events_pt_regs)

    @property
    def reads_regs(self) -> bool:
        """Whether a hit reads pt_regs: a register, the stack, an argument or $retval
        ($comm, @SYM and immediates do not), so a kprobe event without any takes the
        clean call (planner.forms.choose_forms) and a kretprobe event the clean return
        hook, and its handler passes no regs; in a kernel always (perf and BPF read them)."""
        return self.pt_regs or any(i.op in F.REGS_OPS for a in self.args for i in a.code)


def _args_text(k) -> tuple[str, list[tuple[str, int]]]:
    """(text shown in errors, FETCHARGS words with their columns in that text)."""
    ev = getattr(k, "event", None)
    if ev is not None:
        return ev.text, ev.words
    return k.fetch, F.split_args(k.fetch)


def _parse_fetch(image, k, spec_name: str, flags) -> tuple[list | None, list[str]]:
    """A probe table's FETCHARGS parsed and its @SYMs resolved: (args, []), or
    (None, error lines with the column); (None, []) without fetch."""
    if k.fetch is None:
        return None, []
    text, words = _args_text(k)
    is_event = getattr(k, "event", None) is not None
    where = spec_where(spec_name, k.table) + ("" if is_event else ": fetch")
    try:
        args = k.event.fetch_args(flags) if is_event else F.parse_args(words, flags)
        F.resolve_symbols(args, image)
    except F.FetchError as e:
        return None, caret_lines(where, text, e.column, e.message)
    return args, []


def compile_probe(image, arch, p, spec_name: str) -> tuple[TraceEvent | None, list[str]]:
    """The trace event of one resolved kprobe (resolve.Probe) with `fetch` or from a `p` line."""
    k = p.spec
    fentry = p.func is not None and p.addr == arch.optprobe.adjust_kprobe_addr(image, p.func.start, 0)
    args, err = _parse_fetch(image, k, spec_name, F.ParseFlags(is_return=False, fentry=fentry, regs=arch.fetch_regs))
    if args is None:
        return None, err
    f = p.func
    loc = f"({f.name}+{p.addr - f.start:#x}/{f.end - f.start:#x})" if f else f"({p.addr:#x})"
    return TraceEvent(p.event_name, loc, args), []


def compile_return(image, k, func, spec_name: str) -> tuple[TraceEvent | None, list[str]]:
    """The trace event of a kretprobe (an `r` line, or a [[kretprobe]] with `fetch`) on
    function `func` (image.Function): FETCHARGS parsed for a return probe ($retval).
    The pipeline keys it "r<probe index>" in Session.traces; trace_c() then defines
    kp_trace_ret_r<index>, the kretprobe's handler, which runs the user's after it."""
    from ..arch import get_arch
    regs = get_arch(image.machine).fetch_regs
    args, err = _parse_fetch(image, k, spec_name, F.ParseFlags(is_return=True, fentry=False, regs=regs))
    if args is None:
        return None, err
    name = k.name or _sanitize(f"r_{func.name}_0")
    return TraceEvent(name, func.name, args, is_return=True), []


def trace_key(p):
    """The key of a probe's trace event: its index for a kprobe, "r<index>" for a kretprobe."""
    return f"r{p.index}" if getattr(p, "kret", None) is not None else p.index


def compile_all(image, arch, probes, kretprobes, spec_name: str, known_errors: list[str],
                pt_regs: bool = False) -> tuple[dict, list[str]]:
    """The trace event of every kprobe with `fetch` or from a `p` line, and of every
    placed kretprobe with `fetch` or from an `r` line, keyed by trace_key().
    Errors already reported (a syntax error expand() found) are not repeated.
    pt_regs: every event's hit passes pt_regs (Rules.events_pt_regs)."""
    traces, errors = {}, []
    for p in probes:
        t, err = compile_probe(image, arch, p, spec_name)
        if err and err[0] not in known_errors + errors:
            errors += err
        if t is not None:
            traces[trace_key(p)] = t
    for p in kretprobes:
        t, err = compile_return(image, p.kret, p.func, spec_name)
        if err and err[0] not in known_errors + errors:
            errors += err
        if t is not None:
            traces[trace_key(p)] = t
    errors += _same_names(traces, [*probes, *kretprobes], spec_name)
    for t in traces.values():
        t.pt_regs = pt_regs
    return traces, errors


def _same_names(traces: dict, probes, spec_name: str) -> list[str]:
    """EVENT_EXIST for two tables whose events take one name (a glob's default name
    for a function that a named table also probes, two tables given the same `name`),
    which would write two formats under one event. The kernel's kprobe_events appends a
    probe with the same arguments to the existing event and refuses one whose arguments
    differ; a spec says which table it means by giving one a `name`. The functions of one
    glob table given a `name` are one event on several functions, as the kernel's
    multi-probe events are (their arguments are the same by construction)."""
    first: dict[str, object] = {}
    errors = []
    for p in probes:
        t = traces.get(trace_key(p))
        if t is None:
            continue
        table = p.kret if getattr(p, "kret", None) is not None else p.spec
        other = first.setdefault(t.name, table)
        if other is not table:
            errors.append(f"{spec_where(spec_name, table.table)}: event {t.name} at {p.symbol}+{p.offset:#x}: "
                          f"{LINE_ERR['EVENT_EXIST']} ({other.table}); give one of the tables a `name`")
    return errors


def trace_c(events: dict, user_syms: dict, symtab) -> str:
    """Generated C: fetch programs and events, then per traced probe a handler that
    runs the trace and then the user's handler if any, and the symbol table.

    events: key -> TraceEvent; key is an int or a short identifier.  A kprobe event
    gets `int kp_trace_pre_<key>(struct kprobe *, struct pt_regs *)`, to be its
    pre_handler; a kretprobe event gets `int kp_trace_ret_<key>(struct
    kretprobe_instance *, struct pt_regs *)`, to be its return handler.
    user_syms: key -> link symbol of the user's pre_handler / handler."""
    from ..emit.cstring import c_string
    out = ['#include "kp_trace.h"']
    order = sorted(events, key=str)
    for n, idx in enumerate(order):
        ev = events[idx]
        lines, arr = F.args_c(f"kp_fa_{idx}", ev.args)
        out += lines
        head = "" if ev.is_return else f"{ev.name}: {ev.where}"
        out.append(f"static const struct kp_trace_event kp_tev_{idx} = {{ {c_string(ev.name)}, "
                   f"{c_string(ev.where)}, {arr}, {len(ev.args)}, {int(ev.is_return)}, "
                   f"{c_string(head)}, {len(head.encode())}, {n} }};")
        user = user_syms.get(idx)
        # no regs read: the hook may be a clean one, whose regs argument is not pt_regs
        regs = "regs" if ev.reads_regs else "0"
        if ev.is_return:
            call = f"return ((kretprobe_handler_t){user})(ri, regs);" if user else "return 0;"
            out.append(f"int kp_trace_ret_{idx}(struct kretprobe_instance *ri, struct pt_regs *regs) "
                       f"{{ kp_trace_kretprobe(&kp_tev_{idx}, {regs}, (unsigned long)ri->ret_addr, "
                       f"(unsigned long)get_kretprobe(ri)->kp.addr); {call} }}")
        else:
            call = f"return ((kprobe_pre_handler_t){user})(p, regs);" if user else "return 0;"
            out.append(f"int kp_trace_pre_{idx}(struct kprobe *p, struct pt_regs *regs) "
                       f"{{ kp_trace_kprobe(&kp_tev_{idx}, {regs}, (unsigned long)p->addr); {call} }}")
    out.append(f"const struct kp_trace_event *const kp_trace_events[{max(1, len(order))}] = {{ "
               + ", ".join(f"&kp_tev_{idx}" for idx in order) + " };")
    out.append(f"const unsigned int kp_ntrace_events = {len(order)};")
    syms = symtab if events else []
    names, offs = bytearray(), []
    for _, _, n in syms:
        offs.append(len(names))
        names += n.encode() + b"\0"
    out.append(f"const struct kp_sym kp_syms[{max(1, len(syms))}] = {{ "
               + ", ".join(f"{{ {a:#x}UL, {s:#x}UL, {o}U }}" for (a, s, _), o in zip(syms, offs)) + " };")
    out.append(f"const unsigned int kp_nsyms = {len(syms)};")
    out.append(f"const char kp_symnames[] = {c_string(names.decode())};")
    return "\n".join(out) + "\n"
