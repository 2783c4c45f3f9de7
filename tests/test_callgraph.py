"""The call graph (rewriter/trace/callgraph.py): a `[[function_graph]]` spec on a program whose
call tree is known, run natively and under QEMU (and cross-built for aarch64 under
qemu-aarch64 with KPREWRITE_TEST_ARCH=aarch64); `kprewrite trace --format graph` (ftrace's
function_graph layout), `report`'s total/self table and slowest calls, and the Chrome
export's nested slices; and traces that lack lines (returns with no entry, entries with
no return) giving sane output."""
from __future__ import annotations

import json
import re

import pytest

from conftest import ALL_ARCHES, cc, instrument, kprewrite, run, write_spec
from test_events import check_chrome

FORK_PROG = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/wait.h>
volatile long sink;
__attribute__((noinline)) long fk_leaf(long x) { sink = x; return x & 7; }
__attribute__((noinline)) long fk_mid(long x) { long r = fk_leaf(x) + fk_leaf(x + 1); sink = r; return r; }
int main(int argc, char **argv)
{
    long n = atol(argv[1]), s = 0;
    for (long i = 0; i < n; i++)
        s += fk_mid(i);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        long c = 0;
        for (long i = 0; i < 10; i++)
            c += fk_mid(i);
        exit(c == 0 ? 1 : 0);
    }
    int status;
    waitpid(pid, &status, 0);
    s += fk_mid(n);
    printf("%ld %d\n", s, WEXITSTATUS(status));
    return 0;
}
"""
from rewriter.trace import callgraph, formats as tracefmt
from rewriter.probes.spec import load_spec

ARCHES = ALL_ARCHES

# main -> cg_a -> cg_b x3, main -> cg_c -> cg_b, and a thread: cg_t -> cg_b.
PROG = r"""
#include <stdio.h>
#include <pthread.h>
volatile long sink;
__attribute__((noinline)) long cg_b(long x)
{
    long s = 0;
    for (long i = 0; i < 2000 + x; i++)
        s += i ^ x;
    sink = s;
    return s & 0xff;
}
__attribute__((noinline)) long cg_a(long x)
{
    long s = 0;
    for (int i = 0; i < 3; i++)
        s += cg_b(x + i);
    return s;
}
__attribute__((noinline)) long cg_c(long x) { long r = cg_b(x * 2); sink = r; return r + 1; }
__attribute__((noinline)) long cg_t(long x) { long r = cg_b(x); sink = r; return r + 2; }
static void *thread(void *arg) { return (void *)cg_t((long)arg); }
int main(void)
{
    pthread_t t;
    void *r;
    long s = cg_a(1) + cg_c(2);
    pthread_create(&t, 0, thread, (void *)5);
    pthread_join(t, &r);
    printf("%ld\n", s + (long)r);
    return 0;
}
"""
SPEC = '[[function_graph]]\nsymbol_name = "cg_*"\n\n[[function_graph]]\nsymbol_name = "main"\n'
FLAGS = ("-O2", "-fno-inline", "-fno-optimize-sibling-calls", "-pthread")


def expected_output() -> str:
    def b(x):
        s = 0
        for i in range(2000 + x):
            s += i ^ x
        return s & 0xff
    s = sum(b(1 + i) for i in range(3)) + b(4) + 1
    return f"{s + b(5) + 2}\n"


@pytest.fixture(scope="module")
def graph_prog(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("callgraph")
    prog = cc(tmp, "prog", PROG, *FLAGS)
    return instrument(prog, write_spec(tmp, SPEC))


def shape(items) -> list:
    """(name, children) of each call, ignoring other events."""
    return [(c.func, shape(c.items)) for c in items if isinstance(c, callgraph.Call)]


B = ("cg_b", [])
MAIN_TREE = [("main", [("cg_a", [B, B, B]), ("cg_c", [B])])]
THREAD_TREE = [("cg_t", [B])]


# A trace in the kernel's text lines (the default), or in binary records
# (KPREWRITE_TRACE_FORMAT=binary: a file mapped shared, formatted when read).
FORMATS = ["text", "binary"]


def trace_env(tf, fmt: str) -> dict:
    return {"KPREWRITE_TRACE": str(tf), **({"KPREWRITE_TRACE_FORMAT": "binary"} if fmt == "binary" else {})}


def trace_text(tf, fmt: str) -> str:
    """The trace lines of a run: the file itself, or a binary trace's formatted by `kprewrite trace`."""
    if fmt == "binary":
        assert tf.read_bytes()[:8] == b"KPTRACEB"
        return kprewrite("trace", tf, "--format", "text").stdout
    return tf.read_text()


@pytest.fixture(params=FORMATS)
def fmt(request):
    return request.param


@pytest.fixture(scope="module")
def traces(graph_prog, tmp_path_factory):
    """(runner, format) -> the trace file of one run (each runs once per module)."""
    out = {}
    def get(runner, fmt="text"):
        if (runner, fmt) not in out:
            tf = tmp_path_factory.mktemp(f"trace-{runner}-{fmt}") / "trace.txt"
            r = run(graph_prog, runner=runner, env=trace_env(tf, fmt))
            assert r.returncode == 0, r.stderr
            assert r.stdout == expected_output() and r.stderr == ""
            out[runner, fmt] = tf
        return out[runner, fmt]
    return get


def test_tree_of_a_known_program(traces, runner, fmt):
    tf = traces(runner, fmt)
    text = trace_text(tf, fmt)
    # The user runtime's time stamps are nanoseconds: nine digits.
    assert all(re.search(r"\] +\d+\.\d{9}: ", l) for l in text.splitlines()), text[:300]
    g = callgraph.build(tracefmt.read(str(tf)))
    trees = sorted((shape(t.items) for t in g.threads.values()), key=len, reverse=True)
    assert len(g.threads) == 2
    assert sorted(map(str, trees)) == sorted(map(str, [MAIN_TREE, THREAD_TREE]))
    calls = list(g.calls())
    assert len(calls) == 1 + 1 + 1 + 1 + 5
    for c in calls:
        assert c.unfinished is None and c.ret is not None
        assert c.duration >= 0 and c.self_time >= 0
        assert c.duration >= sum(ch.duration for ch in c.children)
        assert all(c.start <= ch.start and ch.end <= c.end for ch in c.children)
    assert g.unmatched == 0


def test_graph_text(traces, runner, fmt):
    out = kprewrite("trace", traces(runner, fmt), "--format", "graph").stdout.splitlines()
    sections = [i for i, l in enumerate(out) if l.startswith("# thread ")]
    assert len(sections) == 2
    body = [l for l in out if not l.startswith("#") and l.strip()]
    dur = re.compile(r"^ [ +!#*@$] +\d+\.\d{3} (us|ms|  s) \| ")
    blank = re.compile(r"^ {14} \| ")
    calls = []
    for l in body:
        funcs = l.split("| ", 1)[1]
        if funcs.strip().endswith("();") or funcs.strip().startswith("}"):
            assert dur.match(l), l                  # a leaf and a closing brace carry the duration
        else:
            assert blank.match(l) and funcs.endswith("() {"), l
        calls.append(funcs.rstrip())
    main = ["main() {", "  cg_a() {", "    cg_b();", "    cg_b();", "    cg_b();", "  } /* cg_a */",
            "  cg_c() {", "    cg_b();", "  } /* cg_c */", "} /* main */"]
    thread = ["cg_t() {", "  cg_b();", "} /* cg_t */"]
    assert calls in (main + thread, thread + main), "\n".join(out)


def test_report_total_and_self(traces, runner, fmt):
    tf = traces(runner, fmt)
    doc = json.loads(kprewrite("report", tf, "--format", "json").stdout)
    c = doc["calls"]
    assert (c["count"], c["threads"], c["unfinished"], c["unmatched_returns"]) == (9, 2, 0, 0)
    rows = {f["function"]: f for f in c["functions"]}
    assert {k: v["calls"] for k, v in rows.items()} == {"main": 1, "cg_a": 1, "cg_b": 5, "cg_c": 1, "cg_t": 1}
    for f in rows.values():
        assert 0 <= f["self_ns"] <= f["total_ns"] and f["max_ns"] <= f["total_ns"]
    assert rows["cg_b"]["self_ns"] == rows["cg_b"]["total_ns"]          # a leaf
    # Self times add up to the time of the outermost calls, and a parent's total holds its children's.
    g = callgraph.build(tracefmt.read(str(tf)))
    roots = [i for t in g.threads.values() for i in t.items if isinstance(i, callgraph.Call)]
    assert sum(f["self_ns"] for f in rows.values()) == sum(r.duration for r in roots)
    assert rows["main"]["total_ns"] >= rows["cg_a"]["total_ns"] + rows["cg_c"]["total_ns"]
    assert rows["cg_a"]["total_ns"] - rows["cg_a"]["self_ns"] <= rows["cg_b"]["total_ns"]
    slow = c["slowest"]
    assert len(slow) == 9 and [s["duration_ns"] for s in slow] == sorted((s["duration_ns"] for s in slow), reverse=True)
    assert {(s["function"], s["parent"]) for s in slow} == {
        ("main", None), ("cg_a", "main"), ("cg_c", "main"), ("cg_t", None), ("cg_b", "cg_a"), ("cg_b", "cg_c"),
        ("cg_b", "cg_t")}
    text = kprewrite("report", tf).stdout
    assert "  Total time   Self time       Calls  Function" in text
    assert re.search(r"\n +\d+\.\d{3} (us|ms) +\d+\.\d{3} (us|ms) +5  cg_b\n", text), text
    assert "SLOWEST CALLS" in text and "cg_b (from cg_a)" in text


def check_nested(doc: dict) -> list[dict]:
    """The Chrome format's rules, and the complete slices of each thread nest (none
    overlaps another partly: test_events.check_chrome()); returns the slices."""
    check_chrome(doc)
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def test_chrome_slices_nest(traces, runner, fmt, tmp_path):
    kprewrite("trace", traces(runner, fmt), "--format", "chrome", "-o", tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    xs = check_nested(doc)
    assert all(len(repr(e["dur"]).partition(".")[2]) <= 3 for e in xs), xs      # ns as 3 decimals, no float noise
    assert sorted(e["name"] for e in xs) == ["cg_a", "cg_b", "cg_b", "cg_b", "cg_b", "cg_b", "cg_c", "cg_t", "main"]
    assert all("unfinished" not in e["args"] and e["args"]["ret"].startswith("r_") for e in xs)
    assert not [e for e in doc["traceEvents"] if e["ph"] == "i"]
    names = sorted(e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name")
    assert len(names) == 2


# --- traces that lack lines -------------------------------------------------------------------------

BROKEN = """\
            prog-7       [000]     1.000000000: r_x_0: (main+0x10/0x40 <- x)
            prog-7       [000]     1.000000100: p_main_0: (main+0x0/0x40)
            prog-7       [000]     1.000000200: p_f_0: (f+0x0/0x10)
            prog-7       [000]     1.000000250: mid: (f+0x8/0x10) v=3
            prog-7       [000]     1.000000300: p_g_0: (g+0x0/0x10)
            prog-7       [000]     1.000000500: r_f_0: (main+0x20/0x40 <- f)
            prog-7       [000]     1.000000600: r_y_0: (main+0x28/0x40 <- y)
            prog-7       [000]     1.000000700: p_h_0: (h+0x0/0x10)
            prog-8       [001]     1.000000800: p_f_0: (f+0x0/0x10)
            prog-8       [001]     1.000000900: r_f_0: (h+0x4/0x10 <- f)
            prog-7       [000]     1.000001000: p_f_0: (f+0x0/0x10)
"""
# r_g_0/r_main_0/r_h_0 never come: g's return is lost inside f (closed by f's return),
# main, h and the f inside h are still running at the end; x and y return with no entry.
EXTRA = """\
            prog-9       [000]     0.500000000: r_g_0: (f+0x4/0x10 <- g)
            prog-9       [000]     0.500000001: r_main_0: (f+0x4/0x10 <- main)
            prog-9       [000]     0.500000002: r_h_0: (f+0x4/0x10 <- h)
"""


def test_lines_missing(tmp_path):
    tf = tmp_path / "broken.txt"
    tf.write_text(EXTRA + BROKEN)
    g = callgraph.build(tracefmt.read(str(tf)))
    t7 = g.threads[7]
    assert shape(t7.items) == [("main", [("f", [("g", [])]), ("h", [("f", [])])])]
    main = t7.items[1]
    f, h = main.children
    f2, g_ = h.children[0], f.children[0]
    assert f.duration == 300 and f.ret is not None and f.items[0].event == "mid"
    assert (g_.unfinished, g_.end) == ("parent", f.end)            # closed where f returned
    assert (main.unfinished, h.unfinished, f2.unfinished) == ("end", "end", "end")
    assert main.end == g.end == 1_000_001_000                       # the trace's last time stamp
    assert t7.unmatched == 2 and g.unmatched == 2 + 3               # x, y; prog-9's three
    assert shape(g.threads[8].items) == [("f", [])] and g.threads[8].items[0].duration == 100

    out = kprewrite("trace", tf, "--format", "graph").stdout
    assert "} /* x: return with no entry in the trace */" in out
    assert "    g(); /* no return in the trace */" in out
    assert "|     /* mid: (f+0x8/0x10) v=3 */\n" in out
    assert re.search(r"\n +0\.300 us \|   \} /\* f \*/\n", out), out
    assert ("|     f(); /* no return in the trace */\n"
                        "               |   } /* h: no return in the trace */\n"
            "               | } /* main: no return in the trace */\n\n# thread 8 (prog)\n") in out, out

    doc = json.loads(kprewrite("trace", tf, "--format", "chrome").stdout)
    xs = check_nested(doc)
    by = {(e["tid"], e["name"], e["ts"]): e for e in xs}
    assert by[(7, "main", 1000000.1)]["dur"] == pytest.approx(0.9)
    assert "still running at the end" in by[(7, "main", 1000000.1)]["args"]["unfinished"]
    assert "outer call's return" in by[(7, "g", 1000000.3)]["args"]["unfinished"]
    assert by[(8, "f", 1000000.8)]["dur"] == pytest.approx(0.1) and "unfinished" not in by[(8, "f", 1000000.8)]["args"]
    inst = sorted(e["name"] for e in doc["traceEvents"] if e["ph"] == "i")
    assert inst == ["mid", "r_g_0", "r_h_0", "r_main_0", "r_x_0", "r_y_0"]

    rep = json.loads(kprewrite("report", tf, "--format", "json").stdout)["calls"]
    assert (rep["count"], rep["unfinished"], rep["unmatched_returns"]) == (6, 4, 5)
    rows = {r["function"]: r for r in rep["functions"]}
    assert rows["f"]["calls"] == 3 and rows["f"]["unfinished"] == 1 and rows["f"]["max_ns"] == 300
    assert [s["function"] for s in rep["slowest"]] == ["f", "f"]      # only calls that returned
    text = kprewrite("report", tf).stdout
    assert "(entry and return events paired; 4 with no return, 5 returns with no entry)" in text


def test_kernel_trace_microseconds(tmp_path):
    """A kernel's tracing/trace has six digits: durations are whole microseconds."""
    tf = tmp_path / "k.txt"
    tf.write_text("          cat-90      [000] ...1.     6.000010: p_f_0: (vfs_read+0x0/0x170)\n"
                  "          cat-90      [000] ...1.     6.000013: p_g_0: (rw_verify_area+0x4/0x90)\n"
                  "          cat-90      [000] ...1.     6.000015: r_g_0: (vfs_read+0x4f/0x170 <- rw_verify_area)\n"
                  "          cat-90      [000] ...1.     6.000042: r_f_0: (ksys_read+0x6a/0xe0 <- vfs_read)\n")
    g = callgraph.build(tracefmt.read(str(tf)))
    assert shape(g.threads[90].items) == [("vfs_read", [("rw_verify_area", [])])]
    assert [c.duration for c in g.calls()] == [32000, 2000]
    out = kprewrite("trace", tf, "--format", "graph").stdout
    assert "    2.000 us |   rw_verify_area();" in out and "+   32.000 us | } /* vfs_read */" in out


def test_function_graph_spec(tmp_path):
    """[[function_graph]] is a kprobe and a kretprobe with an argument-less trace line each."""
    s = load_spec(write_spec(tmp_path, SPEC))
    assert [(k.symbol_name, k.fetch, k.is_glob) for k in s.kprobes] == [("cg_*", "", True), ("main", "", False)]
    assert [(k.symbol_name, k.fetch, k.is_glob, k.maxactive) for k in s.kretprobes] == [
        ("cg_*", "", True, 64), ("main", "", False, 64)]
    s = load_spec(write_spec(tmp_path, '[[function_graph]]\nsymbol_name = "f"\nmaxactive = 5\n', name="m.toml"))
    assert (s.kretprobes[0].maxactive, s.kprobes[0].symbol_name) == (5, "f")
    r = kprewrite("check", "/bin/true", "--spec",
                  write_spec(tmp_path, '[[function_graph]]\nsymbol_name = "*"\nhandler = "h"\n', name="bad.toml"),
                  check=False)
    assert r.returncode == 1 and r.stderr == "kprewrite: bad.toml: [[function_graph]] #1: unknown key 'handler'\n"
    r = kprewrite("check", "/bin/true", "--spec",
                  write_spec(tmp_path, '[[function_graph]]\nsymbol_name = "nomatch"\n', name="none.toml"), check=False)
    assert r.returncode == 1 and r.stderr == "kprewrite: none.toml: [[function_graph]] #1: symbol 'nomatch' not found " \
        "in true\n", r.stderr     # once, not once for the kprobe and once for the kretprobe


def test_many_calls_and_a_fork(tmp_path, runner, fmt):
    """Thousands of calls to a file (text lines, or binary records in the thread's chunks
    of a file mapped shared), then a forked child that makes its own: every call once,
    none twice (the child never writes the lines it inherited, nor into its parent's
    chunk), each process's calls on its own thread."""
    prog = cc(tmp_path, "fork", FORK_PROG, *FLAGS)
    out = instrument(prog, write_spec(tmp_path, '[[function_graph]]\nsymbol_name = "fk_*"\n'))
    n = 4000
    tf = tmp_path / "trace.txt"
    r = run(out, n, runner=runner, env=trace_env(tf, fmt))
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{sum((i & 7) + ((i + 1) & 7) for i in range(n + 1))} 0\n"
    lines = trace_text(tf, fmt).splitlines()
    # The exact count also catches a line written twice (a child writing its parent's gathered
    # lines); lines themselves may repeat: under QEMU two calls can share a (clamped) time stamp.
    assert len(lines) == 2 * 3 * (n + 1 + 10)
    g = callgraph.build(tracefmt.read(str(tf)))
    per = {tid: [shape([c]) for c in t.items] for tid, t in g.threads.items()}
    assert sorted(len(v) for v in per.values()) == [10, n + 1]
    mid = [("fk_mid", [("fk_leaf", []), ("fk_leaf", [])])]
    assert all(v == [mid] * len(v) for v in per.values())
    assert all(c.duration >= 0 for c in g.calls())
    # Time stamps of a thread never go backwards.
    for tid in per:
        ts = [tracefmt.parse_line(l).ts_ns for l in lines if f"-{tid} " in l]
        assert ts == sorted(ts)


# --- binary records (KPREWRITE_TRACE_FORMAT=binary) --------------------------------------------------

ARGS_PROG = r"""
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <unistd.h>
volatile long sink;
unsigned char big[256];
__attribute__((noinline)) long bv(long x, const char *s, void *fn, const unsigned char *b)
{
    sink = x + s[0] + (long)fn + b[0];
    return x * 3 - 7;
}
__attribute__((noinline)) long bw(long x) { sink = x; return x + 1; }
int main(int argc, char **argv)
{
    long n = atol(argv[1]), s = 0;
    for (int i = 0; i < 256; i++)
        big[i] = (unsigned char)(i * 7);
    static const char *words[] = { "plain", "tab\there \"quoted\" back\\slash\n", "", "\x01\x7f\xc3\xa9" };
    for (long i = 0; i < n; i++)
        s += bv(i - 2, words[i % 4], (void *)main, big) + bw(i);
    printf("%ld\n", s);
    fflush(stdout);
    if (argc > 2 && argv[2][0] == 'k')
        kill(getpid(), SIGKILL);        /* no exit: nothing the runtime gathered would be written */
    if (argc > 2 && argv[2][0] == 'h') {
        puts("ready");
        fflush(stdout);
        pause();                        /* hangs until killed */
    }
    return 0;
}
"""
# Every print type and record item: signed, unsigned, hex, char, strings (escapes, empty),
# arrays, a fault, symbol and symstr, $comm, $retval; and a line longer than the
# runtime's line buffer (KP_TRACE_LINE), which ends in "...".
ARGS_SPEC = """
events = [
  "p:bv_in bv x=%di:s64 u=%di:u8 h=%di:x16 s=+0(%si):string c=+0(%si):char a=+0(%si):u8[3] bad=+8(%di):u64 f=%dx:symbol fs=%dx:symstr cm=$comm",
  "r:bv_out bv r=$retval:s32 rx=$retval:x64",
  "p:bv_long bv b1=+0(%cx):x16[64] b2=+128(%cx):x16[64] b3=+0(%cx):x16[64] b4=+128(%cx):x16[64] b5=+0(%cx):x16[64] b6=+128(%cx):x16[64] b7=+0(%cx):x16[64]",
]

[[function_graph]]
symbol_name = "bw"
"""


@pytest.fixture(scope="module")
def args_prog(tmp_path_factory):
    from test_events import regs
    tmp = tmp_path_factory.mktemp("binargs")
    prog = cc(tmp, "prog", ARGS_PROG, *FLAGS)
    return instrument(prog, write_spec(tmp, regs(ARGS_SPEC)))


def _untimed(line: str) -> str:
    """A trace line without what differs between two runs: the thread id, CPU and time."""
    return re.sub(r"^(\s*\S+)-\d+\s+\[\d+\]\s+\d+\.\d+: ", r"\1: ", line)


def test_binary_same_lines_as_text(args_prog, runner, tmp_path):
    """The same program traced both ways gives the same lines apart from thread ids, CPUs
    and times, and the same JSON lines, call graph and report."""
    n = 6
    got = {}
    for fmt in FORMATS:
        tf = tmp_path / f"trace.{fmt}"
        r = run(args_prog, n, runner=runner, env=trace_env(tf, fmt))
        assert r.returncode == 0 and r.stderr == "", r.stderr
        got[fmt] = trace_text(tf, fmt).splitlines()
    text, binary = got["text"], got["binary"]
    assert len(text) == n * 5 and [_untimed(l) for l in binary] == [_untimed(l) for l in text]
    recs = trace_lines_of(text)
    first = next(r for r in recs if r.event == "bv_in")
    assert first.args["x"] == -2 and first.args["u"] == 254 and first.args["h"] == "0xfffe"
    assert first.args["bad"] == "(fault)" and re.fullmatch(r"main\+0x0/0x[0-9a-f]+", first.args["f"])
    assert any(r.event == "bv_out" and r.args["r"] == -13 for r in recs)
    longs = [l for l in text if "bv_long" in l]
    assert longs and all(l.endswith("...") for l in longs)
    assert any('s="tab\\there \\"quoted\\" back\\\\slash\\n"' in l for l in binary)
    jl = {}
    for fmt in FORMATS:
        rows = [json.loads(l) for l in kprewrite("trace", tmp_path / f"trace.{fmt}").stdout.splitlines()]
        jl[fmt] = [{k: v for k, v in d.items() if k not in ("ts", "ts_us", "ts_ns", "pid", "cpu")} for d in rows]
    assert jl["binary"] == jl["text"]
    graphs = [re.sub(r"^ [ +!#*@$] +\d+\.\d{3} (us|ms|  s)", " DUR", kprewrite("trace", tmp_path / f"trace.{fmt}",
              "--format", "graph").stdout, flags=re.M) for fmt in FORMATS]
    assert re.sub(r"# thread \d+", "", graphs[0]) == re.sub(r"# thread \d+", "", graphs[1])
    reps = [json.loads(kprewrite("report", tmp_path / f"trace.{fmt}", "--format", "json").stdout) for fmt in FORMATS]
    assert [(e["event"], e["count"]) for e in reps[0]["events"]] == [(e["event"], e["count"]) for e in reps[1]["events"]]
    # bv's two entry events (bv_in, bv_long) each open a call its one return closes
    assert {f["function"]: f["calls"] for f in reps[0]["calls"]["functions"]} == \
        {f["function"]: f["calls"] for f in reps[1]["calls"]["functions"]} == {"bv": 2 * n, "bw": n}


def trace_lines_of(lines: list[str]) -> list[tracefmt.Record]:
    return [r for r in map(tracefmt.parse_line, lines) if r is not None]


def test_binary_survives_a_kill_and_a_hang(args_prog, runner, tmp_path):
    """Records are in the file as soon as they are stored: a process killed with SIGKILL
    (no exit, no flush) keeps every one, and a hung process's trace is read while it hangs."""
    import signal
    import subprocess
    from conftest import qemu_command
    n = 50
    tf = tmp_path / "killed.bin"
    r = run(args_prog, n, "k", runner=runner, env=trace_env(tf, "binary"))
    assert r.returncode == -signal.SIGKILL
    assert len(trace_text(tf, "binary").splitlines()) == n * 5
    tf = tmp_path / "hung.bin"
    cmd = [str(args_prog), str(n), "h"]
    if runner == "qemu":
        cmd = [*qemu_command(), *cmd]
    import os
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **trace_env(tf, "binary")})
    try:
        assert p.stdout.readline() and p.stdout.readline() == "ready\n"
        lines = trace_text(tf, "binary").splitlines()
        assert len(lines) == n * 5
        rep = json.loads(kprewrite("report", tf, "--format", "json").stdout)["calls"]
        assert rep["count"] == 3 * n         # bw's calls, and bv's two entries a call
    finally:
        p.kill()
        p.wait()


def test_binary_file_shared_and_refused(args_prog, runner, tmp_path):
    """Runs that trace into one binary file add to it (each process its own image and
    chunks, as text lines are appended); a file that is not a binary trace, or no file,
    is refused with one line and the lines go to standard error; a damaged file is an error."""
    tf = tmp_path / "t.bin"
    for i in range(2):
        r = run(args_prog, 3, runner=runner, env=trace_env(tf, "binary"))
        assert r.returncode == 0 and r.stderr == ""
    recs = tracefmt.read(str(tf))
    assert len(recs) == 2 * 3 * 5 and len({r.pid for r in recs}) == 2
    txt = tmp_path / "t.txt"
    txt.write_text("some text\n")
    r = run(args_prog, 1, runner=runner, env=trace_env(txt, "binary"))
    assert r.returncode == 0 and txt.read_text() == "some text\n"
    assert r.stderr.splitlines()[0] == ("kprewrite: KPREWRITE_TRACE: the file is not a binary trace "
                                        "(KPREWRITE_TRACE_FORMAT=binary); tracing to standard error")
    assert len(trace_lines_of(r.stderr.splitlines())) == 5
    zeros = tmp_path / "zeros.img"     # not empty, no header: another file (a disk image, say), untouched
    zeros.write_bytes(bytes(100))
    r = run(args_prog, 1, runner=runner, env=trace_env(zeros, "binary"))
    assert r.returncode == 0 and zeros.read_bytes() == bytes(100)
    assert r.stderr.splitlines()[0] == ("kprewrite: KPREWRITE_TRACE: the file is not a binary trace "
                                        "(KPREWRITE_TRACE_FORMAT=binary); tracing to standard error")
    r = run(args_prog, 1, runner=runner, env={"KPREWRITE_TRACE_FORMAT": "binary"})
    assert r.stderr.splitlines()[0] == "kprewrite: KPREWRITE_TRACE_FORMAT=binary needs KPREWRITE_TRACE=FILE; text lines"
    assert len(trace_lines_of(r.stderr.splitlines())) == 5
    r = run(args_prog, 1, runner=runner, env={"KPREWRITE_TRACE_FORMAT": "bin"})
    assert r.stderr.splitlines()[0] == "kprewrite: KPREWRITE_TRACE_FORMAT: not text or binary; text lines"
    bad = tmp_path / "bad.bin"
    data = bytearray(tf.read_bytes())
    data[8:12] = (7).to_bytes(4, "little")
    bad.write_bytes(bytes(data))
    r = kprewrite("trace", bad, check=False)
    assert r.returncode == 1 and r.stdout == "" and \
        r.stderr == f"kprewrite: {bad}: binary trace version 7; this kprewrite reads version 1\n"
    # Cut short or damaged: one line naming the file and what is wrong (where), no traceback.
    good = tf.read_bytes()
    bad.write_bytes(good[:-8])
    r = kprewrite("report", bad, check=False)
    assert r.returncode == 1 and r.stdout == "" and r.stderr == (
        f"kprewrite: {bad}: a binary trace truncated ({len(good) - 8} bytes: not a whole number of 65536-byte "
        "chunks of at least one 4194304-byte window)\n")
    import struct
    chunk = 1 << 16
    rec = next(i * chunk + 16 for i in range(1, len(good) // chunk)
               if struct.unpack_from("<I", good, i * chunk)[0] == 2)      # a thread's records chunk
    assert good[rec:rec + 2] == b"\xff\xff"        # its context record first, then a record
    for at, value, what in [(rec + 40, 0xfffe, "a record of event 65534, of 5 in its image"),
                            (rec, 1, "a record before its chunk's context record")]:
        data = bytearray(good)
        data[at:at + 2] = value.to_bytes(2, "little")
        bad.write_bytes(bytes(data))
        r = kprewrite("trace", bad, check=False)
        assert r.returncode == 1 and r.stdout == "" and \
            r.stderr == f"kprewrite: {bad}: damaged binary trace: {what} at offset {at:#x}\n"
    data = bytearray(good)
    desc = next(i * chunk for i in range(1, len(good) // chunk) if struct.unpack_from("<I", good, i * chunk)[0] == 1)
    data[desc + 8:desc + 16] = (struct.unpack_from("<Q", good, desc + 8)[0] - 1).to_bytes(8, "little")
    bad.write_bytes(bytes(data))
    r = kprewrite("trace", bad, check=False)
    assert r.returncode == 1 and r.stdout == "" and \
        r.stderr == f"kprewrite: {bad}: damaged binary trace: the image descriptor at offset {desc:#x} does not parse\n"


@pytest.mark.slow
def test_binary_grows_past_a_window(args_prog, runner, tmp_path):
    """Records past the first 4 MiB window of the file (and many 64 KiB chunks of one
    thread): the file grows, the next window is mapped, and no record is lost or reordered.
    (Slow: reading 15,000 lines of 2 KB; test_many_calls_and_a_fork fills several chunks.)"""
    n = 3000                    # a call's records: some 1.5 KB (bv_long's arrays)
    tf = tmp_path / "big.bin"
    r = run(args_prog, n, runner=runner, env=trace_env(tf, "binary"))
    assert r.returncode == 0 and r.stderr == ""
    assert tf.stat().st_size >= 2 * (4 << 20)
    recs = tracefmt.read(str(tf))
    assert len(recs) == 5 * n
    assert [r.args["x"] for r in recs if r.event == "bv_in"] == [i - 2 for i in range(n)]
    assert all(r.line.endswith("...") for r in recs if r.event == "bv_long")


@pytest.mark.slow
def test_binary_file_that_cannot_grow(args_prog, tmp_path):
    """A file that cannot grow past its first window (RLIMIT_FSIZE, as a full file system):
    the program runs on, the records of the first window are read whole, the later ones are
    lost (the process stops claiming chunks).  (Slow: some 13,000 lines of 2 KB.)"""
    import os
    import resource
    import signal
    import subprocess

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # fallocate past the limit: EFBIG, not a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
    n = 3000
    tf = tmp_path / "small.bin"
    r = subprocess.run([str(args_prog), str(n)], capture_output=True, text=True, preexec_fn=limit,
                       env={**os.environ, **trace_env(tf, "binary")})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert tf.stat().st_size == 4 << 20
    recs = tracefmt.read(str(tf))
    xs = [r.args["x"] for r in recs if r.event == "bv_in"]
    assert 100 < len(xs) < n and xs == [i - 2 for i in range(len(xs))]
