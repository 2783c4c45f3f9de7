"""Probes on the command line (docs/reference/cli.md#probes-on-the-command-line):
--kprobe, --kretprobe, --event, --probe, --graph and --handlers on check and
instrument, alone or with a spec file; their errors name the option."""
import json

import pytest

from conftest import ALL_ARCHES, CROSS, FACTS, attributed, cc, kprewrite, profile, run, write_spec

ARCHES = ALL_ARCHES

RUNNER = "qemu" if CROSS else "native"
ARG0 = FACTS.ARG_REGS[0]     # the first argument's register, as perf probe names it

PROG = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((noinline)) int work(int x) { return x * 3 + 1; }
__attribute__((noinline)) int other(int x) { return work(x) + 2; }
__attribute__((noinline)) int other2(int x) { return work(x) + 5; }
int main(int argc, char **argv)
{
    int n = argc > 1 ? atoi(argv[1]) : 3, s = 0;
    for (int i = 0; i < n; i++)
        s += other(i) + other2(i);
    printf("sum = %d\n", s);
    return 0;
}
"""

HANDLERS = r"""
#include <kprewrite/kprobes.h>
int pre(struct kprobe *p, struct pt_regs *regs)
{
    pr_info("pre %s x=%d\n", p->symbol_name, (int)regs_get_kernel_argument(regs, 0));
    return 0;
}
"""


def _prog(tmp):
    return cc(tmp, "prog", PROG, "-O2", "-g")


def test_instrument_with_options_only(tmp_path):
    """No spec file: a kprobe with a handler, a kretprobe, a glob and an event line, each
    counted exactly when the rewrite runs."""
    prog = _prog(tmp_path)
    (tmp_path / "h.c").write_text(HANDLERS)
    out = tmp_path / "prog.kp"
    kprewrite("instrument", prog, "--handlers", "h.c", "--kprobe", "work pre_handler=pre",
              "--kretprobe", "other", "--kprobe", "other*", "--event", "p:ev work x=$arg1:s32", "-o", out,
              cwd=tmp_path)
    attributed(prog, out)
    r = run(out, 4, env={"KPREWRITE_PROFILE": "-"}, runner=RUNNER)
    assert r.returncode == 0 and r.stdout == "sum = 72\n", r.stderr
    prof = profile(r.stderr)
    assert prof == {"p_work_0": (8, 0), "r_other_0": (4, 0), "p_other_0": (4, 0), "p_other2_0": (4, 0),
                    "ev": (8, 0)}, prof
    assert r.stderr.count("pre work x=") == 8
    ev = [line.split(" ev: ")[1] for line in r.stderr.splitlines() if " ev: " in line]
    assert [e.split(") ")[1] for e in ev] == ["x=0", "x=0", "x=1", "x=1", "x=2", "x=2", "x=3", "x=3"], ev
    assert all(e.startswith("(work+0x0/") for e in ev), ev


def test_options_and_spec_combine(tmp_path):
    """A spec file's probes first, then the options': the same output as one spec with both."""
    prog = _prog(tmp_path)
    both = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n[[kprobe]]\nsymbol_name = "other"\n'
                                '[[kretprobe]]\nsymbol_name = "other2"\nmaxactive = 4\n', name="both.toml")
    one = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\n', name="one.toml")
    kprewrite("instrument", prog, "--spec", both, "-o", tmp_path / "a.kp")
    kprewrite("instrument", prog, "--spec", one, "--kprobe", "other", "--kretprobe", "other2 maxactive=4",
              "-o", tmp_path / "b.kp")
    assert (tmp_path / "a.kp").read_bytes() == (tmp_path / "b.kp").read_bytes()
    c = kprewrite("check", prog, "--spec", one, "--kprobe", "other", "--kretprobe", "other2").stdout.splitlines()
    assert [line.split("  ")[0] for line in c] == ["work+0x0", "other+0x0", "other2+0x0"], c


def test_check_probe_definition(tmp_path):
    """--probe: a perf probe definition, what it compiled to named by the option."""
    prog = _prog(tmp_path)
    r = kprewrite("check", prog, "--probe", "work x")
    assert r.stdout.splitlines()[-1].startswith(f"--probe 'work x': p:probe_prog/work work x={ARG0}:s32"), r.stdout
    d = json.loads(kprewrite("check", prog, "--probe", "work x", "--format", "json").stdout)
    assert d["compiled"] == [{"table": "--probe 'work x'", "event": f"p:probe_prog/work work x={ARG0}:s32"}]


def test_graph_option(tmp_path):
    """--graph GLOB is a [[function_graph]] table: a kprobe and a kretprobe per function."""
    prog = _prog(tmp_path)
    lines = kprewrite("check", prog, "--graph", "other*").stdout.splitlines()
    assert [line.split("  ")[:2] for line in lines] == [["other+0x0", "k"], ["other2+0x0", "k"],
                                                       ["other+0x0", "r"], ["other2+0x0", "r"]], lines


def _errors(*args):
    r = kprewrite(*args, check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr and not r.stdout, r
    return r.stderr.splitlines()


def test_errors_name_the_option(tmp_path):
    prog = _prog(tmp_path)
    assert _errors("check", prog, "--kprobe", "nosuch") == [
        "kprewrite: --kprobe 'nosuch': symbol 'nosuch' not found in prog"]
    assert _errors("check", prog, "--kretprobe", "nosuch*") == [
        "kprewrite: --kretprobe 'nosuch*': symbol_name 'nosuch*' matches no function in prog"]
    assert _errors("check", prog, "--kprobe", "work pre_handlr=x", "--kprobe", "work x") == [
        "kprewrite: --kprobe 'work pre_handlr=x': unknown key 'pre_handlr' (did you mean 'pre_handler'?)",
        "kprewrite: --kprobe 'work x': 'x' is not KEY=VALUE (a key of [[kprobe]] other than symbol_name and addr)"]
    assert _errors("check", prog, "--kprobe", "work+z") == ["kprewrite: --kprobe 'work+z': offset 'z' is not a number"]
    assert _errors("check", prog, "--kretprobe", "work maxactive=many") == [
        "kprewrite: --kretprobe 'work maxactive=many': 'maxactive' must be an integer, got \"many\""]
    err = _errors("check", prog, "--event", "p:ev work x=%zz")
    assert err[0].startswith("kprewrite: --event 'p:ev work x=%zz': column 13: Invalid register name"), err
    assert err[1:] == ["kprewrite:   Command: p:ev work x=%zz", "kprewrite:" + " " * 24 + "^"], err
    assert _errors("check", prog, "--probe", "nosuchf x") == [
        "kprewrite: --probe 'nosuchf x': function 'nosuchf' not found in the debug information of prog"]
    assert _errors("instrument", prog, "--kprobe", "work pre_handler=pre", "-o", tmp_path / "x.kp") == [
        "kprewrite: --kprobe 'work pre_handler=pre': pre_handler 'pre' is not defined in any handler file "
        "(none listed)"]
    assert not (tmp_path / "x.kp").exists()
    assert _errors("check", prog, "--kprobe", "work", "--handlers", "nosuch.c")[0].startswith(
        "kprewrite: --handlers: handler file 'nosuch.c': no such file")
    assert _errors("check", prog) == ["kprewrite: no probes: give --spec FILE, or probes as --kprobe SYM, "
                                      "--kretprobe SYM, --event LINE or --probe DEF"]
    # A spec file's probes keep the file's name; the options' their own.
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "gone"\n')
    assert _errors("check", prog, "--spec", spec, "--kprobe", "nosuch") == [
        "kprewrite: probes.toml: [[kprobe]] #1: symbol 'gone' not found in prog",
        "kprewrite: --kprobe 'nosuch': symbol 'nosuch' not found in prog"]


def test_api_takes_the_options(tmp_path):
    """The Python API's check() and instrument() take the same probes."""
    import rewriter
    prog = _prog(tmp_path)
    r = rewriter.check(prog, kprobes=["work"], kretprobes=["other"])
    assert [(p["symbol"], p["kind"]) for p in r.probes] == [("work", "k"), ("other", "r")]
