"""`kprewrite report TRACE`: per-event counts and log2 histograms (bpftrace's
hist() form) of kretprobe durations and numeric fields, from the trace lines a
rewritten program wrote; --plot writes them as SVG."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from conftest import ALL_ARCHES, CROSS, FACTS, cc, instrument, kprewrite, run, write_spec

ARCHES = ALL_ARCHES
LOCAL = "qemu" if CROSS else "native"      # the runner of the tests that run once

PROG = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) long leaf(long x) { return x * 1000 - 3000; }
int main(int argc, char **argv)
{
    long n = atol(argv[1]), s = 0;
    for (long i = 0; i < n; i++)
        s += leaf(i);
    printf("%ld\n", s);
    return 0;
}
"""
SPEC = f'events = ["p:leaf_entry leaf x={FACTS.ARG_REGS[0]}:s64", "r:leaf_ret leaf ret=$retval:s64"]\n'


def log2_label(v: int) -> str:
    """bpftrace's bucket of v, computed independently of kprewrite's."""
    if v < 0:
        return "(..., 0)"
    if v < 2:
        return f"[{v}]"
    k = 1
    while 1 << (k + 1) <= v:
        k += 1
    def size(n):
        return f"{n >> 10}K" if n >= 1024 and n % 1024 == 0 else str(n)
    return f"[{size(1 << k)}, {size(1 << (k + 1))})"


def _trace(tmp_path, n=40):
    prog = cc(tmp_path, "prog", PROG, "-O2")
    out = instrument(prog, write_spec(tmp_path, SPEC))
    trace = tmp_path / "trace.txt"
    r = run(out, n, runner=LOCAL, env={"KPREWRITE_TRACE": str(trace)})
    assert r.returncode == 0 and r.stdout == f"{sum(i * 1000 - 3000 for i in range(n))}\n"
    return trace


def test_report_counts_and_histograms(tmp_path):
    n = 40
    trace = _trace(tmp_path, n)
    doc = json.loads(kprewrite("report", trace, "--format", "json").stdout)
    assert doc["format"] == "kprewrite-report-1"
    assert doc["events"] == [{"event": "leaf_entry", "count": n}, {"event": "leaf_ret", "count": n}]
    hists = {h["name"]: h for h in doc["histograms"]}
    assert set(hists) == {"leaf: duration (ns)", "leaf_entry.x", "leaf_ret.ret"}
    assert hists["leaf: duration (ns)"]["count"] == n
    for name, values in (("leaf_entry.x", range(n)), ("leaf_ret.ret", [i * 1000 - 3000 for i in range(n)])):
        got = {b["bucket"]: b["count"] for b in hists[name]["buckets"] if b["count"]}
        want = {}
        for v in values:
            want[log2_label(v)] = want.get(log2_label(v), 0) + 1
        assert got == want, name
    # Empty buckets between used ones are shown, as bpftrace does.
    assert [b["bucket"] for b in hists["leaf_entry.x"]["buckets"]] == [
        "[0]", "[1]", "[2, 4)", "[4, 8)", "[8, 16)", "[16, 32)", "[32, 64)"]
    assert [b["bucket"] for b in hists["leaf_ret.ret"]["buckets"]][:3] == ["(..., 0)", "[0]", "[1]"]
    text = kprewrite("report", trace).stdout.splitlines()
    assert [t.split() for t in text[:3]] == [["EVENT", "COUNT"], ["leaf_entry", str(n)], ["leaf_ret", str(n)]]
    i = text.index("@leaf_entry.x:")
    assert text[i + 6] == "[16, 32)                  16 |" + "@" * 52 + "|"      # the fullest bucket: a full bar
    assert text[i + 7] == "[32, 64)                   8 |" + "@" * 26 + " " * 26 + "|"   # 32..39
    assert text[i + 1] == "[0]                        1 |" + "@" * 3 + " " * 49 + "|"


def test_report_plot_svg(tmp_path):
    trace = _trace(tmp_path)
    a, b = tmp_path / "a.svg", tmp_path / "b.svg"
    kprewrite("report", trace, "--plot", a)
    kprewrite("report", trace, "--plot", b)
    assert a.read_bytes() == b.read_bytes()                 # deterministic
    root = ET.parse(a).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    rects = root.findall("{http://www.w3.org/2000/svg}rect")
    doc = json.loads(kprewrite("report", trace, "--format", "json").stdout)
    assert len(rects) == 1 + sum(len(h["buckets"]) for h in doc["histograms"])    # background + one bar per bucket
    texts = [t.text for t in root.findall("{http://www.w3.org/2000/svg}text")]
    assert "leaf_entry.x (40 values)" in texts and "[32, 64)" in texts
    r = kprewrite("report", trace, "--plot", tmp_path / "p.png", check=False)
    assert r.returncode == 1 and r.stderr == f"kprewrite: {tmp_path / 'p.png'}: --plot writes SVG; name the file *.svg\n"
    assert not (tmp_path / "p.png").exists()
    r = kprewrite("report", tmp_path / "prog.c", check=False)
    assert r.returncode == 1 and "no trace lines" in r.stderr and r.stderr.count("\n") == 1
