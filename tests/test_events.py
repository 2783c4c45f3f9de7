"""kprobe_events lines end to end: probes from `events` only, aggregation with
[[kprobe]] tables, the trace file, kprobe_profile, many threads tracing at
once, and the timeline export (`kprewrite trace`), natively and under QEMU;
and cross-built for aarch64, under qemu-aarch64 (KPREWRITE_TEST_ARCH=aarch64),
the tests not marked x86_only, with the kernel's arm64 register names (regs())."""
from __future__ import annotations

import json
import os
import shutil
import re
import subprocess

import pytest

from conftest import (ALL_ARCHES, ARCH, CROSS, FACTS, CC, KPREWRITE, ROOT, TREE_ENV, cc, instrument, kprewrite, profile, qemu_command, rewritten,
                      run, symbols, write_spec)
from rewriter.trace import formats as tracefmt

ARCHES = ALL_ARCHES
x86_only = pytest.mark.skipif(ARCH != "x86_64", reason="depends on x86-64 code or registers")

# The first argument registers in the kernel's names of the arch (x86-64 pt_regs' di si dx
# cx; arm64's x0..x3), and a function entry's return address (tests/arches/<arch>.py).
ARG_REGS = dict(zip(["%di", "%si", "%dx", "%cx"], FACTS.ARG_REGS))
RETADDR = FACTS.RETADDR


def regs(text: str) -> str:
    """`text` (written with x86-64's register names) with the names of ARCH."""
    return re.sub(r"%(di|si|dx|cx)\b", lambda m: ARG_REGS[m.group()], text)

PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/prctl.h>
__attribute__((noinline)) long work(long x, const char *s) { __asm__ volatile("" ::: "memory"); return x * 3 + (long)strlen(s); }
__attribute__((noinline)) long fact(long n)
{
    long r = n <= 1 ? 1 : n * fact(n - 1);
    __asm__ volatile("" : "+r"(r));      /* keeps the recursion a real one */
    return r;
}
__attribute__((noinline)) long other(long x) { __asm__ volatile("" ::: "memory"); return x ^ 0x55; }
static long iters;
static void *thread(void *arg)
{
    long id = (long)arg, sum = 0;
    char name[16];
    snprintf(name, sizeof(name), "worker%ld", id);
    pthread_setname_np(pthread_self(), name);
    for (long i = 0; i < iters; i++)
        sum += work(id * 1000 + i, "thread \"string\" with spaces");
    return (void *)sum;
}
int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 3, threads = argc > 2 ? atol(argv[2]) : 0, sum = 0;
    iters = n;
    if (threads) {
        pthread_t t[64];
        for (long i = 0; i < threads; i++)
            pthread_create(&t[i], 0, thread, (void *)(i + 1));
        for (long i = 0; i < threads; i++) {
            void *r;
            pthread_join(t[i], &r);
            sum += (long)r;
        }
    } else {
        for (long i = 0; i < n; i++)
            sum += work(i, "hello") + other(i);
        sum += fact(4);
    }
    printf("sum=%ld\n", sum);
    return 0;
}
"""

EVENTS_ONLY = regs("""
events = [
  "p:myprobe work x=%di:s64 s=+0(%si):string",
  "p:grp/fact_entry fact n=%di:s64",
  "p other %di",
]
""")


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("events")
    return cc(tmp, "prog", PROGRAM, "-O2", "-pthread")


def trace_lines(text: str) -> list[tracefmt.Record]:
    return [r for r in map(tracefmt.parse_line, text.splitlines()) if r is not None]


def _events_only(tmp, prog):
    """prog rewritten with EVENTS_ONLY, and what `check` says of that spec."""
    out = instrument(prog, write_spec(tmp, EVENTS_ONLY), tmp / "prog.kp")
    return kprewrite("check", prog, "--spec", tmp / "probes.toml").stdout.split("\n"), out


def test_events_only(once, prog, runner):
    check, out = once(_events_only, prog)
    assert check[:3] == ["work+0x0  k  optimized", "fact+0x0  k  optimized", "other+0x0  k  optimized"]
    r = run(out, 3, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == f"sum={sum(i * 3 + 5 + (i ^ 0x55) for i in range(3)) + 24}\n"
    recs = trace_lines(r.stderr)
    assert [x.event for x in recs] == ["myprobe", "p_other_0"] * 3 + ["fact_entry"] * 4
    assert [x.args for x in recs if x.event == "myprobe"] == [{"x": i, "s": "hello"} for i in range(3)]
    assert [x.args["arg1"] for x in recs if x.event == "p_other_0"] == ["0x0", "0x1", "0x2"]
    assert [x.args["n"] for x in recs if x.event == "fact_entry"] == [4, 3, 2, 1]
    assert all(x.loc.startswith("work+0x") for x in recs if x.event == "myprobe")
    # kprobe_profile: the event names, hits and misses.
    prof = profile(r.stderr)
    assert prof["myprobe"] == (3, 0) and prof["fact_entry"] == (4, 0) and prof["p_other_0"] == (3, 0)
    # Disarmed: no trace lines, no hits.
    r = run(out, 3, runner=runner, env={"KPREWRITE_ENABLED": "0", "KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and trace_lines(r.stderr) == [] and profile(r.stderr)["myprobe"] == (0, 0)


def test_trace_file_env(tmp_path, once, prog, runner):
    _, out = once(_events_only, prog)
    tf = tmp_path / "trace.txt"
    r = run(out, 2, runner=runner, env={"KPREWRITE_TRACE": str(tf)})
    assert r.returncode == 0 and r.stderr == ""
    recs = trace_lines(tf.read_text())
    assert len(recs) == 2 * 2 + 4
    assert all(line.endswith("\n") for line in tf.read_text().splitlines(keepends=True))
    # A second run appends (a forked or exec'd child keeps the lines of its parent).
    run(out, 1, runner=runner, env={"KPREWRITE_TRACE": str(tf)})
    assert len(trace_lines(tf.read_text())) == 8 + 2 + 4
    # A file that cannot be opened: one line says so, the trace goes to standard error.
    r = run(out, 1, runner=runner, env={"KPREWRITE_TRACE": str(tmp_path / "no" / "such" / "dir")})
    assert r.returncode == 0
    assert r.stderr.splitlines()[0] == "kprewrite: KPREWRITE_TRACE: cannot open the file; tracing to standard error"
    assert len(trace_lines(r.stderr)) == 2 + 4


def _aggregates(tmp, prog):
    handlers = r"""
#include <kprewrite/kprobes.h>
int on_work(struct kprobe *p, struct pt_regs *regs)
{
    pr_info("handler %s x=%ld\n", p->name, (long)regs_get_kernel_argument(regs, 0));
    return 0;
}
"""
    spec = write_spec(tmp, regs("""
handlers = ["handlers.c"]
events = ["p:ev_work work x=%di:s64"]
[[kprobe]]
symbol_name = "work"
pre_handler = "on_work"
"""), handlers)
    out = instrument(prog, spec, tmp / "prog.kp")
    return out, kprewrite("list", out).stdout.splitlines()


def test_aggregates_with_kprobe_table(once, prog, runner):
    """An events line and a [[kprobe]] table on one address: one site, both probes run."""
    out, lst = once(_aggregates, prog)
    assert len(lst) == 2 and all("work+0x0" in l and "[OPTIMIZED]" in l for l in lst)
    r = run(out, 2, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0
    assert [x.args["x"] for x in trace_lines(r.stderr)] == [0, 1]
    assert "handler p_work_0 x=1" in r.stderr
    prof = profile(r.stderr)
    assert prof["ev_work"] == (2, 0) and prof["p_work_0"] == (2, 0)


@pytest.mark.parametrize("fmt", ["text", "binary"])
def test_many_threads(tmp_path, once, prog, runner, fmt):
    """Many threads tracing at once: every line well formed, none lost, none mixed (binary
    records: each thread's in chunks of its own, claimed at once)."""
    out = once(rewritten, prog, regs('events = ["p:w work x=%di:s64 s=+0(%si):string c=$comm"]\n'))
    tf = tmp_path / "trace.txt"
    nthreads, iters = 8, 150
    env = {"KPREWRITE_TRACE": str(tf), "KPREWRITE_PROFILE": "-"}
    if fmt == "binary":
        env["KPREWRITE_TRACE_FORMAT"] = "binary"
    r = run(out, iters, nthreads, runner=runner, env=env)
    assert r.returncode == 0, r.stderr
    text = tf.read_text() if fmt == "text" else kprewrite("trace", tf, "--format", "text").stdout
    lines = text.splitlines()
    assert len(lines) == nthreads * iters
    seen: dict[int, list[int]] = {}
    tids: dict[int, int] = {}
    for line in lines:
        rec = tracefmt.parse_line(line)
        assert rec is not None, line
        assert rec.event == "w" and rec.loc.startswith("work+0x")
        x = rec.args["x"]
        tid = x // 1000
        assert rec.args["s"] == 'thread "string" with spaces', line
        assert rec.args["c"] == rec.comm == f"worker{tid}", line
        assert tids.setdefault(tid, rec.pid) == rec.pid
        seen.setdefault(tid, []).append(x % 1000)
    assert sorted(seen) == list(range(1, nthreads + 1))
    assert all(v == list(range(iters)) for v in seen.values())       # per thread, in order
    assert len(set(tids.values())) == nthreads
    assert profile(r.stderr)["w"] == (nthreads * iters, 0)
    # The timeline of a real multi-threaded run: one track per thread, named by its comm.
    doc = json.loads(kprewrite("trace", tf, "--format", "chrome").stdout)
    check_chrome(doc)
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(names.values()) == sorted(f"worker{i}" for i in range(1, nthreads + 1))
    assert len([e for e in doc["traceEvents"] if e["ph"] == "i"]) == nthreads * iters


# --- the timeline export ------------------------------------------------------------------------

PH = {"X", "B", "E", "i", "I", "M", "C"}


def check_chrome(doc: dict) -> None:
    """The Chrome trace-event format's rules (JSON Object Format)."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    slices: dict[tuple, list] = {}
    for e in doc["traceEvents"]:
        assert isinstance(e["name"], str) and e["ph"] in PH, e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name") and isinstance(e["args"]["name"], str)
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        assert isinstance(e.get("args", {}), dict)
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
            slices.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
        if e["ph"] in ("i", "I"):
            assert e.get("s", "t") in ("g", "p", "t")
    # Slices of one thread nest: none overlaps another partially.
    for spans in slices.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack = []
        for a, b in spans:
            while stack and stack[-1] <= a:
                stack.pop()
            assert not stack or b <= stack[-1], spans
            stack.append(b)


def test_timeline_export(tmp_path, once, prog, runner):
    _, out = once(_events_only, prog)
    tf = tmp_path / "trace.txt"
    r = run(out, 3, runner=runner, env={"KPREWRITE_TRACE": str(tf)})
    assert r.returncode == 0
    jl = kprewrite("trace", tf).stdout.splitlines()
    objs = [json.loads(l) for l in jl]
    assert [o["event"] for o in objs][:2] == ["myprobe", "p_other_0"]
    assert objs[0]["args"] == {"x": 0, "s": "hello"} and objs[0]["kind"] == "probe" and objs[0]["func"] == "work"
    kprewrite("trace", tf, "--format", "chrome", "-o", tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    check_chrome(doc)
    inst = [e for e in doc["traceEvents"] if e["ph"] == "i"]
    assert len(inst) == 3 * 2 + 4 and {e["name"] for e in inst} == {"myprobe", "p_other_0", "fact_entry"}
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert len(names) == 1
    # Same input, same output.
    assert kprewrite("trace", tf, "--format", "chrome").stdout == (tmp_path / "t.json").read_text()


def test_timeline_pairs_entry_and_return():
    """Pairing on the kernel's own line format: nested calls, two threads."""
    text = """\
            prog-100     [000]    10.000000: work_entry: (work+0x0/0x20) x=1
            prog-100     [000]    10.000010: work_entry: (work+0x0/0x20) x=2
            prog-101     [001]    10.000011: work_entry: (work+0x0/0x20) x=9
            prog-100     [000]    10.000020: work_exit: (work+0x14/0x20 <- work) arg1=0x2
            prog-100     [000]    10.000030: mid: (work+0x8/0x20)
            prog-100     [000]    10.000040: work_exit: (main+0x30/0x80 <- work) arg1=0x1
            prog-101     [001]    10.000050: work_exit: (main+0x30/0x80 <- work) arg1=0x9
            prog-100     [000]    10.000060: work_exit: (main+0x30/0x80 <- work) arg1=0x7
not a trace line: the program's own output
"""
    recs = [r for r in map(tracefmt.parse_line, text.splitlines()) if r]
    assert len(recs) == 8
    doc = tracefmt.chrome(recs)
    check_chrome(doc)
    xs = [(e["tid"], e["ts"], e["dur"], e["args"]["entry.x"]) for e in doc["traceEvents"] if e["ph"] == "X"]
    assert sorted(xs) == [(100, 10000000, 40, 1), (100, 10000010, 10, 2), (101, 10000011, 39, 9)]
    inst = [e["name"] for e in doc["traceEvents"] if e["ph"] == "i"]
    assert sorted(inst) == ["mid", "work_exit"]       # a return with no entry left stays an instant


# --- return probes ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kretprobes(prog, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kret")
    r = kprewrite("check", prog, "--spec", write_spec(tmp, 'events = ["r:ret work $retval"]\n'), check=False)
    assert r.returncode == 0 and "  r  " in r.stdout, r.stderr
    return True


def test_retval(tmp_path, once, prog, runner, kretprobes):
    out = once(rewritten, prog, regs("""events = [
  "p:work_entry work x=%di:s64",
  "r:work_exit work ret=$retval:s64",
  "r5:grp/ work",
  "p:fact_entry fact n=%di:s64",
  "r:fact_exit fact $retval:u64",
]"""))
    tf = tmp_path / "trace.txt"
    r = run(out, 3, runner=runner, env={"KPREWRITE_TRACE": str(tf), "KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    recs = trace_lines(tf.read_text())
    exits = [x for x in recs if x.event == "work_exit"]
    assert [x.args["ret"] for x in exits] == [i * 3 + 5 for i in range(3)]
    assert all(re.fullmatch(r"main\+0x[0-9a-f]+/0x[0-9a-f]+ <- work", x.loc) for x in exits)
    assert [x.args["arg1"] for x in recs if x.event == "fact_exit"] == [1, 2, 6, 24]
    assert len([x for x in recs if x.event == "r_work_0"]) == 3
    assert profile(r.stderr)["work_exit"] == (3, 0)
    kprewrite("trace", tf, "--format", "chrome", "-o", tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    check_chrome(doc)
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in xs) == ["fact"] * 4 + ["work"] * 3
    facts = sorted((e["ts"], e["dur"], e["args"]["entry.n"]) for e in xs if e["name"] == "fact")
    assert [f[2] for f in facts] == [4, 3, 2, 1]                     # nested: outermost first


def test_return_event_code_compiles(tmp_path, prog):
    """The kretprobe side of the generated C (the integration point for kretprobes):
    an `r` line's handler compiles against the runtime and calls kp_trace_kretprobe()."""
    from rewriter.probes import events as E
    from rewriter import link
    from rewriter.arch import get_arch
    from rewriter.elf.image import Image
    from rewriter.probes.spec import Spec
    image = Image(str(prog))
    spec = Spec(path=tmp_path / "probes.toml", handlers=[], optimize=True,
                events=[regs("r:work_exit work ret=$retval:s64 s=+0(%si):string"), "p:bad work $retval"])
    errors = E.expand(spec, get_arch(image.machine))
    assert errors[0].startswith("probes.toml: events[2]: column 12: $retval is not available on probe")
    k = spec.kretprobes[0]
    ev, err = E.compile_return(image, k, image.function_named("work"), "probes.toml")
    assert not err and ev.is_return and ev.where == "work" and ev.name == "work_exit"
    src = E.trace_c({"r0": ev}, {"r0": "kp_handler_user"}, [(0x1000, 0x20, "work")])
    assert "int kp_trace_ret_r0(struct kretprobe_instance *ri, struct pt_regs *regs)" in src
    (tmp_path / "t.c").write_text("extern char kp_handler_user[];\n" + src)
    r = subprocess.run([CC, *link.cflags(ARCH), *link._includes(ARCH),
                        "-c", str(tmp_path / "t.c"), "-o", str(tmp_path / "t.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


SAMPLE = ROOT / "samples" / "events_example"


def _sample(tmp):
    prog = tmp / "program"
    subprocess.run(["gcc", "-O2", "-o", str(prog), str(SAMPLE / "program.c")], check=True)
    return instrument(prog, SAMPLE / "probes.toml", tmp / "program.kp")


@x86_only                       # the sample's lines name x86-64 registers
def test_sample_events_example(once, runner):
    """samples/events_example runs as its README shows."""
    d = SAMPLE
    out = once(_sample)
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout.splitlines()[-2:] == ["fd 0: /etc/hostname", "fd 1: /tmp/out.txt"]
    recs = trace_lines(r.stderr)
    assert [x.event for x in recs] == ["myprobe", "install", "p_fd_install_0", "myprobe", "myprobe",
                                       "install", "p_fd_install_0"]
    assert recs[1].args["path"] == "/etc/hostname" and recs[1].args["flags"] == "0x81a4"
    assert recs[3].args == {"dfd": -100, "filename": "/missing/file", "flags": "0x8001", "mode": "0x1a4"}
    if runner != "native":
        return                                  # COMM reads qemu-x86_64 there
    readme = (d / "README.md").read_text()
    for line in r.stderr.splitlines():          # the README shows this very output (times and pids aside)
        shown = re.sub(r"-\d+ +\[\d+\] +\d+\.\d+:", "", line).strip()
        assert any(shown == re.sub(r"-\d+ +\[\d+\] +\d+\.\d+:", "", l).strip() for l in readme.splitlines()), line


KIND_PROG = r"""
#include <stdio.h>
long counter = 40;
__attribute__((noinline)) long other(long x) { return x ^ 0x55; }
long (*fnptr)(long) = other;
__attribute__((noinline)) long work(long x, const char *s) { __asm__ volatile("" ::: "memory"); counter++; return x + s[0]; }
int main(void) { long s = 0; for (int i = 0; i < 2; i++) s += work(i, "kind") + fnptr(i); printf("s=%ld\n", s); return 0; }
"""
KIND_SPEC = regs(f'events = ["p:w work x=%di:s64 s=+0(%si):string c=@counter:s64 f=@fnptr:symbol r={RETADDR}:symbol"]\n')


def _input_kind(tmp, kind):
    prog = cc(tmp, "prog", KIND_PROG, "-O2", *kind)
    return instrument(prog, write_spec(tmp, KIND_SPEC))


@pytest.mark.parametrize("kind", [["-fPIE", "-pie"], ["-fno-pie", "-no-pie"], ["-static"], ["-static-pie", "-fPIE"]],
                         ids=["pie", "nopie", "static", "static-pie"])
def test_input_kinds(once, kind, runner):
    """@SYM, symbol and the (SYM+off/size) of return addresses hold at any load address."""
    out = once(_input_kind, tuple(kind))
    r = run(out, runner=runner)
    assert r.returncode == 0, r.stderr
    recs = trace_lines(r.stderr)
    assert [(x.args["x"], x.args["s"], x.args["c"]) for x in recs] == [(0, "kind", 40), (1, "kind", 41)]
    assert all(re.fullmatch(r"other\+0x0/0x[0-9a-f]+", x.args["f"]) for x in recs)
    assert all(re.fullmatch(r"main\+0x[0-9a-f]+/0x[0-9a-f]+", x.args["r"]) for x in recs)


def _shared_object(tmp):
    lib = cc(tmp, "libw.so", r"""
long lib_count = 7;
__attribute__((noinline)) long lib_work(long x, const char *tag) { __asm__ volatile("" ::: "memory"); return x + 100 + tag[0]; }
long lib_api(long x) { lib_count++; return lib_work(x, "lib") * 2; }
""", "-O2", "-shared", "-fPIC")
    prog = cc(tmp, "main", r"""
#include <stdio.h>
long lib_api(long);
int main(void) { long s = 0; for (int i = 0; i < 3; i++) s += lib_api(i); printf("s=%ld\n", s); return 0; }
""", "-O2", f"-L{tmp}", "-lw")
    spec = write_spec(tmp, regs('events = ["p:lw lib_work x=%di:s64 tag=+0(%si):string n=@lib_count:s64 '
                                f'from={RETADDR}:symbol"]\n'))
    outdir = tmp / "out"
    outdir.mkdir()
    instrument(lib, spec, outdir / "libw.so")
    return prog, outdir


def test_shared_object(once, runner):
    prog, outdir = once(_shared_object)
    r = run(prog, runner=runner, libdir=outdir, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0, r.stderr
    recs = trace_lines(r.stderr)
    assert [(x.args["x"], x.args["tag"], x.args["n"]) for x in recs] == [(i, "lib", 8 + i) for i in range(3)]
    assert all(re.fullmatch(r"lib_api\+0x[0-9a-f]+/0x[0-9a-f]+", x.args["from"]) for x in recs)
    assert profile(r.stderr) == {"lw": (3, 0)}


def test_deterministic(tmp_path, prog):
    spec = write_spec(tmp_path, EVENTS_ONLY)
    a = instrument(prog, spec, tmp_path / "a")
    b = instrument(prog, spec, tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()


GLOB_AND_NAMED = regs("""
[[kprobe]]
symbol_name = "work"
fetch = "x=%di:s64"
[[kprobe]]
symbol_name = "w[o]rk"
NAME_LINE
fetch = "y=%di:s64"
""")


def test_one_event_name_for_two_tables_is_refused(tmp_path, prog, runner):
    """A glob's default event name for a function a named table also probes would write two
    formats under one name: refused by check and instrument alike (EVENT_EXIST, both tables
    named), nothing written; with a `name`, two events, each with its own arguments."""
    spec = write_spec(tmp_path, GLOB_AND_NAMED.replace("NAME_LINE", ""))
    out = tmp_path / "prog.kp"
    for cmd in (["check", prog, "--spec", spec], ["instrument", prog, "--spec", spec, "-o", out]):
        r = kprewrite(*cmd, check=False)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines() == [
            "kprewrite: probes.toml: [[kprobe]] #2: event p_work_0 at work+0x0: Given group/event name is "
            "already used by another event ([[kprobe]] #1); give one of the tables a `name`"]
    assert not out.exists()
    out = instrument(prog, write_spec(tmp_path, GLOB_AND_NAMED.replace("NAME_LINE", 'name = "glob_work"')), out)
    r = run(out, 2, runner=runner)
    recs = trace_lines(r.stderr)
    assert [(x.event, x.args) for x in recs] == [("p_work_0", {"x": 0}), ("glob_work", {"y": 0}),
                                                 ("p_work_0", {"x": 1}), ("glob_work", {"y": 1})]


def _profile_on_request(tmp):
    prog = cc(tmp, "prog", r"""
#include <signal.h>
#include <stdio.h>
#include <unistd.h>
__attribute__((noinline)) long work(long x) { __asm__ volatile("" ::: "memory"); return x + 1; }
int main(void)
{
    long s = 0;
    for (int i = 0; i < 3; i++) s += work(i);
    kill(getpid(), SIGUSR2);
    for (int i = 0; i < 2; i++) s += work(i);
    printf("s=%ld\n", s);
    return 0;
}
""", "-O2")
    return instrument(prog, write_spec(tmp, 'events = ["p:w work"]\n'))


def test_profile_on_request(tmp_path, once, runner):
    """KPREWRITE_PROFILE_SIGNAL: the program (here: itself) asks for kprobe_profile mid-run."""
    out = once(_profile_on_request)
    pf = tmp_path / "profile.txt"
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE_SIGNAL": "USR2", "KPREWRITE_PROFILE": str(pf)})
    assert r.returncode == 0 and r.stdout == "s=9\n", r.stderr
    rows = [l.split() for l in pf.read_text().splitlines()]
    assert rows == [["w", "3", "0"], ["w", "5", "0"]]       # on request, then at exit
    r = run(out, runner=runner)                              # without it, SIGUSR2 keeps its default action
    assert r.returncode == -12


RET_HARNESS = r"""
#include <stdio.h>
#include "kp_trace.h"
struct kp_runtime kp_rt;
void kp_profile_signal_configure(const char *v) { (void)v; }
void kp_write_profile(void) { }
void kp_platform_write(int fd, const char *buf, unsigned long len) { fwrite(buf, 1, len, stdout); }
int kp_platform_open_append(const char *path) { (void)path; return 1; }
void kp_platform_close(int fd) { (void)fd; }
int kp_tls_ready;                                        /* no thread pointer: the lines' context */
unsigned long kp_platform_thread_key_slow(void) { return 0; }   /* is read the plain way */
void *kp_platform_alloc(unsigned long size) { (void)size; return 0; }
/* the binary trace file's hooks (KPREWRITE_TRACE_FORMAT=binary): not used here */
int kp_platform_open_rw(const char *path) { (void)path; return -1; }
long kp_platform_file_read(int fd, void *buf, unsigned long len) { (void)fd, (void)buf, (void)len; return 0; }
int kp_platform_file_grow(int fd, unsigned long size) { (void)fd, (void)size; return -1; }
long kp_platform_file_size(int fd) { (void)fd; return -1; }
void *kp_platform_map_shared(int fd, unsigned long off, unsigned long len) { (void)fd, (void)off, (void)len; return 0; }
void kp_platform_unmap(void *p, unsigned long len) { (void)p, (void)len; }
int kp_platform_pwrite(int fd, const void *buf, unsigned long len, unsigned long off) { (void)fd, (void)buf, (void)len, (void)off; return -1; }
void *kp_platform_alloc_wipeonfork(unsigned long size) { (void)size; return 0; }
int kp_trace_ret_r0(struct kretprobe_instance *ri, struct pt_regs *regs);
static const char text[] = "retstring";
int main(void)
{
    static struct kretprobe rp = { .kp = { .addr = (kprobe_opcode_t *)0x2000 } };
    static struct kretprobe_instance ri = { .rp = &rp, .ret_addr = (kprobe_opcode_t *)0x1013 };
    struct pt_regs regs = { 0 };
    regs.REG_RETVAL = (unsigned long)-5;
    regs.REG_ARG2 = (unsigned long)text;
    kp_trace_ret_r0(&ri, &regs);
    ri.ret_addr = (kprobe_opcode_t *)0x9999;
    regs.REG_RETVAL = 7;
    regs.REG_ARG2 = 16;
    kp_trace_ret_r0(&ri, &regs);
    return 0;
}
"""


def test_return_line_format(tmp_path, prog):
    """The runtime's kretprobe line, driven directly (until kretprobes exist):
    (CALLER+off/size <- FUNC) and $retval, as print_kretprobe_event() prints them."""
    from rewriter.probes import events as E
    from rewriter import link
    from rewriter.arch import get_arch
    from rewriter.elf.image import Image
    from rewriter.probes.spec import Spec
    spec = Spec(path=tmp_path / "probes.toml", handlers=[], optimize=True,
                events=[regs("r:work_exit work ret=$retval:s64 s=+0(%si):string x=$retval")])
    image = Image(str(prog))
    assert E.expand(spec, get_arch(image.machine)) == []
    ev, err = E.compile_return(image, spec.kretprobes[0], image.function_named("work"), "probes.toml")
    assert not err
    (tmp_path / "gen.c").write_text(E.trace_c({"r0": ev}, {}, [(0x1000, 0x40, "caller_fn")]))
    (tmp_path / "main.c").write_text(RET_HARNESS)
    rt = link.RUNTIME_DIR
    exe = tmp_path / "harness"
    # pt_regs' return value and second argument registers (the handler API's ptrace.h).
    fields = [f"-DREG_RETVAL={FACTS.PT_RETVAL}", f"-DREG_ARG2={FACTS.PT_ARGS[1]}"]
    r = subprocess.run([CC, "-O1", "-w", *fields, *link._includes(ARCH), str(tmp_path / "main.c"),
                        str(tmp_path / "gen.c"), str(rt / "kp_line.c"), str(rt / "kp_fetch.c"), str(rt / "kp_trace.c"), str(rt / "kp_lib.c"),
                        "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = run(exe, runner="qemu" if CROSS else "native").stdout.splitlines()
    assert len(out) == 2
    a, b = map(tracefmt.parse_line, out)
    assert a.event == "work_exit" and a.loc == "caller_fn+0x13/0x40 <- work" and a.is_return
    assert a.args == {"ret": -5, "s": "retstring", "x": "0xfffffffffffffffb"}
    assert b.loc == "0x9999 <- work" and b.args == {"ret": 7, "s": "(fault)", "x": "0x7"}
    assert re.match(r"^ {0,15}\S+-\d+ +\[\d{3}\] +\d+\.\d{9}: work_exit: \(caller_fn\+0x13/0x40 <- work\) ret=-5 ", out[0])


def _fork(tmp):
    prog = cc(tmp, "prog", r"""
#include <stdio.h>
#include <unistd.h>
#include <sys/wait.h>
__attribute__((noinline)) long work(long x, const char *s) { __asm__ volatile("" ::: "memory"); return x + s[0]; }
int main(void)
{
    long s = 0;
    pid_t pid = fork();
    const char *who = pid ? "parent" : "child";
    for (int i = 0; i < 200; i++)
        s += work(pid ? i : 1000 + i, who);
    if (pid) { int st; waitpid(pid, &st, 0); }
    printf("%s %ld\n", who, s);
    return 0;
}
""", "-O2")
    return instrument(prog, write_spec(tmp, regs('events = ["p:w work x=%di:s64 who=+0(%si):string"]\n')))


def test_fork_and_exec(tmp_path, once, runner):
    """Parent and child both trace (and dereference) at once: every line well formed, values right."""
    out = once(_fork)
    tf = tmp_path / "trace.txt"
    r = run(out, runner=runner, env={"KPREWRITE_TRACE": str(tf)})
    assert r.returncode == 0
    recs = [tracefmt.parse_line(l) for l in tf.read_text().splitlines()]
    assert len(recs) == 400 and all(recs)
    for x in recs:
        assert x.args["who"] == ("child" if x.args["x"] >= 1000 else "parent")
    assert len({x.pid for x in recs}) == 2


def test_memaddr_event(once, prog, runner):
    """p MEMADDR: an address as linked (the symbol table), the kernel's default name p_0xADDR."""
    addr = symbols(prog)["work"]
    out = once(rewritten, prog, regs(f'events = ["p {addr:#x} x=%di:s64"]\n'))
    r = run(out, 2, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    recs = trace_lines(r.stderr)
    assert [(x.event, x.args["x"]) for x in recs] == [(f"p_0x{addr:x}", 0), (f"p_0x{addr:x}", 1)]
    assert profile(r.stderr)[f"p_0x{addr:x}"] == (2, 0)


def test_parse_values():
    line = ('  my prog-12 [003]  5.000001: e: (f+0x0/0x10) s="a,b}{\\"c\\\\" arr={"x,y",(fault),"z"} '
            'n=-3 h=0xff c=\'q\' e="" f=(fault) sym=main+0x1/0x2')
    r = tracefmt.parse_line(line)
    assert (r.comm, r.pid, r.cpu, r.ts_us) == ("my prog", 12, 3, 5000001)
    assert r.args == {"s": 'a,b}{"c\\', "arr": ["x,y", "(fault)", "z"], "n": -3, "h": "0xff", "c": "'q'",
                      "e": "", "f": "(fault)", "sym": "main+0x1/0x2"}
    assert tracefmt.parse_line("random program output") is None


@pytest.mark.skipif(not shutil.which("taskset") or len(os.sched_getaffinity(0)) < 2, reason="needs taskset, 2 CPUs")
def test_cpu_column(once, prog, runner):
    out = once(rewritten, prog, 'events = ["p work"]\n')
    for cpu in sorted(os.sched_getaffinity(0))[:2]:
        cmd = ["taskset", "-c", str(cpu)] + (qemu_command() if runner == "qemu" else []) + [str(out), "2"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0
        assert [x.cpu for x in trace_lines(r.stderr)] == [cpu, cpu]


def test_trace_command_input(tmp_path):
    line = "            prog-7       [000]     1.000002: ev: (f+0x0/0x10) a=1\n"
    r = subprocess.run([*KPREWRITE, "trace", "-"], input="noise\n" + line, capture_output=True, text=True, env=TREE_ENV)
    assert r.returncode == 0 and json.loads(r.stdout)["args"] == {"a": 1}
    r = kprewrite("trace", tmp_path / "missing.txt", check=False)
    assert r.returncode == 1 and r.stderr.startswith("kprewrite: ") and r.stderr.endswith("missing.txt: no such file\n")
    assert "Traceback" not in r.stderr


# A rewritten kernel's /sys/kernel/tracing/trace (verbatim from a boot of Debian's 6.1 kernel,
# tests/kernel/test_kernel_events.py): our events as trace_printk() entries (the probe's symbol
# first), the kernel's own kprobe event and a sched event between them, and a line of ours the
# kernel log got before the ring buffer existed.
KERNEL_TRACE = r"""# tracer: nop
#
# entries-in-buffer/entries-written: 5/5   #P:2
#           TASK-PID     CPU#  |||||  TIMESTAMP  FUNCTION
#              | |         |   |||||     |         |
          opener-90      [000] ...1.     6.536520: do_sys_openat2: kp_open: (do_sys_openat2+0x0/0x170) dfd=-100 file="/kp-events-missing" comm="opener" caller=__x64_sys_openat+0x6a/0xa0
          opener-90      [000] .....     6.536686: kpk: (getname+0x0/0x20) name="/kp-events-missing"
          opener-90      [001] d..2.     6.536690: sched_switch: prev_comm=opener prev_pid=90 prev_prio=120 prev_state=R+ ==> next_comm=swapper/1 next_pid=0 next_prio=120
          opener-90      [000] ...1.     6.548573: do_sys_openat2: kp_open: (do_sys_openat2+0x0/0x170) dfd=-100 file=(fault) comm="opener" caller=__x64_sys_openat+0x6a/0xa0
           <...>-91      [000] ...1.     6.611597: do_sys_openat2: kp_open: (do_sys_openat2+0x0/0x170) dfd=-100 file="/sys/kernel/tracing/trace" comm="cat" caller=__x64_sys_openat+0x6a/0xa0
            init-1     (      1) [001] d..1.  7.000001: p_kill_0: (__x64_sys_kill+0x0/0xb0)
[    0.104698]          swapper-0       [000]     0.104308: kp_early: (trap_init+0x0/0x1e)
"""


def test_trace_of_a_kernels_trace_file(tmp_path):
    """`kprewrite trace` on a saved tracing/trace: our lines and the kernel's own kprobe events
    (with the flags column, the TGID column, trace_printk's ip, printk's time), nothing else."""
    f = tmp_path / "trace"
    f.write_text(KERNEL_TRACE)
    recs = [json.loads(l) for l in kprewrite("trace", f).stdout.splitlines()]
    assert [(r["comm"], r["pid"], r["cpu"], r["ts_us"], r["event"]) for r in recs] == [
        ("opener", 90, 0, 6536520, "kp_open"), ("opener", 90, 0, 6536686, "kpk"),
        ("opener", 90, 0, 6548573, "kp_open"), ("<...>", 91, 0, 6611597, "kp_open"),
        ("init", 1, 1, 7000001, "p_kill_0"), ("swapper", 0, 0, 104308, "kp_early")]
    assert recs[0]["args"] == {"dfd": -100, "file": "/kp-events-missing", "comm": "opener",
                               "caller": "__x64_sys_openat+0x6a/0xa0"}
    assert recs[0]["func"] == "do_sys_openat2" and recs[1]["func"] == "getname"
    assert recs[2]["args"]["file"] == "(fault)"
    doc = json.loads(kprewrite("trace", f, "--format", "chrome").stdout)
    assert sorted(e["name"] for e in doc["traceEvents"] if e["ph"] == "i") == [
        "kp_early", "kp_open", "kp_open", "kp_open", "kpk", "p_kill_0"]


def test_trace_of_a_file_without_trace_lines(tmp_path, prog):
    """The wrong file (here the program itself) is one clear line, not an empty timeline;
    an empty trace (no hits) is still a valid, empty one."""
    r = kprewrite("trace", prog, "--format", "chrome", "-o", tmp_path / "t.json", check=False)
    assert r.returncode != 0 and not (tmp_path / "t.json").exists()
    assert len(r.stderr.strip().splitlines()) == 1 and "no trace lines in it" in r.stderr
    (tmp_path / "empty.txt").write_text("")
    assert kprewrite("trace", tmp_path / "empty.txt").stdout == ""


CLOBBER = r"""
#include <stdio.h>
/* Every argument register is live at the entry and used after it: an event's generated
   handler is C calling the runtime, which may clobber any caller-saved register. */
__attribute__((noinline)) long f(long a, long *p, long b, long c, long d, long e)
{
    p[0] = a;
    p[1] = b + c + d + e;
    return a;
}
int main(void)
{
    long v[2];
    for (long i = 1; i <= 3; i++) {
        f(i, v, i + 1, i + 2, i + 3, i + 4);
        printf("%ld %ld\n", v[0], v[1]);
    }
    return 0;
}
"""


@pytest.mark.parametrize("line", ["p:g/e f", "p:g/e f n=\\\\7 who=$comm"])
def test_event_reading_no_register_keeps_the_registers(tmp_path, runner, line):
    """An event whose fetch args read no register (none, immediates, $comm) still runs C at
    every hit: its detour saves the caller-saved registers as for any handler."""
    prog = cc(tmp_path, "clobber", CLOBBER, "-O2")
    out = instrument(prog, write_spec(tmp_path, f'events = ["{line}"]\n'), tmp_path / "clobber.kp")
    assert kprewrite("check", prog, "--spec", tmp_path / "probes.toml").stdout.startswith("f+0x0  k  optimized")
    r = run(out, runner=runner, env={"KPREWRITE_PROFILE": "-"})
    assert (r.returncode, r.stdout) == (0, "1 14\n2 18\n3 22\n"), r.stderr[-2000:]
    assert profile(r.stderr)["e"] == (3, 0)
