"""A binary trace's calls read without its records in memory: what
`trace --format graph` (and `replay`) print and what `report` sums up, the same text as
binary.records() + callgraph.build() give, in time and memory bounded by the file's
chunks and the calls' depth, not by the records.

Two passes over the file (mapped): plan() walks every record once (the checks, the
count of each event, each thread's runs of records in a chunk: its segments, with their
first and last times); graph() and summary() then walk each thread's segments in time
order with a stack of the thread's open calls, printing or summing each call as it
closes.  An event is formatted and its line parsed once (binary.body(),
record.LINE), not per record.

What this does not read exactly as records() does makes plan() return None, and the
caller reads the trace the old way (all records in memory): an event with fetch args,
a context or an event whose line does not parse as its parts, symbol names that could
change how a return's line parses (a '(', ')', ':', a space or a non-ASCII byte), a
thread's records out of time order (a 48-bit time that wrapped; its segments that
overlap in time), and any damage (the old way names it)."""
from __future__ import annotations

import heapq
import mmap
import re
from collections import Counter

from . import binary as B, callgraph as C, report as R
from .record import LINE, Record

E, RET, OTHER = 1, 2, 3                 # what an event's record is: a call's entry, a return, an item
_PLAIN_SYM = re.compile(rb"[!-'*-9;-~]*")   # printable ASCII but ( ) : and space


def open_binary(path: str):
    """The file mapped, if it is a binary trace that maps (None: read it the old way,
    which also says what is wrong with a file that does not open)."""
    if path == "-":
        return None
    try:
        with open(path, "rb") as f:
            if f.read(8) != B.MAGIC:
                return None
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None


def read(path: str) -> Plan | None:
    """plan() of a binary trace file; None: read it the old way (formats.read())."""
    data = open_binary(path)
    return None if data is None else plan(data, path)


class _Image:
    """An image's events as this reader needs them, indexed by record id (event + 1)."""

    def __init__(self, img: B.Image):
        self.base = img.base
        n = len(img.events)
        step = bytearray(65536)          # words of a record by id; 0: not read here
        self.fn = [""] * (n + 1)          # Record.func
        self.event = [""] * (n + 1)       # Record.event
        self.is_entry = [False] * (n + 1)
        self.is_return = [False] * (n + 1)
        self.loc = [""] * (n + 1)
        self.cnt = [0] * (n + 1)
        longest = max((len(s) for _, _, s in img.syms), default=0) + 40
        plain = all(_PLAIN_SYM.fullmatch(s) for _, _, s in img.syms) if any(
            e.is_return for e in img.events) else True
        for i, ev in enumerate(img.events, 1):
            if ev.args or (ev.is_return and (not plain or len(ev.name) + len(ev.where) + longest >= B.BODY_MAX - 8)):
                continue
            t = B.body(img, ev, 0, b"").decode("utf-8", errors="replace")
            m = LINE.match("x-1 [000] 0.0: " + t)
            if not m or m.group("ip") or m.group("args"):
                continue
            r = Record("", 0, 0, "0.0", m.group("event"), m.group("loc"), {})
            if r.is_return != ev.is_return:
                continue                    # a record's length would not follow from its kind
            step[i] = 2 if ev.is_return else 1
            self.fn[i], self.event[i], self.loc[i] = r.func, r.event, r.loc
            self.is_entry[i], self.is_return[i] = r.is_entry, r.is_return
        self.step = bytes(step)
        self.kind: list = []
        self.text: list = []
        self.ret: list = []                 # by an entry's id: the id of its function's return, else -1


class Plan:
    """What the first pass found: each thread's (tid -> (comm, segments in time order)),
    the images, the trace's last time, the count of records."""

    def __init__(self, data, chunk, images, threads, end, nrecords):
        self.data, self.chunk, self.images, self.threads = data, chunk, images, threads
        self.end, self.nrecords = end, nrecords

    def words(self, i: int) -> list:
        return _words(self.data, i, self.chunk)

    def counts(self) -> Counter:
        c: Counter = Counter()
        for img in self.images.values():
            for i, n in enumerate(img.cnt):
                if n:
                    c[img.event[i]] += n
        return c


def plan(data, where: str) -> Plan | None:
    """The first pass (see the module's docstring); None: read the trace the old way."""
    chunk, images, pending = B.scan(data, where)
    infos = {i: _Image(img) for i, img in images.items()}
    segs: dict[int, list] = {}
    comms: dict[int, tuple] = {}
    end = nrec = 0
    CTX = B.CTX
    for ci, image in pending:
        info = infos.get(image)
        if info is None:
            return None
        L = _words(data, ci, chunk)
        n = len(L)
        L += (0, 0)
        if L[0] and L[0] & 0xFFFF != CTX:
            return None
        step, cnt, base = info.step, info.cnt, info.base
        k = k0 = 0
        prev, tid = 0, None
        while True:
            w = L[k]
            if not w:
                break
            ident = w & 0xFFFF
            s = step[ident]
            if s:
                if w < prev and w >> 16 < prev >> 16:
                    return None             # out of time order
                prev = w
                cnt[ident] += 1
                k += s
                continue
            if ident != CTX or k + 5 > n:
                return None
            if k > k0:
                segs[tid].append((base + (L[k0] >> 16), ci, k0, k, image, base + (prev >> 16), comm))
            ctx = _context(L, k)
            if ctx is None:
                return None
            tid, comm = ctx
            segs.setdefault(tid, [])
            k += 5
            k0, prev = k, 0
        if k > n:
            return None                     # a record past the end of its chunk
        if k > k0:
            segs[tid].append((base + (L[k0] >> 16), ci, k0, k, image, base + (prev >> 16), comm))
    threads = {}
    for tid, ss in segs.items():
        if not ss:
            continue
        ss.sort()
        for a, b in zip(ss, ss[1:]):
            if a[5] > b[0] or (a[5] == b[0] and a[1:3] > b[1:3]):
                return None                 # overlapping in time: they would interleave
        threads[tid] = ss[0][6], ss
        end = max(end, max(s[5] for s in ss))
    paired = set()
    for info in infos.values():
        nrec += sum(info.cnt)
        paired.update(info.fn[i] for i, n in enumerate(info.cnt) if n and info.is_return[i])
    for info in infos.values():
        info.kind = [RET if r else E if e and f in paired else OTHER
                     for f, e, r in zip(info.fn, info.is_entry, info.is_return)]
        info.text = [f"{ev}: ({loc})" for ev, loc in zip(info.event, info.loc)]
        rets: dict = {}
        for i, (f, k) in enumerate(zip(info.fn, info.kind)):
            if k == RET:
                rets[f] = i if f not in rets else -1     # two return events of f: no shortcut
        info.ret = [rets.get(f, -1) if k == E else -1 for f, k in zip(info.fn, info.kind)]
    return Plan(data, chunk, infos, threads, end, nrec)


def _words(data, i: int, chunk: int) -> list:
    """Chunk i's words, as ints; the mapped pages let go of (they stay in the page cache),
    so that the process does not hold the file."""
    at = i * chunk
    with memoryview(data) as mv:
        L = mv[at + 16:at + chunk].cast("Q").tolist()
    if isinstance(data, mmap.mmap):
        data.madvise(mmap.MADV_DONTNEED, at, chunk)
    return L


def _context(L: list, k: int):
    """A context record's (thread id, comm) as the line's parse gives them; None: its
    line does not parse."""
    tid, cpu = L[k + 1] & 0xFFFFFFFF, L[k + 2]
    comm = (L[k + 3] | L[k + 4] << 64).to_bytes(16, "little").split(b"\0", 1)[0]
    prefix = (comm.rjust(16) + b"-" + str(tid).encode().ljust(7) +
              f" [{cpu % 1000:03d}] ".encode()).decode("utf-8", errors="replace")
    m = LINE.match(prefix + "0.000000000: e: (x)")
    return (int(m.group("pid")), m.group("comm")) if m else None


# --- trace --format graph -----------------------------------------------------------------------

_NO = C._NO_DUR + " | "


def graph(p: Plan, write) -> None:
    """callgraph.graph_text(callgraph.build(records)), written a part at a time."""
    durs: dict = {}                     # duration -> its column (the short ones, which repeat)

    def dcol(d: int) -> str:
        s = C._dur_col(d) + " | "
        if d < 1 << 16:
            durs[d] = s
        return s
    pads = ["  " * i for i in range(64)]
    out: list = []
    for n, tid in enumerate(sorted(p.threads)):
        comm, segs = p.threads[tid]
        if n:
            out.append("")
        out += [f"# thread {tid} ({comm})", f"# {'DURATION':>{C.DUR_W - 3}}  | FUNCTION CALLS",
                f"# {'|   |':>{C.DUR_W - 4}}   | |   |   |   |"]
        sf: list = []           # the open calls' functions, outermost first
        ss: list = []           # and their start times
        dep = 0                 # len(sf)
        pend = False            # the innermost open call has nothing in it yet: its line waits
        for _, ci, k, k1, image, _, _ in segs:
            L = p.words(ci)
            L.append(0)
            info = p.images[image]
            kind, fn, base, text, rets = info.kind, info.fn, info.base, info.text, info.ret
            while k < k1:
                w = L[k]
                ident = w & 0xFFFF
                kd = kind[ident]
                if kd == E:
                    if pend:
                        out.append(_NO + pads[dep - 1] + sf[-1] + "() {")
                    x = L[k + 1]
                    if x & 0xFFFF == rets[ident] and k + 1 < k1:     # its return next: a leaf
                        d = (x >> 16) - (w >> 16)
                        out.append((durs.get(d) or dcol(d)) + pads[dep] + fn[ident] + "();")
                        pend = False
                        k += 3
                        continue
                    sf.append(fn[ident])
                    ss.append(base + (w >> 16))
                    dep += 1
                    if dep == len(pads):
                        pads.append("  " * dep)
                    pend = True
                    k += 1
                    continue
                if kd == RET:
                    f = fn[ident]
                    if dep and sf[-1] == f:
                        sf.pop()
                        dep -= 1
                        d = base + (w >> 16) - ss.pop()
                        if pend:
                            out.append((durs.get(d) or dcol(d)) + pads[dep] + f + "();")
                            pend = False
                        else:
                            out.append((durs.get(d) or dcol(d)) + pads[dep] + "} /* " + f + " */")
                    elif f in sf:
                        i = dep - 1 - sf[::-1].index(f)
                        while dep > i + 1:          # calls above it: no return of their own
                            g = sf.pop()
                            ss.pop()
                            dep -= 1
                            if pend:
                                out.append(_NO + pads[dep] + g + "(); /* no return in the trace */")
                                pend = False
                            else:
                                out.append(_NO + pads[dep] + "} /* " + g + ": no return in the trace */")
                        sf.pop()
                        dep -= 1
                        d = base + (w >> 16) - ss.pop()
                        out.append((durs.get(d) or dcol(d)) + pads[dep] + "} /* " + f + " */")
                    else:
                        if pend:
                            out.append(_NO + pads[dep - 1] + sf[-1] + "() {")
                            pend = False
                        out.append(_NO + pads[dep] + "} /* " + f + ": return with no entry in the trace */")
                    k += 2
                    continue
                if pend:
                    out.append(_NO + pads[dep - 1] + sf[-1] + "() {")
                    pend = False
                out.append(_NO + pads[dep] + "/* " + text[ident] + " */")
                k += 1
            if len(out) > 50000:
                write("\n".join(out) + "\n")
                out.clear()
        while sf:                       # still open at the end of the trace
            g = sf.pop()
            ss.pop()
            dep -= 1
            if pend:
                out.append(_NO + pads[dep] + g + "(); /* no return in the trace */")
                pend = False
            else:
                out.append(_NO + pads[dep] + "} /* " + g + ": no return in the trace */")
    if out:
        write("\n".join(out) + "\n")


# --- report -------------------------------------------------------------------------------------

def summary(p: Plan) -> dict:
    """report.summary(records), from the plan."""
    index: dict[str, int] = {}
    for info in p.images.values():
        info.fi = [index.setdefault(f, len(index)) if k in (E, RET) else -1 for f, k in zip(info.fn, info.kind)]
    names = list(index)
    nf = len(names)
    calls, total, selfns, mx, unf, active = ([0] * nf for _ in range(6))
    hist = [[0] * 66 for _ in range(nf)]
    slow: list = []                 # the SLOWEST best: (duration, -start, -tid, -seq, function, parent)
    slow_min = -1
    unmatched = 0
    with_calls = 0
    end = p.end

    def unfinished(fi, start, ch, at):
        """A call with no return's numbers (closed at `at`); its duration."""
        d = at - start
        active[fi] -= 1
        if not active[fi]:
            total[fi] += d
        selfns[fi] += d - ch
        unf[fi] += 1
        return d

    for tid in sorted(p.threads):
        _, segs = p.threads[tid]
        sf: list = []               # open calls: function index, start, children's time, pre-order number
        ss: list = []
        sc: list = []
        sq: list = []
        seq = 0
        for _, ci, k, k1, image, _, _ in segs:
            L = p.words(ci)
            L.append(0)
            info = p.images[image]
            kind, fix, base, step, rets = info.kind, info.fi, info.base, info.step, info.ret
            while k < k1:
                w = L[k]
                ident = w & 0xFFFF
                kd = kind[ident]
                if kd == E:
                    fi = fix[ident]
                    x = L[k + 1]
                    if x & 0xFFFF == rets[ident] and k + 1 < k1:     # its return next: a leaf
                        d = (x >> 16) - (w >> 16)
                        calls[fi] += 1
                        if not active[fi]:
                            total[fi] += d
                        selfns[fi] += d
                        if d > mx[fi]:
                            mx[fi] = d
                        hist[fi][d.bit_length()] += 1
                        if sc:
                            sc[-1] += d
                        if d >= slow_min:
                            t = (d, -(base + (w >> 16)), -tid, -seq, fi, sf[-1] if sf else -1)
                            if len(slow) < R.SLOWEST:
                                heapq.heappush(slow, t)
                                if len(slow) == R.SLOWEST:
                                    slow_min = slow[0][0]
                            elif t > slow[0]:
                                heapq.heapreplace(slow, t)
                                slow_min = slow[0][0]
                        seq += 1
                        k += 3
                        continue
                    sf.append(fi)
                    ss.append(base + (w >> 16))
                    sc.append(0)
                    sq.append(seq)
                    seq += 1
                    calls[fi] += 1
                    active[fi] += 1
                elif kd == RET:
                    fi = fix[ident]
                    ns = base + (w >> 16)
                    if sf and sf[-1] == fi or fi in sf:
                        if sf[-1] != fi:
                            i = len(sf) - 1 - sf[::-1].index(fi)
                            while len(sf) > i + 1:      # calls above it: no return of their own
                                d = unfinished(sf.pop(), ss.pop(), sc.pop(), ns)
                                sq.pop()
                                sc[-1] += d
                        sf.pop()
                        start = ss.pop()
                        d = ns - start
                        active[fi] -= 1
                        if not active[fi]:
                            total[fi] += d
                        selfns[fi] += d - sc.pop()
                        if d > mx[fi]:
                            mx[fi] = d
                        hist[fi][d.bit_length()] += 1
                        q = sq.pop()
                        if sc:
                            sc[-1] += d
                        if d >= slow_min:
                            t = (d, -start, -tid, -q, fi, sf[-1] if sf else -1)
                            if len(slow) < R.SLOWEST:
                                heapq.heappush(slow, t)
                                if len(slow) == R.SLOWEST:
                                    slow_min = slow[0][0]
                            elif t > slow[0]:
                                heapq.heapreplace(slow, t)
                                slow_min = slow[0][0]
                    else:
                        unmatched += 1
                k += step[ident]
        if seq:
            with_calls += 1
        while sf:
            d = unfinished(sf.pop(), ss.pop(), sc.pop(), end)
            sq.pop()
            if sc:
                sc[-1] += d
    funcs = [{"function": names[i], "calls": calls[i], "total_ns": total[i], "self_ns": selfns[i],
              "max_ns": mx[i], "unfinished": unf[i]} for i in range(nf) if calls[i]]
    funcs.sort(key=lambda r: (-r["total_ns"], r["function"]))
    slow.sort(reverse=True)
    slowest = [{"function": names[fi], "tid": -mtid, "start": C._ts(-mstart), "duration_ns": d,
                "parent": names[pf] if pf >= 0 else None} for d, mstart, mtid, _, fi, pf in slow]
    hists = []
    for i in sorted((i for i in range(nf) if any(hist[i])), key=lambda i: names[i]):
        h = hist[i]
        used = [b for b, n in enumerate(h) if n]
        hists.append({"name": f"{names[i]}: duration (ns)", "count": sum(h),
                      "buckets": [(R.bucket_label(b), h[b]) for b in range(used[0], used[-1] + 1)]})
    counts = p.counts()
    return {"events": sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])),
            "calls": {"count": sum(f["calls"] for f in funcs), "threads": with_calls,
                      "unfinished": sum(f["unfinished"] for f in funcs), "unmatched_returns": unmatched,
                      "functions": funcs, "slowest": slowest},
            "histograms": hists}

