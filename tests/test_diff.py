"""`kprewrite diff ORIGINAL REWRITTEN`: every changed byte attributed to a probe
site or a known part of the rewrite, exit 1 for anything else.  (conftest's
instrument() runs the same check on every rewrite the tests make.)"""
from __future__ import annotations

import json
import struct

import pytest

from conftest import ALL_ARCHES, ARCH, cc, function, instrument, kprewrite, symbols, write_spec

ARCHES = ALL_ARCHES

PROG = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) int leaf(int x) { return x * 3 + 1; }
__attribute__((noinline)) int work(int x) { int s = 0; for (int i = 0; i < x; i++) s += leaf(i) ^ i; return s; }
int main(int argc, char **argv) { printf("%d\n", work(argc > 1 ? atoi(argv[1]) : 10)); return 0; }
"""
SPEC = """
[[kprobe]]
symbol_name = "leaf"
[[kprobe]]
symbol_name = "leaf"
offset = 4
[[kretprobe]]
symbol_name = "work"
maxactive = 20
"""
LIB = r"""
__attribute__((noinline)) long lib_work(long x) { long s = 0; for (long i = 0; i < x; i++) s += i * x; return s; }
"""


def _diff(*args, rc=0):
    r = kprewrite("diff", *args, "--format", "json", check=False)
    assert r.returncode == rc, r.stderr
    return json.loads(r.stdout), r


@pytest.mark.skipif(ARCH != "x86_64", reason="x86-64's 5-byte jump covers leaf+4 (one detour for both probes)")
def test_diff_executable(tmp_path):
    prog = cc(tmp_path, "prog", PROG, "-O2", "-fcf-protection=none", "-falign-functions=1")
    out = instrument(prog, write_spec(tmp_path, SPEC))
    doc, r = _diff(prog, out)
    assert r.stderr == "" and doc["format"] == "kprewrite-diff-1" and doc["unattributed"] == doc["problems"] == []
    sym = symbols(prog)
    by = {c["address"]: c for c in doc["changes"] if c["what"] not in ("elf_header", "branch")}
    # leaf: one jump, whose detour serves the probe on its ret too (a shared detour).
    assert by[hex(sym["leaf"])]["changed"] == 5 and by[hex(sym["leaf"])]["probes"] == ["p_leaf_0", "p_leaf_4"]
    # work: the kretprobe's entry jump, and a jump or int3 on each exit.
    entry = by[hex(sym["work"])]
    assert entry["what"] == "kretprobe" and entry["probes"] == ["r_work_0"] and 5 <= entry["changed"] <= entry["size"]
    lo, hi = function(prog, "work")
    exits = [c for c in doc["changes"] if c["what"] in ("return_site", "int3_exit")]
    assert exits and all(lo <= int(c["address"], 16) < hi and c["probes"] == ["r_work_0"] for c in exits)
    assert set(by) == {hex(sym["leaf"]), hex(sym["work"])} | {c["address"] for c in exits}
    # The direct calls of leaf (in work) and of work (in main) enter the detours themselves.
    branches = {c["address"]: c for c in doc["changes"] if c["what"] == "branch"}
    lo_main, hi_main = function(prog, "main")
    assert sorted(c["probes"] for c in branches.values()) == [["p_leaf_0", "p_leaf_4"], ["r_work_0"]], branches
    assert all((lo <= int(a, 16) < hi) == (c["probes"] == ["p_leaf_0", "p_leaf_4"])
               and (lo_main <= int(a, 16) < hi_main) == (c["probes"] == ["r_work_0"]) for a, c in branches.items())
    assert all(c["detail"] == f"direct branch to {hex(sym['leaf'] if c['probes'][0] == 'p_leaf_0' else sym['work'])}: "
               "enters its detour" and 1 <= c["changed"] <= 4 for c in branches.values())
    header = {c["detail"].split(":")[0] for c in doc["changes"] if c["what"] == "elf_header"}
    assert {"e_entry", "e_phoff", "e_phnum", "e_shoff", "e_shnum"} <= header
    # PT_GNU_EH_FRAME: the unwind table rewritten in a read-only segment of its own.
    assert doc["moved"] == [{"segment": "PHDR", "from": "0x40", "to": doc["added_segments"][0]["address"]},
                            {"segment": "GNU_EH_FRAME", "from": doc["moved"][1]["from"],
                             "to": doc["moved"][1]["to"]}]
    assert [(s["type"], s["flags"]) for s in doc["added_segments"]] == [("LOAD", "R-X"), ("LOAD", "RW-"), ("LOAD", "R--")]
    assert [s["name"] for s in doc["added_sections"]][:2] == [".kprewrite.text", ".kprewrite.data"]
    assert doc["added_sections"][-1]["name"] == ".kprewrite.meta"
    text = kprewrite("diff", prog, out).stdout.splitlines()
    assert f"changed  {hex(sym['leaf'])}      5 bytes  kprobe  leaf+0x0: jump to detour " in "\n".join(text) and "[p_leaf_0, p_leaf_4]" in "\n".join(text)
    assert any(line.startswith("added    segment LOAD R-X  ") for line in text)


def test_diff_shared_object_init_hooks(tmp_path):
    lib = cc(tmp_path, "libw.so", LIB, "-O2", "-shared", "-fPIC")
    out = instrument(lib, write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "lib_work"\n'), tmp_path / "out.so")
    doc, _ = _diff(lib, out)
    target = [c["detail"] for c in doc["changes"] if c["what"] == "target"]
    assert len(target) == 2 and "DT_INIT_ARRAY[0]" in target[0] and "DT_FINI_ARRAY[0]" in target[1], target
    assert not any(c["detail"].startswith("e_entry") for c in doc["changes"])   # a library keeps its entry


def test_diff_fails_on_unexplained_changes(tmp_path):
    prog = cc(tmp_path, "prog", PROG, "-O2", "-fcf-protection=none", "-falign-functions=1")
    out = instrument(prog, write_spec(tmp_path, SPEC))
    sym = symbols(prog)
    data = bytearray(out.read_bytes())
    # One byte of main changed behind kprewrite's back: named, with its address and function.
    orig = prog.read_bytes()
    seg = [struct.unpack_from("<IIQQQQQQ", orig, 64 + i * 56) for i in range(struct.unpack_from("<H", orig, 56)[0])]
    load = next(s for s in seg if s[0] == 1 and s[3] <= sym["main"] < s[3] + s[5])
    off = load[2] + sym["main"] + 2 - load[3]
    data[off] ^= 0xFF
    bad = tmp_path / "bad"
    bad.write_bytes(data)
    doc, r = _diff(prog, bad, rc=1)
    assert doc["unattributed"] == [{"offset": hex(off), "address": hex(sym["main"] + 2), "size": 1, "symbol": "main+0x2"}]
    assert r.stderr == (f"kprewrite: {bad}: 1 changed bytes at file offset {off:#x}, {sym['main'] + 2:#x} (main+0x2), "
                        "not attributed to any probe site or known rewrite\n")
    # An original segment changed (its flags made writable): a problem too.
    data = bytearray(out.read_bytes())
    phoff = struct.unpack_from("<Q", data, 32)[0]
    i = next(i for i in range(struct.unpack_from("<H", data, 56)[0])
             if struct.unpack_from("<IIQQ", data, phoff + i * 56)[0:4:3] == (1, load[3]))
    struct.pack_into("<I", data, phoff + i * 56 + 4, 7)
    bad.write_bytes(data)
    doc, r = _diff(prog, bad, rc=1)
    assert doc["problems"] == [{"what": "segment", "detail": f"LOAD segment at {load[3]:#x} of the original is missing or changed"}]
    # Not a rewrite at all; a missing file: one line, exit 1.
    r = kprewrite("diff", prog, prog, check=False)
    assert r.returncode == 1 and r.stderr == f"kprewrite: {prog}: not rewritten by kprewrite (no .kprewrite.meta section)\n"
    r = kprewrite("diff", tmp_path / "nope", out, check=False)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "nope: no such file" in r.stderr
