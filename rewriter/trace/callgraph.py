"""The call graph of a trace: entry and return events paired into nested calls.

What ftrace's function_graph tracer and `uftrace replay`/`uftrace report` show, from
trace lines: an entry event of FUNC (a kprobe on FUNC's first instruction, or past the
landing pad the arch skips) and a return event `<- FUNC` (a kretprobe) of one thread are
one call; calls nest by time on their thread.  `[[function_graph]]` in a spec (or a
kprobe and a kretprobe with `fetch = ""` on the same functions) writes exactly these
events.

Pairing (kernel/trace/trace_functions_graph.c keeps a per-task return stack; so does
this): entries of a function that has return events anywhere in the trace push a call
on the thread's stack; a return of FUNC closes the innermost open call of FUNC.  What a
trace may lack is handled, not guessed:
- calls above the one a return closes (their own return is missing: a lost line, a
  longjmp, an exception) end where that return is, marked unfinished ("parent");
- calls still open when the trace ends end at the trace's last time stamp, marked
  unfinished ("end"), as Perfetto draws a slice that "did not end";
- a return with no open entry (tracing began inside the call) is kept as an event of its
  own, never paired with an older call;
- entries of a function with no return event at all (a plain kprobe) are events, not calls.
Times are the trace lines' own, in nanoseconds (the user runtime prints 9 digits; a
kernel's tracing/trace prints microseconds).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .record import Record


@dataclass(eq=False)
class Call:
    func: str
    tid: int
    start: int                          # ns
    entry: Record
    end: int = 0                        # ns; set when closed
    ret: Record | None = None           # the return event (None: unfinished)
    unfinished: str | None = None       # None, "parent" (an outer return closed it) or "end"
    items: list = field(default_factory=list)   # nested Calls and other Records, in time order

    @property
    def duration(self) -> int:
        return self.end - self.start

    @property
    def children(self) -> list["Call"]:
        return [c for c in self.items if isinstance(c, Call)]

    @property
    def self_time(self) -> int:
        return self.duration - sum(c.duration for c in self.children)


@dataclass(eq=False)
class Thread:
    tid: int
    comm: str
    items: list = field(default_factory=list)   # top-level Calls and Records
    unmatched: int = 0                           # returns with no open entry


@dataclass
class Graph:
    threads: dict[int, Thread]
    end: int                                     # the trace's last time stamp (ns)

    def walk(self):
        """Every call with the functions of the calls enclosing it (outermost first), each
        thread's in pre-order (a parent before its children); an explicit stack, so no
        recursion limit on deep traces."""
        for tid in sorted(self.threads):
            stack = [(i, ()) for i in reversed(self.threads[tid].items) if isinstance(i, Call)]
            while stack:
                c, outer = stack.pop()
                yield c, outer
                inner = outer + (c.func,)
                stack.extend((i, inner) for i in reversed(c.items) if isinstance(i, Call))

    def calls(self):
        """Every call, in walk()'s order."""
        return (c for c, _ in self.walk())

    @property
    def unmatched(self) -> int:
        return sum(t.unmatched for t in self.threads.values())


def build(records: list[Record]) -> Graph:
    """Pair entries and returns into per-thread call trees (see the module's docstring)."""
    paired = {r.func for r in records if r.is_return}
    recs = sorted(records, key=lambda r: r.ts_ns)       # stable: equal times keep file order
    end = recs[-1].ts_ns if recs else 0
    threads: dict[int, Thread] = {}
    stacks: dict[int, list[Call]] = {}
    for r in recs:
        th = threads.get(r.pid)
        if th is None:
            th = threads[r.pid] = Thread(r.pid, r.comm)
            stacks[r.pid] = []
        st = stacks[r.pid]
        into = st[-1].items if st else th.items
        if r.is_entry and r.func in paired:
            c = Call(r.func, r.pid, r.ts_ns, r)
            into.append(c)
            st.append(c)
        elif r.is_return:
            for i in range(len(st) - 1, -1, -1):
                if st[i].func == r.func:
                    for inner in st[i + 1:]:
                        inner.end, inner.unfinished = r.ts_ns, "parent"
                    st[i].end, st[i].ret = r.ts_ns, r
                    del st[i:]
                    break
            else:
                into.append(r)
                th.unmatched += 1
        else:
            into.append(r)
    for st in stacks.values():
        for c in st:
            c.end, c.unfinished = end, "end"
    return Graph(threads, end)


# --- numbers -----------------------------------------------------------------------------------

def functions(g: Graph) -> list[dict]:
    """uftrace report's table: per function, its calls, total and self time (ns).  Total
    counts a call only when no call of the same function encloses it on its thread, so a
    recursive function's time is not counted twice; self is each call's time minus its
    children's.  Unfinished calls count with the time up to where they were closed.
    Sorted by total time, largest first."""
    rows: dict[str, dict] = {}
    for c, outer in g.walk():
        row = rows.setdefault(c.func, {"function": c.func, "calls": 0, "total_ns": 0, "self_ns": 0,
                                       "max_ns": 0, "unfinished": 0})
        row["calls"] += 1
        if c.func not in outer:
            row["total_ns"] += c.duration
        row["self_ns"] += c.self_time
        if c.unfinished:
            row["unfinished"] += 1
        elif c.duration > row["max_ns"]:
            row["max_ns"] = c.duration
    return sorted(rows.values(), key=lambda r: (-r["total_ns"], r["function"]))


def slowest(g: Graph, n: int = 10) -> list[dict]:
    """The n longest calls that returned (ties: earlier first), with their caller."""
    out = [(c, outer[-1] if outer else None) for c, outer in g.walk() if not c.unfinished]
    out.sort(key=lambda cp: (-cp[0].duration, cp[0].start, cp[0].tid))
    return [{"function": c.func, "tid": c.tid, "start": _ts(c.start), "duration_ns": c.duration,
             "parent": p} for c, p in out[:n]]


def _ts(ns: int) -> str:
    return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


def duration_text(ns: int) -> str:
    """uftrace's unit choice: us below 1 ms, ms below 1 s, else s; three decimals."""
    if ns < 1_000_000:
        return f"{ns / 1e3:.3f} us"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.3f} ms"
    return f"{ns / 1e9:.3f}  s"


# function_graph's duration marks (trace_find_mark()): the first limit the time exceeds.
MARKS = ((1_000_000_000, "$"), (100_000_000, "@"), (10_000_000, "*"), (1_000_000, "#"),
         (100_000, "!"), (10_000, "+"))


def _mark(ns: int) -> str:
    for limit, m in MARKS:
        if ns > limit:
            return m
    return " "


# --- function_graph's layout --------------------------------------------------------------------

DUR_W = 14          # " + 1234.567 us" fits the column; longer ones push the bar right


_NO_DUR = " " * DUR_W


def _dur_col(ns: int | None) -> str:
    """The duration column; its first character is a space, so that a mark ('#' over
    1 ms) never starts a line and reads as a comment, as the header lines do."""
    if ns is None:
        return _NO_DUR
    return f" {_mark(ns)} {duration_text(ns):>{DUR_W - 3}}"


def _event_text(r: Record) -> str:
    args = " ".join(f"{k}={v}" for k, v in r.args.items())
    return f"{r.event}: ({r.loc}){' ' + args if args else ''}"


def graph_text(g: Graph) -> str:
    """Each thread's calls as ftrace's function_graph prints them (with its funcgraph-tail
    option: the name after a closing brace), one section per thread."""
    out: list[str] = []
    for tid in sorted(g.threads):
        th = g.threads[tid]
        if out:
            out.append("")
        out.append(f"# thread {tid} ({th.comm})")
        out.append(f"# {'DURATION':>{DUR_W - 3}}  | FUNCTION CALLS")
        out.append(f"# {'|   |':>{DUR_W - 4}}   | |   |   |   |")
        # (item, depth, closing?) on an explicit stack: no recursion limit on deep traces.
        stack = [(i, 0, False) for i in reversed(th.items)]
        while stack:
            item, depth, closing = stack.pop()
            pad = "  " * depth
            if closing:
                note = ": no return in the trace" if item.unfinished else ""
                dur = None if item.unfinished else item.duration
                out.append(f"{_dur_col(dur)} | {pad}}} /* {item.func}{note} */")
            elif isinstance(item, Call):
                if not item.items:
                    tail = " /* no return in the trace */" if item.unfinished else ""
                    out.append(f"{_dur_col(None if item.unfinished else item.duration)} | {pad}{item.func}();{tail}")
                else:
                    out.append(f"{_dur_col(None)} | {pad}{item.func}() {{")
                    stack.append((item, depth, True))
                    stack.extend((i, depth + 1, False) for i in reversed(item.items))
            elif item.is_return:
                out.append(f"{_dur_col(None)} | {pad}}} /* {item.func}: return with no entry in the trace */")
            else:
                out.append(f"{_dur_col(None)} | {pad}/* {_event_text(item)} */")
    return "\n".join(out) + "\n" if out else ""


# --- the Chrome trace-event format ---------------------------------------------------------------

def _us(ns: int):
    """Chrome's ts/dur are microseconds; fractions are allowed (ns kept as 3 decimals)."""
    return ns // 1000 if ns % 1000 == 0 else round(ns / 1000, 3)


def chrome(records: list[Record], process: str = "kprewrite") -> dict:
    """Chrome trace-event JSON (the JSON Object Format): every call a complete slice
    ("ph": "X" with dur), each thread's in pre-order, so they nest; other events, and
    returns with no entry, instants on their thread."""
    PID = 1
    g = build(records)
    events = [{"name": "process_name", "ph": "M", "pid": PID, "tid": 0, "args": {"name": process}}]
    out: list[dict] = []

    def instant(r: Record):
        out.append({"name": r.event, "cat": "kprobe", "ph": "i", "s": "t", "ts": _us(r.ts_ns), "pid": PID,
                    "tid": r.pid, "args": dict(r.args, ip=r.loc)})

    for tid in sorted(g.threads):
        th = g.threads[tid]
        events.append({"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": th.comm}})
        stack = list(reversed(th.items))
        while stack:
            item = stack.pop()
            if not isinstance(item, Call):
                instant(item)
                continue
            args = {f"entry.{k}": v for k, v in item.entry.args.items()}
            args["entry"] = item.entry.event
            if item.ret is not None:
                args.update({f"return.{k}": v for k, v in item.ret.args.items()})
                args.update(ret=item.ret.event, caller=item.ret.loc.split(" <- ")[0])
            else:
                args["unfinished"] = ("no return: closed at an outer call's return" if item.unfinished == "parent"
                                      else "no return: still running at the end of the trace")
            out.append({"name": item.func, "cat": "kprobe", "ph": "X", "ts": _us(item.start),
                        "dur": _us(item.end - item.start), "pid": PID, "tid": tid, "args": args})
            stack.extend(reversed(item.items))
    return {"traceEvents": events + out, "displayTimeUnit": "ns",
            "otherData": {"source": "kprewrite trace"}}
