"""`kprewrite report TRACE [--plot FILE.svg]`: trace lines summed up.

Per-event counts; where entry and return events pair into calls (rewriter/trace/callgraph.py,
as the timeline of `kprewrite trace --format chrome` pairs them), uftrace report's
per-function table (calls, total and self time) and the slowest calls; and log2
histograms in the form of bpftrace's hist() (and of ftrace's hist triggers with
.log2): of each function's call durations (nanoseconds; a kernel's trace has
microsecond time stamps, so its durations are multiples of 1000), and of every
numeric field of every event.  --plot writes
the same histograms as one SVG file, written here directly: a handful of
rectangles and labels need no plotting library, and the output stays
byte-for-byte deterministic.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from xml.sax.saxutils import escape

from . import callgraph
from .record import Record

BAR = 52                # bpftrace's bar width


def bucket(v: int) -> int:
    """bpftrace's log2 bucket: -1 for negatives, 0 for 0, k+1 for [2^k, 2^(k+1))."""
    if v < 0:
        return -1
    return v.bit_length()


def _size(n: int) -> str:
    for suffix, shift in (("P", 50), ("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def bucket_label(b: int) -> str:
    if b == -1:
        return "(..., 0)"
    if b == 0:
        return "[0]"
    if b == 1:
        return "[1]"
    return f"[{_size(1 << (b - 1))}, {_size(1 << b)})"


def histogram(values: list[int]) -> list[tuple[str, int]]:
    """(bucket label, count) from the lowest bucket used to the highest, empty ones included."""
    counts = Counter(bucket(v) for v in values)
    lo, hi = min(counts), max(counts)
    return [(bucket_label(b), counts.get(b, 0)) for b in range(lo, hi + 1)]


def fields(records: list[Record]) -> dict[str, list[int]]:
    """"event.field" -> its values, for every field whose every value is an integer."""
    vals: dict[str, list] = defaultdict(list)
    for r in records:
        for k, v in r.args.items():
            vals[f"{r.event}.{k}"].append(v)
    return {k: v for k, v in vals.items() if all(isinstance(x, int) and not isinstance(x, bool) for x in v)}


SLOWEST = 10


def summary(records: list[Record]) -> dict:
    """What `report` prints: counts, the calls (per function, slowest) and the histograms (JSON-ready)."""
    counts = Counter(r.event for r in records)
    g = callgraph.build(records)
    funcs = callgraph.functions(g)
    hists = []
    calls = list(g.calls())
    per: dict[str, list[int]] = defaultdict(list)
    for c in calls:
        if not c.unfinished:
            per[c.func].append(c.duration)
    for func, ds in sorted(per.items()):
        hists.append({"name": f"{func}: duration (ns)", "count": len(ds), "buckets": histogram(ds)})
    for name, vs in sorted(fields(records).items()):
        hists.append({"name": name, "count": len(vs), "buckets": histogram(vs)})
    return {"events": sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])),
            "calls": {"count": sum(f["calls"] for f in funcs), "threads": len({c.tid for c in calls}),
                      "unfinished": sum(f["unfinished"] for f in funcs), "unmatched_returns": g.unmatched,
                      "functions": funcs, "slowest": callgraph.slowest(g, SLOWEST)},
            "histograms": hists}


def _calls_text(c: dict) -> list[str]:
    if not c["count"]:
        return []
    dt = callgraph.duration_text
    lines = ["", f"CALLS: {c['count']} on {c['threads']} thread{'s' if c['threads'] != 1 else ''} "
             f"(entry and return events paired; {c['unfinished']} with no return, "
             f"{c['unmatched_returns']} returns with no entry)",
             "", f"  {'Total time':>10}  {'Self time':>10}  {'Calls':>10}  Function",
             f"  {'=' * 10}  {'=' * 10}  {'=' * 10}  {'=' * 20}"]
    lines += [f"  {dt(f['total_ns']):>10}  {dt(f['self_ns']):>10}  {f['calls']:>10}  {f['function']}"
              for f in c["functions"]]
    lines += ["", f"SLOWEST CALLS (the {len(c['slowest'])} longest that returned)",
              "", f"  {'Duration':>10}  {'TID':>8}  {'Start':<20}  Function (caller)",
              f"  {'=' * 10}  {'=' * 8}  {'=' * 20}  {'=' * 20}"]
    lines += [f"  {dt(s['duration_ns']):>10}  {s['tid']:>8}  {s['start']:<20}  {s['function']}"
              + (f" (from {s['parent']})" if s["parent"] else "") for s in c["slowest"]]
    return lines


def text(s: dict) -> str:
    width = max([len(e) for e, _ in s["events"]] + [5])
    lines = [f"{'EVENT':<{width}}  {'COUNT':>10}"]
    lines += [f"{e:<{width}}  {n:>10}" for e, n in s["events"]]
    lines += _calls_text(s["calls"])
    for h in s["histograms"]:
        lines += ["", f"@{h['name']}:"]
        top = max(n for _, n in h["buckets"]) or 1
        for label, n in h["buckets"]:
            bar = "@" * (n * BAR // top)
            lines.append(f"{label:<20}{n:>8} |{bar:<{BAR}}|")
    return "\n".join(lines) + "\n"


def svg(s: dict, title: str) -> str:
    """The histograms as horizontal bar charts, one under the other, in one SVG."""
    row, label_w, bar_w, pad = 16, 130, 360, 10
    parts, y = [], pad + 18
    parts.append(f'<text x="{pad}" y="{y}" font-size="14" font-weight="bold">{escape(title)}</text>')
    y += 10
    counts = ", ".join(f"{e} {n}" for e, n in s["events"])
    y += 16
    parts.append(f'<text x="{pad}" y="{y}" font-size="11">{escape("events: " + counts)}</text>')
    for h in s["histograms"]:
        y += 26
        parts.append(f'<text x="{pad}" y="{y}" font-size="12" font-weight="bold">'
                     f'{escape(h["name"])} ({h["count"]} values)</text>')
        top = max(n for _, n in h["buckets"]) or 1
        for label, n in h["buckets"]:
            y += row
            w = round(bar_w * n / top)
            parts.append(f'<text x="{pad + label_w - 6}" y="{y + 11}" font-size="11" text-anchor="end">{escape(label)}</text>')
            parts.append(f'<rect x="{pad + label_w}" y="{y + 2}" width="{w}" height="{row - 4}" fill="#4878a8"/>')
            parts.append(f'<text x="{pad + label_w + w + 4}" y="{y + 11}" font-size="11">{n}</text>')
    width, height = pad * 2 + label_w + bar_w + 60, y + row + pad
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="monospace">\n'
            f'<rect width="{width}" height="{height}" fill="white"/>\n' + "\n".join(parts) + "\n</svg>\n")
