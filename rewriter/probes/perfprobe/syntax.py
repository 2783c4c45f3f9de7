"""perf probe's command syntax: parse one probe definition into plain data.

Mirrors tools/perf/util/probe-event.c's parse_perf_probe_command():

    [[GROUP:]EVENT=]FUNC[@SRC][:RLN|+OFFS|%return|;PTN] [ARG ...]
    [[GROUP:]EVENT=]SRC:ALN [ARG ...]
    [[GROUP:]EVENT=]SRC;PTN [ARG ...]

    ARG: [NAME=]VAR[->FIELD|.FIELD|[N]]...[:TYPE]    a variable by name
         [NAME=]$vars | $params | $retval             perf's special variables
         [NAME=]%REG | +OFFS(...) | @SYM | ...       a kprobe_events fetch arg, as written

Errors carry the column of the offending character, as fetch.FetchError does.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SEPARATORS = ";:+@%"
# perf probe's casts (probe-event.c: TYPE after ':'), checked against fetch.TYPES later.
RAW_ARG_START = ("%", "+", "-", "@", "\\")
RAW_VARS = ("$comm", "$stack")


class ProbeSyntaxError(Exception):
    def __init__(self, column: int, message: str):
        self.column, self.message = column, message
        super().__init__(message)


@dataclass
class Point:
    """struct perf_probe_point."""
    function: str | None = None
    file: str | None = None
    line: int = 0                 # relative to the function (with function) or absolute (with file only)
    offset: int = 0
    retprobe: bool = False
    lazy: str | None = None       # ;PTN: the source lines matching the pattern
    column: int = 0               # where the point starts, for errors


@dataclass
class Field:
    """struct perf_probe_arg_field: `->name`, `.name` or `[index]`."""
    ref: bool                     # '->' (through a pointer) rather than '.'
    name: str | None = None
    index: int | None = None


@dataclass
class Arg:
    """struct perf_probe_arg."""
    text: str                     # as written (after NAME=)
    column: int
    name: str | None              # NAME= given
    var: str                      # the variable, $vars/$params/$retval, or the raw fetch arg
    fields: list[Field] = field(default_factory=list)
    type: str | None = None       # the cast after ':'
    raw: bool = False             # a kprobe_events fetch arg, passed through


@dataclass
class ProbeDef:
    """struct perf_probe_event."""
    text: str
    group: str | None
    event: str | None
    point: Point
    args: list[Arg]


def _int(s: str, col: int, what: str) -> int:
    try:
        v = int(s, 0)
    except ValueError:
        raise ProbeSyntaxError(col, f"{what} must be a number, got '{s}'") from None
    if v < 0:
        raise ProbeSyntaxError(col, f"{what} must not be negative")
    return v


def parse_point(s: str, col: int) -> Point:
    """parse_perf_probe_point(): FUNC[@SRC][:RLN|+OFFS|%return|;PTN], SRC:ALN or SRC;PTN."""
    lazy = None
    if ";" in s:                  # the pattern is the rest of the point, whatever it holds
        semi = s.index(";")
        s, lazy = s[:semi], s[semi + 1:]
        if not lazy:
            raise ProbeSyntaxError(col + semi + 1, "nothing after ';'")
    pos = next((i for i, c in enumerate(s) if c in _SEPARATORS), len(s))
    head, p = s[:pos], Point(column=col)
    if not head:
        raise ProbeSyntaxError(col, "no function or source file before the separator")
    if _IDENT.fullmatch(head):
        p.function = head
    else:
        p.file = head
    seen: set[str] = set()
    while pos < len(s):
        sep = s[pos]
        end = next((i for i in range(pos + 1, len(s)) if s[i] in _SEPARATORS), len(s))
        val, vcol = s[pos + 1:end], col + pos + 1
        if sep in seen:
            raise ProbeSyntaxError(col + pos, f"'{sep}' given twice")
        seen.add(sep)
        if not val:
            raise ProbeSyntaxError(vcol, f"nothing after '{sep}'")
        if sep == "@":
            if p.file is not None:
                raise ProbeSyntaxError(col + pos, "'@SRC' after a source file")
            p.file = val
        elif sep == ":":
            p.line = _int(val, vcol, "the line")
        elif sep == "+":
            p.offset = _int(val, vcol, "the offset")
        elif sep == "%":
            if val != "return":
                raise ProbeSyntaxError(col + pos, f"unknown suffix '%{val}' (only %return)")
            p.retprobe = True
        pos = end
    p.lazy = lazy
    if lazy is not None and (p.line or p.offset or p.retprobe):
        raise ProbeSyntaxError(col, "only one of :RLN, +OFFS, %return and ;PTN")
    if p.function is None:
        if p.offset or p.retprobe:
            raise ProbeSyntaxError(col, "+OFFS and %return need a function, not a source file")
        if not p.line and lazy is None:
            raise ProbeSyntaxError(col, f"'{p.file}' is not a function name; a source file needs :LINE or ;PTN")
    if sum(bool(x) for x in (p.line and p.function, p.offset, p.retprobe)) > 1:
        raise ProbeSyntaxError(col, "only one of :RLN, +OFFS and %return")
    return p


_FIELD = re.compile(r"->|\.|\[")


def parse_arg(text: str, col: int) -> Arg:
    """parse_perf_probe_arg(): [NAME=]VAR[->F|.F|[N]]...[:TYPE], or a raw fetch arg."""
    name = None
    m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)=", text)
    if m:
        name, text, col = m.group(1), text[m.end():], col + m.end()
    if not text:
        raise ProbeSyntaxError(col, "no argument after '='")
    if text.startswith(RAW_ARG_START) or text.startswith(RAW_VARS):
        return Arg(text, col, name, text, raw=True)
    body, typ = text, None
    # the cast is after the last ':' (a bitfield or array type has no ':')
    colon = text.rfind(":")
    if colon >= 0:
        body, typ = text[:colon], text[colon + 1:]
        if not typ:
            raise ProbeSyntaxError(col + colon + 1, "no type after ':'")
    if body.startswith("$"):
        if body not in ("$vars", "$params", "$retval"):
            raise ProbeSyntaxError(col, f"unknown variable '{body}' ($vars, $params, $retval, $comm, $stackN)")
        if body != "$retval" and (typ or name):
            raise ProbeSyntaxError(col, f"{body} takes no name or type")
        return Arg(text, col, name, body, type=typ)
    m = _IDENT.match(body)
    if not m:
        raise ProbeSyntaxError(col, f"expected a variable name, got '{body}'")
    var, pos, fields = m.group(0), m.end(), []
    while pos < len(body):
        f = _FIELD.match(body, pos)
        if not f:
            raise ProbeSyntaxError(col + pos, f"expected '->', '.' or '[' after '{body[:pos]}'")
        if f.group(0) == "[":
            close = body.find("]", pos)
            if close < 0:
                raise ProbeSyntaxError(col + pos, "'[' is not closed")
            fields.append(Field(ref=False, index=_int(body[pos + 1:close], col + pos + 1, "the index")))
            pos = close + 1
        else:
            n = _IDENT.match(body, f.end())
            if not n:
                raise ProbeSyntaxError(col + f.end(), f"expected a field name after '{f.group(0)}'")
            fields.append(Field(ref=f.group(0) == "->", name=n.group(0)))
            pos = n.end()
    return Arg(text, col, name, var, fields, typ)


def parse(text: str) -> ProbeDef:
    """parse_perf_probe_command(): the whole definition."""
    words = [(m.group(0), m.start()) for m in re.finditer(r"\S+", text)]
    if not words:
        raise ProbeSyntaxError(0, "empty probe definition")
    head, hcol = words[0]
    group = event = None
    # EVENT= only when '=' comes before ';', '@', '+' and '%' (perf's strpbrk(arg, ";=@+%")):
    # a lazy pattern may hold '='
    first = next((i for i, c in enumerate(head) if c in ";=@+%"), -1)
    eq = first if first >= 0 and head[first] == "=" else -1
    if eq >= 0:
        ev = head[:eq]
        if ":" in ev:
            group, ev = ev.split(":", 1)
            if not _IDENT.fullmatch(group):
                raise ProbeSyntaxError(hcol, "the group name must be a C identifier")
        if not _IDENT.fullmatch(ev):
            raise ProbeSyntaxError(hcol + (len(group) + 1 if group else 0), "the event name must be a C identifier")
        event, head, hcol = ev, head[eq + 1:], hcol + eq + 1
        if not head:
            raise ProbeSyntaxError(hcol, "no probe point after 'EVENT='")
    point = parse_point(head, hcol)
    args = [parse_arg(w, c) for w, c in words[1:]]
    if point.retprobe:
        for a in args:
            if not a.raw and a.var != "$retval":
                raise ProbeSyntaxError(a.column, f"'{a.var}' at %return: only $retval (and raw fetch args) "
                                                 "can be read at a function's return")
    return ProbeDef(text, group, event, point, args)
