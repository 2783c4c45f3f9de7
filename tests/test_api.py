"""The Python API (rewriter.instrument, check, read_probes, read_blacklist,
KprewriteError): the pytest example of docs/reference/python-api.md, run as written, and the API
agreeing with the CLI it underlies (same records, same error lines)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import rewriter
from conftest import ALL_ARCHES, ROOT, TREE_ENV, cc, kprewrite, probe_spec, symbols, write_spec

ARCHES = ALL_ARCHES

PROG = r"""
#include <stdio.h>
__attribute__((noinline)) int leaf(int x) { return x * 3 + 1; }
__attribute__((noinline)) int work(int x) { return leaf(x) + leaf(x + 1); }
int main(void) { printf("%d\n", work(4)); return 0; }
"""


def test_readme_example(tmp_path):
    """docs/reference/python-api.md's example, extracted and run by pytest as a user would."""
    text = (ROOT / "docs" / "reference" / "python-api.md").read_text()
    m = re.search(r"<!-- api-example -->\n```python\n(.*?)```\n<!-- /api-example -->", text, re.S)
    assert m, "docs/reference/python-api.md lost its API example"
    (tmp_path / "test_example.py").write_text(m.group(1))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_example.py"],
                       cwd=tmp_path, capture_output=True, text=True, env=TREE_ENV)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr


def test_api_agrees_with_cli(tmp_path, capfd):
    prog = cc(tmp_path, "prog", PROG, "-O2", "-fcf-protection=none", "-falign-functions=1")
    spec = write_spec(tmp_path, probe_spec("kprobe", ["work", ("leaf", 4)], handlers=False)
                      + '[[kretprobe]]\nsymbol_name = "leaf"\n')
    capfd.readouterr()
    plan = rewriter.check(prog, spec)
    res = rewriter.instrument(prog, spec, tmp_path / "prog.kp", optimize=False)
    probes = rewriter.read_probes(res.output)
    entries = rewriter.read_blacklist(prog)
    assert capfd.readouterr() == ("", "")          # the API prints nothing
    assert plan.as_dict() == json.loads(kprewrite("check", prog, "--spec", spec, "--format", "json").stdout)
    assert plan.lines() == kprewrite("check", prog, "--spec", spec).stdout.splitlines()
    assert plan.ok and [p["decision"] for p in plan.probes] == ["optimized", "optimized", "optimized"]   # leaf+4 shares the entry's detour
    # optimize=False is --no-optimize: the same bytes, and int3 where the CLI says so.
    cli = tmp_path / "cli.kp"
    kprewrite("instrument", prog, "--spec", spec, "-o", cli, "--no-optimize")
    assert cli.read_bytes() == (tmp_path / "prog.kp").read_bytes()
    assert [p["decision"] for p in res.probes] == ["int3", "int3", "int3"]   # the kretprobe's entry too, as written
    assert res.summary["int3"] == 2 and res.summary["kretprobes"] == 1
    assert probes == json.loads(kprewrite("list", cli, "--format", "json").stdout)["probes"]
    assert probes[0]["address"] == hex(symbols(prog)["work"])
    assert entries == json.loads(kprewrite("blacklist", prog, "--format", "json").stdout)["entries"]


@pytest.mark.parametrize("case", ["spec", "refused", "input", "same_output", "not_rewritten"])
def test_api_errors_are_the_cli_errors(tmp_path, case):
    """Each failure raises KprewriteError whose lines are the CLI's, and nothing is written."""
    prog = cc(tmp_path, "prog", PROG, "-O2", "-fcf-protection=none", "-falign-functions=1")
    out = tmp_path / "out"
    specs = {"spec": '[[kprobe]]\nsymbol_name = "leaf"\nofset = 1\n',
             "refused": '[[kprobe]]\nsymbol_name = "leaf"\noffset = 1\n[[kprobe]]\nsymbol_name = "work"\noffset = 2\n'}
    spec = write_spec(tmp_path, specs.get(case, '[[kprobe]]\nsymbol_name = "leaf"\n'))
    args = {"input": (tmp_path / "missing", spec, out), "same_output": (prog, spec, prog)}.get(case, (prog, spec, out))
    before = prog.read_bytes()
    with pytest.raises(rewriter.KprewriteError) as e:
        if case == "not_rewritten":
            rewriter.read_probes(prog)
        else:
            rewriter.instrument(*args)
    cli = (["list", prog] if case == "not_rewritten" else
           ["instrument", args[0], "--spec", args[1], "-o", args[2]])
    r = kprewrite(*cli, check=False)
    assert r.returncode == 1 and r.stderr.splitlines() == [f"kprewrite: {line}" for line in e.value.lines]
    assert str(e.value) == "\n".join(e.value.lines) and len(e.value.lines) == (2 if case == "refused" else 1)
    assert not out.exists() and prog.read_bytes() == before
