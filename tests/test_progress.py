"""Progress of a rewrite: one bar over the pipeline's stages, with
counts, when standard error is a terminal (here a pseudo-terminal); nothing when
it is not; nothing at all with --quiet."""
from __future__ import annotations

import os
import pty
import re
import select
import subprocess

from conftest import ALL_ARCHES, KPREWRITE, TREE_ENV, cc, kprewrite, write_spec

ARCHES = ALL_ARCHES

PROG = r"""
#include <stdio.h>
__attribute__((noinline)) int work(int x) { return x * 2 + 1; }
int main(void) { printf("%d\n", work(20)); return 0; }
"""
SPEC = '[[kprobe]]\nsymbol_name = "work"\n[[kretprobe]]\nsymbol_name = "work"\n'
STAGES = ["loading", "resolving", "analysing", "planning", "compiling", "emitting", "linking", "writing"]


def on_terminal(*args) -> tuple[int, str, str]:
    """Runs the CLI with standard error on a pseudo-terminal: (status, stdout, what the terminal got)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([*KPREWRITE, *map(str, args)], stdout=subprocess.PIPE, stderr=slave, env=TREE_ENV)
    os.close(slave)
    got = b""
    while True:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:        # the child closed the terminal
                break
            if not chunk:
                break
            got += chunk
        elif p.poll() is not None:
            break
    os.close(master)
    out = p.stdout.read().decode()
    return p.wait(), out, got.decode()


def test_progress_on_a_terminal_only(tmp_path):
    prog = cc(tmp_path, "prog", PROG, "-O2")
    spec = write_spec(tmp_path, SPEC)
    rc, out, term = on_terminal("instrument", prog, "--spec", spec, "-o", tmp_path / "a")
    assert rc == 0 and out == ""
    plain = re.sub(r"\x1b\[\?25[lh]", "", term)       # click hides the cursor while it draws
    labels = [seg.split("  [")[0].strip() for seg in plain.split("\r") if "kprewrite: " in seg]
    stages = [lab.split()[1] for lab in labels]
    assert [s for i, s in enumerate(stages) if i == 0 or stages[i - 1] != s] == STAGES, term
    assert "kprewrite: loading prog" in labels and "8/8" in term and term.endswith("\n")
    assert any(lab.startswith("kprewrite: analysing ") and lab.endswith(" functions, 2 probes") for lab in labels), labels
    assert any(lab.startswith("kprewrite: emitting 1 sites, ") for lab in labels), labels
    # --quiet: not even progress.  Not a terminal: nothing either.  The same bytes each time.
    rc, out, term = on_terminal("instrument", prog, "--spec", spec, "-o", tmp_path / "b", "--quiet")
    assert rc == 0 and out == term == ""
    r = kprewrite("instrument", prog, "--spec", spec, "-o", tmp_path / "c")
    assert r.stdout == r.stderr == ""
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes() == (tmp_path / "c").read_bytes()


def test_progress_then_one_error_line(tmp_path):
    """A failure on a terminal: the bar ends its line, then the usual one error line."""
    prog = cc(tmp_path, "prog", PROG, "-O2")
    spec = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "work"\noffset = 1\n')
    rc, out, term = on_terminal("instrument", prog, "--spec", spec, "-o", tmp_path / "a")
    assert rc == 1 and out == "" and not (tmp_path / "a").exists()
    last = term.replace("\r\n", "\n").split("\n")[-2]
    assert last.startswith("kprewrite: probes.toml: [[kprobe]] #1 (work+0x1): ") and "instruction boundary" in last, term
