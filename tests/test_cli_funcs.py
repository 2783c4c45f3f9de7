"""`kprewrite funcs IMAGE [GLOB]` (docs/reference/cli.md#funcs): what a kprobe on each
function's entry would be, which must be what `check --kprobe FUNC` says for it, in text
and in JSON; and a rewrite with a probe on every function it calls probeable runs as the
original, each probe counted and flagged as funcs said."""
import json

import pytest

from conftest import attributed, cc, kprewrite, profile, run

ARCHES = ["x86_64"]      # x86-64 only: the functions are x86-64 assembly

PROG = r"""
#include <stdio.h>
#include <stdlib.h>
int jt(int), tiny3(int), next3(int), dfn(int);
__asm__(".text\n"
        /* a jump target 2 bytes into the function */
        ".globl jt\n.type jt,@function\njt:\n xor %eax,%eax\n1: inc %eax\n cmp %edi,%eax\n jl 1b\n ret\n.size jt,.-jt\n"
        /* 3 bytes, no padding before the next function */
        ".globl tiny3\n.type tiny3,@function\ntiny3:\n mov %edi,%eax\n ret\n.size tiny3,.-tiny3\n"
        ".globl next3\n.type next3,@function\nnext3:\n lea 1(%rdi),%eax\n ret\n.size next3,.-next3\n"
        /* the kernel's can_probe() refuses ud2 */
        ".globl crash\n.type crash,@function\ncrash:\n ud2\n.size crash,.-crash\n"
        /* std: no jump optimization (direction_flag), a breakpoint probe */
        ".globl dfn\n.type dfn,@function\ndfn:\n lea 2(%rdi),%eax\n std\n cld\n ret\n.size dfn,.-dfn\n");
__attribute__((noinline)) int work(int x) { return x * 3 + 1; }
__attribute__((noinline)) int loop(int n) { int s = 0; for (int i = 0; i < n; i++) s += work(i); return s; }
int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 3;
    printf("loop %d jt %d tiny3 %d next3 %d dfn %d\n", loop(n), jt(n), tiny3(n), next3(n), dfn(n));
    return 0;
}
"""


@pytest.fixture
def prog(tmp_path):
    return cc(tmp_path, "prog", PROG, "-O2", "-g", "-w")


def _probe_arg(line: str) -> str:
    """What --kprobe names the function of a funcs line by: its symbol, or for a
    function with no symbol (sub_ADDR, a PLT stub) its address."""
    sym = line.split("+0x")[0]
    return "0x" + sym[4:] if sym.startswith("sub_") else sym


def test_funcs_is_what_check_says(prog):
    lines = kprewrite("funcs", prog).stdout.splitlines()
    by_sym = {line.split("+0x")[0]: line for line in lines}
    for f in ("main", "jt", "tiny3", "next3", "crash", "dfn", "work", "loop"):
        assert f + "+0x0  k  " in by_sym[f], lines
    assert by_sym["work"] == "work+0x0  k  optimized"
    assert by_sym["dfn"].startswith("dfn+0x0  k  int3  direction_flag at 0x"), by_sym["dfn"]
    assert by_sym["crash"].startswith("crash+0x0  k  refused  can_probe at 0x"), by_sym["crash"]
    assert {line.split("  ")[2].split()[0] for line in lines} == {"optimized", "int3", "refused"}, lines
    for line in lines:
        # check --kprobe FUNC, planned alone, says the same (a refused probe is an error there)
        r = kprewrite("check", prog, "--kprobe", _probe_arg(line), check=False)
        if " refused " in line:
            assert r.returncode != 0 and r.stderr.startswith(f"kprewrite: --kprobe '{_probe_arg(line)}'"), r
            assert line.split("refused  ")[1].split(": ", 1)[1] in r.stderr, (line, r.stderr)
        assert r.stdout.splitlines() == [line], (line, r.stdout)
    # JSON: the records check --format json gives, function by function
    doc = json.loads(kprewrite("funcs", prog, "--format", "json").stdout)
    assert doc["format"] == "kprewrite-funcs-1" and doc["input"] == "prog"
    assert len(doc["functions"]) == len(lines)
    for rec in doc["functions"]:
        c = json.loads(kprewrite("check", prog, "--kprobe", _probe_arg(rec["symbol"]), "--format", "json",
                                 check=False).stdout)
        if rec["symbol"].startswith("sub_"):    # a probe by address is named p_0xADDR, as kprobe_events names it
            assert c["probes"][0].pop("name") == "p_" + _probe_arg(rec["symbol"]) and rec.pop("name")
        assert c["probes"] == [rec], (rec, c)


def test_funcs_glob_and_no_optimize(prog):
    assert kprewrite("funcs", prog, "*3").stdout.splitlines() == [
        "tiny3+0x0  k  optimized", "next3+0x0  k  optimized"]
    no = kprewrite("funcs", prog, "[wl]o*", "--no-optimize").stdout.splitlines()
    assert [line.split("  ")[:3] for line in no] == [["work+0x0", "k", "int3"], ["loop+0x0", "k", "int3"]], no
    assert no == kprewrite("check", prog, "--kprobe", "work", "--kprobe", "loop", "--no-optimize").stdout.splitlines()
    r = kprewrite("funcs", prog, "nosuch*", check=False)
    assert r.returncode != 0 and r.stderr == "kprewrite: prog: no function matches 'nosuch*'\n", r


def test_rewrite_what_funcs_calls_probeable(prog, tmp_path):
    """A kprobe on each function funcs does not refuse: the rewrite runs as the original,
    each probe counted, `list` flagging OPTIMIZED exactly where funcs said optimized."""
    lines = kprewrite("funcs", prog).stdout.splitlines()
    called = {"main", "jt", "tiny3", "next3", "dfn", "work", "loop"}
    ok = [line for line in lines if " refused " not in line and line.split("+0x")[0] in called]
    assert len(ok) == len(called), lines
    args = [a for line in ok for a in ("--kprobe", line.split("+0x")[0])]
    out = tmp_path / "prog.kp"
    kprewrite("instrument", prog, *args, "-o", out)
    attributed(prog, out)
    want = run(prog, 4)
    r = run(out, 4, env={"KPREWRITE_PROFILE": "-"})
    assert r.returncode == 0 and r.stdout == want.stdout == "loop 22 jt 4 tiny3 4 next3 5 dfn 6\n", r
    assert profile(r.stderr) == {f"p_{f}_0": (4 if f == "work" else 1, 0) for f in called}, r.stderr
    listed = {line.split()[2].split("+")[0]: line for line in kprewrite("list", out).stdout.splitlines()}
    for line in ok:
        f = line.split("+0x")[0]
        assert ("[OPTIMIZED]" in listed[f]) == (" optimized" in line), (line, listed[f])


SUM = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) int sum(int n)
{
    int s = 0;
    for (int i = 0; i < n; i++)
        s += i * i;
    return s;
}
int main(int argc, char **argv) { printf("%d\n", sum(argc > 1 ? atoi(argv[1]) : 3)); return 0; }
"""


def test_probe_lines_and_vars_json(tmp_path):
    """probe-lines and probe-vars --format json are their text forms as records; an event
    line made from probe-vars' JSON traces what `--probe 'sum:4 s i'` traces."""
    prog = cc(tmp_path, "sum", SUM, "-O1", "-g")
    text = kprewrite("probe-lines", prog, "sum").stdout.splitlines()
    doc = json.loads(kprewrite("probe-lines", prog, "sum", "--format", "json").stdout)
    assert doc["format"] == "kprewrite-probe-lines-1" and doc["function"] == "sum" and doc["input"] == "sum"
    assert doc["file"] == str(tmp_path / "sum.c") and text[0] == f"<sum@{tmp_path / 'sum.c'}:0>"
    assert [(r["relative"], r["source"]) for r in doc["lines"]] == [
        (int(t[:7]) if t[:7].strip() else None, t[9:]) for t in text[1:]], (doc, text)
    rln = next(r["relative"] for r in doc["lines"] if r["source"].strip() == "s += i * i;")
    assert rln is not None
    vtext = kprewrite("probe-vars", prog, f"sum:{rln}").stdout.splitlines()
    vdoc = json.loads(kprewrite("probe-vars", prog, f"sum:{rln}", "--format", "json").stdout)
    assert vdoc["format"] == "kprewrite-probe-vars-1" and vdoc["point"] == f"sum:{rln}"
    (site,) = vdoc["sites"]
    assert vtext[0] == f"@<{site['at']}> {site['address']} in sum", vtext
    assert [v.split("\t")[1:] for v in vtext[1:]] == [[v["kind"], v["type"], v["name"], v["fetch"]]
                                                      for v in site["vars"]]
    fetch = {v["name"]: v["fetch"] for v in site["vars"]}
    event = f"p:sq {site['at']} s={fetch['s']} i={fetch['i']}"
    kprewrite("instrument", prog, "--event", event, "-o", tmp_path / "a.kp")
    kprewrite("instrument", prog, "--probe", f"sum:{rln} s i", "-o", tmp_path / "b.kp")
    a, b = run(tmp_path / "a.kp", 4), run(tmp_path / "b.kp", 4)
    assert a.stdout == b.stdout == run(prog, 4).stdout == "14\n"
    fields = [line.split(": ", 2)[2] for line in a.stderr.splitlines()]
    assert fields == [f"({site['at']}/0x{fields[0].split('/0x')[1].split(')')[0]}) s={s} i={i}"
                      for s, i in [(0, 0), (0, 1), (1, 2), (5, 3)]], a.stderr
    assert fields == [line.split(": ", 2)[2] for line in b.stderr.splitlines()], b.stderr
