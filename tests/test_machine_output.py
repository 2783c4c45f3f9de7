"""Machine-readable output: `check`, `list` and `blacklist` with
`--format json`, `instrument --format json` and `--quiet`.  Every field the text
form shows is in the JSON, checked against the program's own symbols and code."""
from __future__ import annotations

import json

import pytest

from conftest import ALL_ARCHES, ARCH, CROSS, cc, function, kprewrite, run, symbols, write_spec

ARCHES = ALL_ARCHES
LOCAL = "qemu" if CROSS else "native"      # the runner of the tests that run once

PROG = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) int leaf(int x) { return x * 3 + 1; }
__attribute__((noinline)) int tail(int x) { return leaf(x + 1); }
__attribute__((noinline)) int work(int x) { int s = 0; for (int i = 0; i < x; i++) s += tail(i) ^ i; return s; }
int main(int argc, char **argv) { printf("%d\n", work(argc > 1 ? atoi(argv[1]) : 10)); return 0; }
"""

# leaf is `lea 0x1(%rdi,%rdi,2),%eax; ret` (-O2, no endbr64, functions packed with
# -falign-functions=1, so no padding follows it to borrow): a probe on its ret has
# no 5 bytes of its own (func_size) and rides on the detour of the one at its entry
# (planner.sites.share_regions(); the kernel would refuse it, probe_in_region);
# tail is `add $1,%edi; jmp leaf`: a kretprobe whose one exit is a tail call.
SPEC = """
[[kprobe]]
symbol_name = "leaf"
[[kprobe]]
symbol_name = "leaf"
offset = 4
[[kretprobe]]
symbol_name = "tail"
maxactive = 20
[[kprobe]]
symbol_name = "work"
[[kretprobe]]
symbol_name = "_st*"
"""
BAD = SPEC + """
[[kprobe]]
symbol_name = "leaf"
offset = 1
"""


def _prog(tmp):
    prog = cc(tmp, "prog", PROG, "-O2", "-fcf-protection=none", "-falign-functions=1")
    assert function(prog, "leaf")[1] - function(prog, "leaf")[0] >= 5   # the layout the spec relies on
    return prog


def _json(*args, rc=0):
    r = kprewrite(*args, "--format", "json", check=False)
    assert r.returncode == rc, r.stderr
    return json.loads(r.stdout), r


def test_check_json(tmp_path):
    prog = _prog(tmp_path)
    sym = symbols(prog)
    spec = write_spec(tmp_path, SPEC)
    doc, r = _json("check", prog, "--spec", spec)
    assert r.stderr == ""     # the skipped summary is in the document
    assert doc["format"] == "kprewrite-check-1" and doc["input"] == "prog" and doc["errors"] == []
    assert doc["skipped"] == {"kretprobe_blacklist": 1}
    by = {(p["symbol"], p["offset"], p["kind"]): p for p in doc["probes"]}
    assert [p["index"] for p in doc["probes"]] == sorted(p["index"] for p in doc["probes"])
    for (s, off, _), p in by.items():
        assert p["address"] == hex(sym[s] + off), p
        assert set(p) == {"index", "name", "kind", "symbol", "offset", "address", "decision", "from_glob",
                          "reason", "int3", "returns"}
    entry, ret = by["leaf", 0, "k"], by["leaf", 4, "k"]
    assert entry["decision"] == ret["decision"] == "optimized" and entry["reason"] is ret["reason"] is None
    assert by["work", 0, "k"]["decision"] == "optimized" and by["work", 0, "k"]["reason"] is None
    assert by["work", 0, "k"]["name"] == "p_work_0" and not by["work", 0, "k"]["from_glob"]
    t = by["tail", 0, "r"]
    assert t["decision"] == "optimized" and t["name"] == "r_tail_0" and t["returns"]["mode"] == "hooks"
    (exit_,) = t["returns"]["sites"]
    assert exit_["kind"] == "tail" and exit_["target"] == hex(sym["leaf"]) and exit_["hook"] == "trampoline"
    assert int(exit_["address"], 16) in range(*function(prog, "tail")) and not exit_["int3"]
    start = by["_start", 0, "r"]
    assert start["decision"] == "refused" and start["from_glob"]
    assert start["reason"]["check"] == "kretprobe_blacklist" and start["reason"]["address"] == hex(sym["_start"])
    # The text form says the same, field for field.
    r = kprewrite("check", prog, "--spec", spec)
    assert r.stderr.splitlines() == ["kprewrite: 4 probes placed, 1 from globs skipped:",
                                     "kprewrite:        1  kretprobe_blacklist"]
    text = r.stdout.splitlines()
    for p, line in zip(doc["probes"], text):
        assert line.startswith(f"{p['symbol']}+{p['offset']:#x}  {p['kind']}  {p['decision']}"), (p, line)
        if p["reason"]:
            assert p["reason"]["message"] in line
            assert p["decision"] == "refused" or f"{p['reason']['check']} at {p['reason']['address']}" in line
        if p["int3"]:
            assert line.endswith(f"  [{p['int3']}]")
    assert len(text) == len(doc["probes"]) == 5


def test_check_json_refusal_fails(tmp_path):
    """An exact probe that cannot be placed: the JSON still names it, and the
    exit status and standard error are those of the text form."""
    prog = _prog(tmp_path)
    spec = write_spec(tmp_path, BAD)
    doc, r = _json("check", prog, "--spec", spec, rc=1)
    (bad,) = [p for p in doc["probes"] if p["offset"] == 1]
    assert (bad["symbol"], bad["offset"], bad["decision"]) == ("leaf", 1, "refused")
    assert bad["reason"]["check"] == "insn_boundary" and bad["reason"]["address"] == hex(symbols(prog)["leaf"] + 1)
    assert len(doc["errors"]) == 1 and "leaf+0x1" in doc["errors"][0]
    assert f"kprewrite: {doc['errors'][0]}" in r.stderr.splitlines()
    r = kprewrite("instrument", prog, "--spec", spec, "-o", tmp_path / "out", "--format", "json", check=False)
    assert r.returncode == 1 and r.stdout == "" and not (tmp_path / "out").exists()
    assert f"kprewrite: {doc['errors'][0]}" in r.stderr.splitlines()


@pytest.mark.skipif(ARCH != "x86_64", reason="x86-64's layout: leaf+4 rides on leaf's 5-byte detour, tail's exit at +3")
def test_instrument_list_json_and_quiet(tmp_path):
    prog = _prog(tmp_path)
    sym = symbols(prog)
    spec = write_spec(tmp_path, SPEC)
    out = tmp_path / "prog.kp"
    r = kprewrite("instrument", prog, "--spec", spec, "-o", out, "--format", "json")
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert r.stderr == ""
    assert lines == [{"type": "skipped", "check": "kretprobe_blacklist", "count": 1},
                     {"type": "summary", "output": str(out), "kprobes": 3, "kretprobes": 1,
                      "optimized": 3, "ftrace": 0, "int3": 0, "skipped": 1}]
    assert run(out, 4, runner=LOCAL).stdout == run(prog, 4, runner=LOCAL).stdout == "32\n"
    # --quiet: nothing at all on success, the same bytes written.
    r = kprewrite("instrument", prog, "--spec", spec, "-o", tmp_path / "q", "--quiet")
    assert r.stdout == r.stderr == "" and (tmp_path / "q").read_bytes() == out.read_bytes()

    doc, _ = _json("list", out)
    text = kprewrite("list", out).stdout.splitlines()
    assert doc["format"] == "kprewrite-list-1" and doc["input"] == "prog" and len(doc["probes"]) == len(text) == 4
    for p, line in zip(doc["probes"], text):
        assert p["address"] == hex(sym[p["symbol"]] + p["offset"])
        assert line == f"{int(p['address'], 16):016x}  {p['kind']}  {p['symbol']}+{p['offset']:#x}" + "".join(
            f" [{f}]" for f in p["flags"])
    by = {(p["symbol"], p["offset"]): p for p in doc["probes"]}
    assert by["work", 0]["flags"] == ["OPTIMIZED"] and by["work", 0]["call"] in ("clean", "pt_regs")
    assert int(by["work", 0]["detour"], 16) > int(hex(sym["main"]), 16)
    assert by["leaf", 0]["flags"] == by["leaf", 4]["flags"] == ["OPTIMIZED"] and by["leaf", 0]["shared_with"] is None
    assert by["leaf", 4]["shared_with"] == hex(sym["leaf"]) and by["leaf", 4]["detour"] != by["leaf", 0]["detour"]
    assert by["leaf", 0]["region"] == [hex(sym["leaf"]), hex(sym["leaf"] + 5)]
    t = by["tail", 0]
    assert t["kind"] == "r" and t["flags"] == ["OPTIMIZED"] and t["name"] == "r_tail_0"
    assert [s["exit"] for s in t["return_sites"]] + t["int3_exits"] == [hex(function(prog, "tail")[0] + 3)]


def test_blacklist_json(tmp_path):
    prog = _prog(tmp_path)
    doc, _ = _json("blacklist", prog)
    text = kprewrite("blacklist", prog).stdout.splitlines()
    assert doc["format"] == "kprewrite-blacklist-1" and doc["input"] == "prog"
    assert [f"{e['start']}-{e['end']}  {e['symbol']}  {e['reason']}" for e in doc["entries"]] == text
    assert {"start", "end", "symbol", "kind", "reason"} == set(doc["entries"][0])
    assert any(e["symbol"] == ".plt" and e["reason"] == "PLT stub" and e["kind"] == "blacklist" for e in doc["entries"])


def test_list_json_not_rewritten(tmp_path):
    prog = _prog(tmp_path)
    r = kprewrite("list", prog, "--format", "json", check=False)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == f"kprewrite: {prog}: not rewritten by kprewrite (no .kprewrite.meta section)\n"
