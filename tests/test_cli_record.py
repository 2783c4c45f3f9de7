"""`kprewrite record [PROBES] [-o FILE] -- PROG ARGS` and `kprewrite replay FILE`
(docs/reference/cli.md#record-and-replay): the program rewritten into the cache, run with
its own input, output and exit status, its hits recorded as binary records; replay prints
what `trace --format graph` and `text` print; a second record takes the rewrite from the
cache, and a changed handler or header makes it again."""
import os
import re
import subprocess
import time

import pytest

from conftest import KPREWRITE, TREE_ENV, cc

ARCHES = ["x86_64"]      # x86-64 only: `record` runs PROG natively (an x86-64 host here)

PROG = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline, noipa)) int fib(int n) { return n < 2 ? n : fib(n - 1) + fib(n - 2); }
__attribute__((noinline, noipa)) int count(const char *s) { int n = 0; while (*s) n += *s++ == 'a'; return n; }
int main(int argc, char **argv)
{
    char line[256];
    int total = 0;
    while (fgets(line, sizeof line, stdin))
        total += count(line);
    printf("%s %s fib=%d a=%d\n", argv[0], argc > 1 ? argv[1] : "-", fib(argc > 2 ? atoi(argv[2]) : 5), total);
    fflush(stdout);
    if (argc > 3)
        abort();
    return total % 7;
}
"""

INPUT = "banana\nabracadabra\nxyz\n"     # 3 + 5 + 0 = 8 a's: exit status 1


def _env(tmp_path, **kw):
    return {**TREE_ENV, "KPREWRITE_CACHE": str(tmp_path / "cache"), **kw}


def _record(tmp_path, *args, stdin=INPUT, **env):
    return subprocess.run([*KPREWRITE, "record", *map(str, args)], input=stdin, capture_output=True, text=True,
                          cwd=tmp_path, env=_env(tmp_path, **env), timeout=300)


def _kp(tmp_path, *args):
    r = subprocess.run([*KPREWRITE, *map(str, args)], capture_output=True, text=True, cwd=tmp_path,
                       env=_env(tmp_path))
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture
def prog(tmp_path):
    return cc(tmp_path, "prog", PROG, "-O1", "-g")


def test_record_and_replay(tmp_path, prog):
    want = subprocess.run(["./prog", "x", "6"], input=INPUT, capture_output=True, text=True, cwd=tmp_path)
    assert want.returncode == 1 and want.stdout == "./prog x fib=8 a=8\n"
    r = _record(tmp_path, "--graph", "fib", "--graph", "count", "--graph", "main", "-o", "fib.data",
                "--", "./prog", "x", "6")
    assert (r.returncode, r.stdout, r.stderr) == (want.returncode, want.stdout, want.stderr)
    graph = _kp(tmp_path, "replay", "fib.data")
    assert graph == _kp(tmp_path, "trace", "fib.data", "--format", "graph")
    assert graph.startswith("# thread ") and "(prog)" in graph.splitlines()[0], graph
    body = [line.split("|", 1)[1] for line in graph.splitlines() if not line.startswith("#")]
    # fib(6) makes 25 calls: 13 leaves (n < 2), 12 with calls inside
    assert sum(b.strip() == "fib();" for b in body) == 13 and sum(b.strip() == "fib() {" for b in body) == 12, graph
    assert sum(b.strip() == "count();" for b in body) == 3, graph
    assert body[0].strip() == "main() {" and body[-1].strip() == "} /* main */", graph
    assert "   fib() {" in body and "     fib() {" in body, graph        # nested, two spaces a level
    text = _kp(tmp_path, "replay", "fib.data", "--format", "text")
    assert text == _kp(tmp_path, "trace", "fib.data", "--format", "text")
    lines = text.splitlines()
    assert len(lines) == 2 * (1 + 3 + 25), text
    assert all(line.split()[0].startswith("prog-") for line in lines), text
    assert re.search(r"^p_fib_0 +25$", _kp(tmp_path, "report", "fib.data"), re.M)


def test_record_cached_and_remade(tmp_path, prog):
    """The second record takes the rewrite from the cache; a handler or a header it includes
    changed makes it again; the events and handler output are the new ones."""
    (tmp_path / "msg.h").write_text('#define MSG "one"\n')
    (tmp_path / "h.c").write_text('#include <kprewrite/kprobes.h>\n#include "msg.h"\n'
                                  'int pre(struct kprobe *p, struct pt_regs *regs)\n'
                                  '{ pr_info(MSG " %d\\n", (int)regs->di); return 0; }\n')
    args = ["--handlers", "h.c", "--kprobe", "count pre_handler=pre", "--event", "p:ev fib n=%di:s32", "-v",
            "--", "./prog"]
    r1 = _record(tmp_path, *args)
    assert r1.returncode == 1 and r1.stdout == "./prog - fib=5 a=8\n", r1.stderr
    assert "kprewrite: rewrote ./prog as " in r1.stderr and r1.stderr.count("one ") == 3, r1.stderr
    exe = r1.stderr.split("kprewrite: rewrote ./prog as ")[1].split(" (")[0]
    assert exe.startswith(str(tmp_path / "cache" / "record")) and exe.endswith("/prog")
    mtime = os.stat(exe).st_mtime_ns
    t = time.monotonic()
    r2 = _record(tmp_path, *args)
    took = time.monotonic() - t
    assert r2.stdout == r1.stdout and f"kprewrite: cached ./prog as {exe} (" in r2.stderr, r2.stderr
    assert os.stat(exe).st_mtime_ns == mtime and r2.stderr.count("one ") == 3 and took < 30
    assert os.path.exists(tmp_path / "kprewrite.data.old")
    evs = [line.split(") ")[1] for line in _kp(tmp_path, "replay", "--format", "text").splitlines()]
    assert evs.count("n=5") == 1 and len(evs) == 15, evs          # fib(5): 15 calls
    # a header the handler includes changed: made again
    (tmp_path / "msg.h").write_text('#define MSG "two"\n')
    r3 = _record(tmp_path, *args)
    assert "kprewrite: rewrote ./prog as " in r3.stderr and r3.stderr.count("two ") == 3, r3.stderr
    # other probes, other entries (the first was made again in its place); a probe that
    # writes no trace line: replay says so
    _record(tmp_path, "--kprobe", "count", "-o", "count.data", "--", "./prog")
    r = subprocess.run([*KPREWRITE, "replay", "count.data"], capture_output=True, text=True, cwd=tmp_path,
                       env=_env(tmp_path))
    assert r.returncode == 0 and not r.stdout and r.stderr.startswith("kprewrite: count.data: nothing recorded ("), r
    r4 = _record(tmp_path, "--event", "p:ev2 count", "-v", "--", "./prog")
    assert "kprewrite: rewrote ./prog" in r4.stderr and r4.stdout == r1.stdout
    assert len([d for d in os.listdir(tmp_path / "cache" / "record") if not d.startswith(".")]) == 3


def test_record_defaults_path_and_a_killed_program(tmp_path, prog):
    """No probes: the calls of every function. PROG found on PATH, argv[0] as given. A
    program that aborts: record's status is 128 + SIGABRT, and what it recorded is there."""
    os.rename(prog, tmp_path / "kp-test-prog")
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    want = subprocess.run(["kp-test-prog", "y", "3"], input=INPUT, capture_output=True, text=True,
                          env={**os.environ, **env})
    r = _record(tmp_path, "--", "kp-test-prog", "y", "3", **env)
    assert (r.returncode, r.stdout, r.stderr) == (want.returncode, "kp-test-prog y fib=2 a=8\n", ""), r.stderr
    graph = _kp(tmp_path, "replay")
    assert "main() {" in graph and "count();" in graph and "fib() {" in graph, graph
    r = _record(tmp_path, "--", "kp-test-prog", "y", "3", "abort", **env)
    assert r.returncode == 128 + 6 and r.stdout == "kp-test-prog y fib=2 a=8\n", r
    graph = _kp(tmp_path, "replay")
    # main never returned: its entry is an event (no return of it anywhere in the trace)
    assert "| /* p_main_0: (main+0x0/" in graph and graph.count("count();") == 3 and "fib() {" in graph, graph


def test_readme_quick_start(tmp_path):
    """The README's one-line quick start, run as written from the repository's top (with this
    tree's kprewrite first on PATH), prints what the README shows, times and ids aside."""
    from conftest import ROOT
    readme = (ROOT / "README.md").read_text()
    part = readme.split("## Quick start\n", 1)[1]
    block, output = part.split("\n\n")[1], part.split("\n\n")[3]
    commands = [line[4:].split("  #")[0].strip() for line in block.splitlines()]
    assert commands[0].startswith("gcc ") and commands[2].startswith("kprewrite record --")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kprewrite").write_text(f'#!/bin/sh\nexec {" ".join(KPREWRITE)} "$@"\n')
    (bin_dir / "kprewrite").chmod(0o755)
    work = tmp_path / "work"
    (work / "samples" / "kprobe_example").mkdir(parents=True)
    (work / "samples" / "kprobe_example" / "program.c").write_bytes(
        (ROOT / "samples" / "kprobe_example" / "program.c").read_bytes())
    env = _env(tmp_path, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    got = []
    for c in commands:
        r = subprocess.run(["bash", "-c", c], capture_output=True, text=True, cwd=work, env=env, timeout=300)
        assert r.returncode == 0 and not r.stderr.replace("kprewrite: ", "").strip() or "instrument" in c, (c, r)
        got += (r.stdout + r.stderr).splitlines()

    def mask(line):
        line = re.sub(r"\d+\.\d+ us", "T us", line)
        line = re.sub(r"^ [ +!#*@$] ", "   ", line)
        line = re.sub(r"thread \d+", "thread N", line)
        line = re.sub(r"-\d+ +\[\d+\] +\d+\.\d+:", "-N [C] T:", line.strip())
        return line
    want = [line[4:] for line in output.splitlines()]
    assert sorted(map(mask, got)) == sorted(map(mask, want)), (got, want)


LIB = r"""
__attribute__((noinline)) int lib_leaf(int x) { return x * 5; }
__attribute__((noinline)) int lib_work(int x) { return lib_leaf(x) + 1; }
"""
MAIN = r"""
#include <stdio.h>
int lib_work(int);
__attribute__((noinline, noipa)) int twice(int x) { return lib_work(x) + lib_work(x + 1); }
int main(int argc, char **argv) { printf("s=%d\n", twice(argc)); return 0; }
"""


def test_record_a_library(tmp_path):
    """--lib: the library PROG loads is rewritten too (found by name as ldd lists it), each
    probe going to the object that has its function; the graph nests calls across both."""
    lib = tmp_path / "libkpt.so"
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", lib, "-x", "c", "-"], input=LIB, text=True, check=True)
    cc(tmp_path, "m", MAIN, "-O1", f"-L{tmp_path}", "-lkpt", "-Wl,-rpath,$ORIGIN")
    want = subprocess.run(["./m"], capture_output=True, text=True, cwd=tmp_path)
    assert want.stdout == "s=17\n"      # (5 + 1) + (10 + 1)
    r = _record(tmp_path, "--graph", "twice", "--graph", "lib_*", "--lib", "libkpt", "--", "./m", stdin="")
    assert (r.returncode, r.stdout, r.stderr) == (0, want.stdout, ""), r.stderr
    body = [line.split("|", 1)[1].rstrip() for line in _kp(tmp_path, "replay").splitlines() if not line.startswith("#")]
    assert [b.split(";")[0].strip() for b in body] == [
        "twice() {", "lib_work() {", "lib_leaf()", "} /* lib_work */", "lib_work() {", "lib_leaf()",
        "} /* lib_work */", "} /* twice */"], body
    # each probe to its object; a probe no object has is an error naming them all
    err = _record(tmp_path, "--graph", "nosuch", "--lib", str(lib), "--", "./m", stdin="").stderr
    assert err == "kprewrite: --graph 'nosuch': no function 'nosuch' in m or libkpt.so\n", err
    err = _record(tmp_path, "--graph", "twice", "--lib", "libnosuch", "--", "./m", stdin="").stderr
    assert err == "kprewrite: --lib libnosuch: m loads no library of that name (ldd)\n", err
