"""Reading a binary trace a thread at a time (rewriter/trace/stream.py): `trace --format
graph`, `replay` and `report` of binary traces written here byte by byte (the layout of
rewriter/trace/binary.py's docstring), with the threads' chunks interleaved, a chunk of
two threads, calls closed by an outer return, returns with no entry, calls still open
at the end, recursion, an entry that is not a call and a function that never returns;
each command's text must be exactly what the records read into memory give
(binary.records() + callgraph/report), and the graph exactly the text below.  Traces
this reader does not take (a thread's records out of time order) are read the old way,
with the same text."""
from __future__ import annotations

import json
import struct

from conftest import ALL_ARCHES, kprewrite
from rewriter.trace import binary, callgraph, report, stream

ARCHES = ALL_ARCHES
CHUNK, WINDOW, BIAS, BASE = 4096, 4 * 4096, 0x400000, 5_000_000_000
SYMS = [(0x1000, 0x40, b"fa"), (0x1040, 0x40, b"fb"), (0x1080, 0x40, b"fc"), (0x10c0, 0x40, b"fd"),
        (0x1100, 0x40, b"fu"), (0x1140, 0x40, b"fx")]
# (is_return, name, where); record ids are index + 1
EVENTS = [(0, b"p_fa_0", b"(fa+0x0/0x40)"), (1, b"r_fa_0", b"fa"), (0, b"p_fb_0", b"(fb+0x0/0x40)"),
          (1, b"r_fb_0", b"fb"), (0, b"p_fc_0", b"(fc+0x0/0x40)"), (1, b"r_fc_0", b"fc"),
          (0, b"p_fd_0", b"(fd+0x0/0x40)"), (1, b"r_fd_0", b"fd"), (0, b"p_fu_0", b"(fu+0x0/0x40)"),
          (1, b"r_fu_0", b"fu"), (0, b"p_fx_8", b"(fx+0x8/0x40)")]
ID = {name.decode(): i + 1 for i, (_, name, _) in enumerate(EVENTS)}
RET = BIAS + 0x1010          # a return into fa+0x10


def _str(b: bytes) -> bytes:
    return struct.pack("<H", len(b)) + b


def image() -> bytes:
    names = b"".join(n + b"\0" for _, _, n in SYMS)
    offs = [0]
    for _, _, n in SYMS[:-1]:
        offs.append(offs[-1] + len(n) + 1)
    d = struct.pack("<QQIIII", BASE, BIAS, 42, len(EVENTS), len(SYMS), len(names))
    d += b"".join(struct.pack("<HH", r, 0) + _str(n) + _str(w) for r, n, w in EVENTS)
    d += b"".join(struct.pack("<QQI", a, s, o) for (a, s, _), o in zip(SYMS, offs)) + names
    return struct.pack("<IIQ", 1, 1, len(d)) + d


def records(items) -> bytes:
    """A records chunk of image 1: ("ctx", tid, comm) or (event name, ns since BASE)."""
    words = []
    for it in items:
        if it[0] == "ctx":
            comm = it[2].encode().ljust(16, b"\0")
            words += [0xFFFF, it[1] | 42 << 32, 1, *struct.unpack("<QQ", comm)]
        else:
            words.append(it[1] << 16 | ID[it[0]])
            if it[0].startswith("r_"):
                words.append(RET)
    return struct.pack("<IIQ", 2, 1, 0) + struct.pack(f"<{len(words)}Q", *words)


def trace_file(path, chunks) -> None:
    head = b"KPTRACEB" + struct.pack("<IIIII", 1, 0, CHUNK, WINDOW, 0x01020304)
    out = [head, image()] + [records(c) for c in chunks]
    out += [b""] * (-len(out) % (WINDOW // CHUNK))
    path.write_bytes(b"".join(b.ljust(CHUNK, b"\0") for b in out))


# Thread 100 (main): fa { fb {} fb { fc (closed by fb's return) } fx+0x8 fa {} } ;
# fu (never returns: an item); a return of fc with no entry; fb still open at the end.
# Thread 200 (worker) in a chunk between main's two, and again in a chunk it shares with
# 300, whose fa { fb } are open at the end.
CHUNKS = [
    [("ctx", 100, "main"), ("p_fa_0", 1000), ("p_fb_0", 1100), ("r_fb_0", 1150), ("p_fb_0", 1200),
     ("p_fc_0", 1300)],
    [("ctx", 200, "worker"), ("p_fb_0", 1120), ("p_fc_0", 1130)],
    [("ctx", 100, "main"), ("r_fb_0", 31500), ("p_fx_8", 31600), ("p_fa_0", 31700), ("r_fa_0", 31800),
     ("r_fa_0", 2_001_000), ("p_fu_0", 2_002_000), ("r_fc_0", 2_003_000), ("p_fb_0", 2_004_000)],
    [("ctx", 200, "worker"), ("r_fc_0", 1_500_000), ("r_fb_0", 1_600_000),
     ("ctx", 300, "other"), ("p_fu_0", 5000), ("p_fa_0", 6000), ("p_fb_0", 7000)],
]
GRAPH = """\
# thread 100 (main)
#    DURATION  | FUNCTION CALLS
#      |   |   | |   |   |   |
               | fa() {
      0.050 us |   fb();
               |   fb() {
               |     fc(); /* no return in the trace */
 +   30.300 us |   } /* fb */
               |   /* p_fx_8: (fx+0x8/0x40) */
      0.100 us |   fa();
 #    2.000 ms | } /* fa */
               | /* p_fu_0: (fu+0x0/0x40) */
               | } /* fc: return with no entry in the trace */
               | fb(); /* no return in the trace */

# thread 200 (worker)
#    DURATION  | FUNCTION CALLS
#      |   |   | |   |   |   |
               | fb() {
 #    1.499 ms |   fc();
 #    1.599 ms | } /* fb */

# thread 300 (other)
#    DURATION  | FUNCTION CALLS
#      |   |   | |   |   |   |
               | /* p_fu_0: (fu+0x0/0x40) */
               | fa() {
               |   fb(); /* no return in the trace */
               | } /* fa: no return in the trace */
"""


def in_memory(path) -> tuple[str, str, dict]:
    """The graph, the report and the report's JSON from all the records in memory."""
    recs = binary.records(path.read_bytes(), str(path))
    s = report.summary(recs)
    return callgraph.graph_text(callgraph.build(recs)), report.text(s), s


def test_streamed_same_text(tmp_path):
    tf = tmp_path / "t.bin"
    trace_file(tf, CHUNKS)
    p = stream.read(str(tf))
    assert p is not None and p.nrecords == 20 and sorted(p.threads) == [100, 200, 300]
    graph, text, s = in_memory(tf)
    assert graph == GRAPH
    assert kprewrite("trace", tf, "--format", "graph").stdout == GRAPH
    assert kprewrite("replay", tf).stdout == GRAPH
    kprewrite("trace", tf, "--format", "graph", "-o", tmp_path / "g.txt")
    assert (tmp_path / "g.txt").read_text() == GRAPH
    assert kprewrite("report", tf).stdout == text
    doc = json.loads(kprewrite("report", tf, "--format", "json").stdout)
    assert doc["calls"] == json.loads(json.dumps(s["calls"]))
    assert doc["calls"]["unfinished"] == 4 and doc["calls"]["unmatched_returns"] == 1
    assert [r["function"] for r in doc["calls"]["slowest"]] == ["fa", "fb", "fc", "fb", "fa", "fb"]


def test_out_of_time_order_read_the_old_way(tmp_path):
    """Two chunks of one thread whose times overlap, and a chunk whose times go back:
    not streamed (their records interleave when sorted), the same text all the same."""
    for name, chunks in [
        ("overlap", [[("ctx", 7, "t"), ("p_fa_0", 100), ("p_fb_0", 300)],
                     [("ctx", 7, "t"), ("r_fb_0", 200), ("r_fa_0", 400)]]),
        ("back", [[("ctx", 7, "t"), ("p_fa_0", 100), ("p_fb_0", 300), ("r_fb_0", 200), ("r_fa_0", 400)]]),
    ]:
        tf = tmp_path / name
        trace_file(tf, chunks)
        assert stream.read(str(tf)) is None, name
        graph, text, _ = in_memory(tf)
        # in time order fb's return (200) comes before its entry (300): no pair
        assert "} /* fb: return with no entry in the trace */" in graph, graph
        assert kprewrite("trace", tf, "--format", "graph").stdout == graph
        assert kprewrite("report", tf).stdout == text


def test_nothing_recorded(tmp_path):
    tf = tmp_path / "empty"
    trace_file(tf, [[("ctx", 7, "t")]])
    assert stream.read(str(tf)).nrecords == 0
    r = kprewrite("replay", tf)
    assert r.stdout == "" and "nothing recorded" in r.stderr
