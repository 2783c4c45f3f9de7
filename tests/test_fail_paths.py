"""The failure paths of the commands: a failure writes no output (OUTPUT and its depfile
both, or neither), an output that is its input under another name is refused, a reader
that goes away ends the command quietly, Ctrl-C exits 130, a missing HOME is not made,
and what `instrument` refuses `check` refuses too.  Each runs the real CLI on a program
gcc built."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ALL_ARCHES, CC, CROSS, KPREWRITE, ROOT, TREE_ENV, cc, kprewrite, run, write_spec

ARCHES = ALL_ARCHES
LOCAL = "qemu" if CROSS else "native"      # the runner of the tests that run once

PROGRAM = r"""
#include <stdio.h>
__attribute__((noinline)) int work(int x) { return x * x * 3 + x / 7 + 1; }
int main(int argc, char **argv) { printf("%d\n", work(argc)); return 0; }
"""
HANDLERS = r"""
#include <kprewrite/kprobes.h>
int h(struct kprobe *p, struct pt_regs *r) { pr_info("hit\n"); return 0; }
"""
SPEC = 'handlers = ["handlers.c"]\n[[kprobe]]\nsymbol_name = "work"\npre_handler = "h"\n'


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    return cc(tmp_path_factory.mktemp("fail_paths"), "prog", PROGRAM, "-O2")


def digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def one_error(r: subprocess.CompletedProcess, *want: str) -> str:
    """r failed with exactly one error line holding each of `want`, and no traceback."""
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kprewrite: "), lines
    for w in want:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# --- no output on failure ---------------------------------------------------------------------

def test_depfile_that_cannot_be_written_leaves_no_output(tmp_path, prog):
    spec = write_spec(tmp_path, SPEC, HANDLERS)
    out = tmp_path / "out"
    r = kprewrite("instrument", prog, "--spec", spec, "-o", out, "--depfile", "/no/such/dir/d.d", check=False)
    one_error(r, "/no/such/dir/d.d: cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["handlers.c", "probes.toml"]
    # The same through the Python API.
    import rewriter
    with pytest.raises(rewriter.KprewriteError, match="/no/such/dir/d.d: cannot write"):
        rewriter.instrument(prog, spec, out, depfile="/no/such/dir/d.d")
    assert not out.exists()
    # A depfile that is a folder: the same.
    (tmp_path / "dir.d").mkdir()
    r = kprewrite("instrument", prog, "--spec", spec, "-o", out, "--depfile", tmp_path / "dir.d", check=False)
    one_error(r, "dir.d")
    assert not out.exists()
    # And the good case writes both.
    kprewrite("instrument", prog, "--spec", spec, "-o", out, "--depfile", tmp_path / "out.d")
    assert out.exists() and (tmp_path / "out.d").read_text().startswith(f"{out}:")


# --- an output that is an input ---------------------------------------------------------------

def test_output_through_a_link_to_the_input_is_refused(tmp_path, prog):
    p = tmp_path / "program"
    p.write_bytes(prog.read_bytes())
    p.chmod(0o755)
    before = digest(p)
    spec = write_spec(tmp_path, SPEC, HANDLERS)
    (tmp_path / "plink").symlink_to("program")
    os.link(p, tmp_path / "hard")
    for inp, out in (("plink", "program"), ("program", "plink"), ("hard", "program")):
        r = kprewrite("instrument", inp, "--spec", spec, "-o", out, check=False, cwd=tmp_path)
        one_error(r, f"{out}: is INPUT ({inp})")
        assert digest(p) == before
    r = kprewrite("instrument", "program", "--spec", spec, "-o", "o", "--depfile", "plink", check=False, cwd=tmp_path)
    one_error(r, "plink: is INPUT (program)")
    assert digest(p) == before and not (tmp_path / "o").exists()
    r = kprewrite("instrument", "program", "--spec", spec, "-o", "probes.toml", check=False, cwd=tmp_path)
    one_error(r, "probes.toml: is the spec")
    assert (tmp_path / "probes.toml").read_text() == SPEC


def test_trace_and_report_do_not_write_over_their_input(tmp_path):
    t = tmp_path / "trace.txt"
    text = "           prog-1 [000] 1.000000: p_work_0: (work+0x0/0x10)\n"
    t.write_text(text)
    (tmp_path / "link.txt").symlink_to("trace.txt")
    for out in ("trace.txt", "link.txt"):
        one_error(kprewrite("trace", "trace.txt", "-o", out, check=False, cwd=tmp_path), f"{out}: is FILE (trace.txt)")
        assert t.read_text() == text
    t2 = tmp_path / "t.svg"
    t2.write_text(text)
    one_error(kprewrite("report", "t.svg", "--plot", "t.svg", check=False, cwd=tmp_path), "t.svg: is TRACE (t.svg)")
    assert t2.read_text() == text
    kprewrite("trace", "trace.txt", "-o", "out.jsonl", cwd=tmp_path)
    assert '"event": "p_work_0"' in (tmp_path / "out.jsonl").read_text()


# --- what instrument refuses, check refuses -----------------------------------------------------

def test_already_rewritten_input_is_refused(tmp_path, prog):
    spec = write_spec(tmp_path, SPEC, HANDLERS)
    kp = tmp_path / "prog.kp"
    kprewrite("instrument", prog, "--spec", spec, "-o", kp)
    before = digest(kp)
    for cmd in (("instrument", kp, "--spec", spec, "-o", tmp_path / "twice"), ("check", kp, "--spec", spec)):
        one_error(kprewrite(*cmd, check=False), f"{kp}: already rewritten by kprewrite", ".kprewrite.meta")
    assert not (tmp_path / "twice").exists() and digest(kp) == before


@pytest.mark.parametrize("text", ["", 'handlers = ["handlers.c"]\noptimize = false\n', "events = []\n"])
def test_empty_spec_is_an_error(tmp_path, prog, text):
    spec = write_spec(tmp_path, text, HANDLERS, name="empty.toml")
    for cmd in (("instrument", prog, "--spec", spec, "-o", tmp_path / "out"), ("check", prog, "--spec", spec)):
        one_error(kprewrite(*cmd, check=False), "empty.toml: the spec defines no probes")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("handlers, want", [
    ("int other(void *p, void *r) { return 0; }\n", "pre_handler 'h' is not defined in any handler file (handlers.c)"),
    ("int h(void *p, void *r) { return undefined_thing; }\n", "undefined_thing"),
])
def test_check_refuses_the_handlers_instrument_refuses(tmp_path, prog, handlers, want):
    spec = write_spec(tmp_path, SPEC, handlers)
    r = kprewrite("instrument", prog, "--spec", spec, "-o", tmp_path / "out", check=False)
    assert r.returncode == 1 and want in r.stderr and not (tmp_path / "out").exists()
    c = kprewrite("check", prog, "--spec", spec, check=False)
    assert c.returncode == 1 and "Traceback" not in c.stderr
    assert want in c.stderr, c.stderr
    assert c.stdout.startswith("work+0x0  k  optimized")      # the plan is still printed
    import rewriter
    assert any(want in e for e in rewriter.check(prog, spec).errors)


# --- the process: a closed pipe, Ctrl-C, HOME ----------------------------------------------------

@pytest.mark.parametrize("cmd", ["blacklist", "check", "diff"])
def test_closed_standard_output_ends_quietly(tmp_path, prog, cmd):
    """`kprewrite blacklist IMAGE | head -1`: the reader has gone before the output is written."""
    spec = write_spec(tmp_path, SPEC, HANDLERS)
    kp = tmp_path / "prog.kp"
    if cmd == "diff":
        kprewrite("instrument", prog, "--spec", spec, "-o", kp)
    args = {"blacklist": ["blacklist", prog], "check": ["check", prog, "--spec", spec], "diff": ["diff", prog, kp]}[cmd]
    r_fd, w_fd = os.pipe()
    os.close(r_fd)                  # no reader at all: the first write fails with EPIPE
    p = subprocess.run([*KPREWRITE, *map(str, args)], stdout=w_fd, stderr=subprocess.PIPE, text=True, env=TREE_ENV)
    os.close(w_fd)
    assert p.stderr == ""
    assert p.returncode == 128 + signal.SIGPIPE


def test_ctrl_c_exits_130_and_writes_nothing(tmp_path, prog):
    """SIGINT while gcc compiles the handlers (a CC that says when it starts, then waits)."""
    marker = tmp_path / "compiling"
    wrapper = tmp_path / "cc"
    wrapper.write_text(f"#!/bin/sh\ncase \"$*\" in *handler0.c*) touch {marker}; sleep 60;; esac\nexec {CC} \"$@\"\n")
    wrapper.chmod(0o755)
    spec = write_spec(tmp_path, SPEC, HANDLERS)
    out = tmp_path / "out"
    p = subprocess.Popen([*KPREWRITE, "instrument", str(prog), "--spec", str(spec), "-o", str(out)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**TREE_ENV, "CC": str(wrapper)})
    deadline = time.monotonic() + 60
    while not marker.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), p.communicate()
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=30)
    assert p.returncode == 130, stderr
    assert stderr == "kprewrite: interrupted\n"
    assert not out.exists() and not [f for f in tmp_path.iterdir() if f.name.startswith(".kprewrite-")]


def test_missing_home_is_not_created(tmp_path, prog):
    home = tmp_path / "no" / "home"
    env = {k: v for k, v in TREE_ENV.items() if k not in ("KPREWRITE_CACHE", "XDG_CACHE_HOME")}
    env["HOME"] = str(home)
    spec = write_spec(tmp_path, SPEC, HANDLERS)
    for cmd in (["check", prog, "--spec", spec], ["instrument", prog, "--spec", spec, "-o", tmp_path / "out"]):
        r = subprocess.run([*KPREWRITE, *map(str, cmd)], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        assert not (tmp_path / "no").exists()
    assert run(tmp_path / "out", "x", runner=LOCAL).stderr.count("hit") == 1


# --- probes by name ------------------------------------------------------------------------------

A_C = "static __attribute__((noinline)) int f(int x) { return x * 3 + 1; }\nint call_a(int x) { return f(x); }\n"
B_C = "static __attribute__((noinline)) int f(int x) { return x * 5 + 2; }\nint call_b(int x) { return f(x); }\n"
MAIN_C = r"""
#include <stdio.h>
int call_a(int); int call_b(int);
int main(int argc, char **argv) { printf("%d %d\n", call_a(argc), call_b(argc)); return 0; }
"""


def test_return_probe_on_one_of_two_static_functions(tmp_path):
    """`f@b.c%return` with a static f in a.c and in b.c: b.c's f, as `f@b.c` at the entry is."""
    for name, text in (("a.c", A_C), ("b.c", B_C)):
        (tmp_path / name).write_text(text)
    prog = cc(tmp_path, "prog", MAIN_C, "-g", "-O1", str(tmp_path / "a.c"), str(tmp_path / "b.c"))
    spec = write_spec(tmp_path, 'probes = ["f@b.c%return $retval", "f@a.c%return $retval"]\n')
    lines = kprewrite("check", prog, "--spec", spec).stdout.splitlines()
    assert [l.split()[1] for l in lines[:2]] == ["r", "r"], lines
    out = tmp_path / "prog.kp"
    kprewrite("instrument", prog, "--spec", spec, "-o", out)
    r = run(out, "x", "y", runner=LOCAL)                 # argc = 3: a's f gives 10, b's 17
    assert r.stdout == "10 17\n"
    got = {l.split()[3]: l.split()[-1] for l in r.stderr.splitlines() if "f__return" in l}
    assert got == {"f__return:": "retval=17", "f__return_1:": "retval=10"}, r.stderr
