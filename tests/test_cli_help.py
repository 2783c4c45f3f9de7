"""Help like a Unix tool (docs/reference/cli.md#help-manual-pages-and-completion): -h is
--help; each command's help ends with examples that parse as the command's options; a
manual page per command made from the click program, which man renders with every
option; no help text points at a file a wheel does not install; shell completion; the gdb
helper found from the package.  (The wheel's share/man/man1 and `man kprewrite` in its
venv: tests/test_wheel.py.)"""
import os
import shlex
import shutil
import subprocess

import click
import pytest

from conftest import ALL_ARCHES, ARCH, cc, kprewrite, KPREWRITE, TREE_ENV

ARCHES = ALL_ARCHES

from rewriter.cli import main

COMMANDS = sorted(main.commands)


def _examples(name: str) -> list[list[str]]:
    text = kprewrite(name, "-h").stdout
    assert "\nExamples:\n" in text.replace("  Examples:", "Examples:"), text
    lines = text.split("Examples:", 1)[1].splitlines()
    return [shlex.split(line.split("  #")[0].split(" | ")[0]) for line in lines if line.strip().startswith("kprewrite ")]


def test_help_and_examples():
    top = kprewrite("-h").stdout
    assert top == kprewrite("--help").stdout and "Commands:" in top
    for name in COMMANDS:
        assert name in top
        h = kprewrite(name, "-h")
        assert h.stdout == kprewrite(name, "--help").stdout and h.stdout.startswith(f"Usage: kprewrite {name} ")
        examples = _examples(name)
        assert any(e[1] == name for e in examples), (name, examples)
        for argv in examples:
            # each example is a valid command line: its command exists and click parses its options
            cmd = main.commands[argv[1]]
            with cmd.make_context(argv[1], argv[2:]) as ctx:
                assert ctx.params is not None, argv


def test_help_points_at_no_file_a_wheel_lacks():
    """A wheel installs the package, the runtime and the gdb helper: no help text may send
    the user to docs/, tools/ or a *.md file of the source tree."""
    for args in [["-h"], *([n, "-h"] for n in COMMANDS)]:
        text = kprewrite(*args).stdout
        for bad in ("docs/", "tools/", ".md", "samples/"):
            assert bad not in text, (args, bad, text)


@pytest.mark.skipif(not shutil.which("man"), reason="man not installed")
def test_man_pages(tmp_path):
    listed = kprewrite("man", "-o", tmp_path / "man1").stdout.split()
    want = ["kprewrite.1"] + [f"kprewrite-{n}.1" for n in COMMANDS]
    assert sorted(os.path.basename(p) for p in listed) == sorted(want)
    env = {**os.environ, "MANWIDTH": "100", "MANPAGER": "cat", "PAGER": "cat"}
    env.pop("MANPATH", None)
    for page in want:
        path = tmp_path / "man1" / page
        name = page.removesuffix(".1")
        roff = path.read_text()
        assert roff == kprewrite("man", *([name.split("-", 1)[1]] if "-" in name else [])).stdout
        r = subprocess.run(["man", "--warnings", "-l", str(path)], capture_output=True, text=True, env=env)
        assert r.returncode == 0 and not r.stderr, (page, r.stderr)
        text = r.stdout.replace("\u2010", "-").replace("\u2212", "-")
        assert text.startswith(name.upper() + "(1)"), text[:200]
        assert "\nNAME\n" in text and "\nSYNOPSIS\n" in text and "\nSEE ALSO\n" in text, text
        if name == "kprewrite":
            for n in COMMANDS:
                assert f"kprewrite-{n}(1)" in text, (n, text)
            assert "_KPREWRITE_COMPLETE=bash_source kprewrite" in text, text
            continue
        cmd = main.commands[name.split("-", 1)[1]]
        assert f"kprewrite {cmd.name} [OPTIONS]" in " ".join(text.split()), text
        assert "\nEXAMPLES\n" in text, text
        for p in cmd.params:
            if isinstance(p, click.Option):
                for opt in p.opts:
                    assert opt in text, (page, opt)
        examples = kprewrite(cmd.name, "-h").stdout.split("Examples:", 1)[1].strip().splitlines()
        for line in examples:
            assert " ".join(line.split()) in " ".join(text.split()), (page, line)
    # deterministic: the same bytes again
    again = tmp_path / "again"
    kprewrite("man", "-o", again)
    assert all((again / p).read_bytes() == (tmp_path / "man1" / p).read_bytes() for p in want)


def test_shell_completion():
    env = {**TREE_ENV, "_KPREWRITE_COMPLETE": "bash_source"}
    src = subprocess.run(KPREWRITE, capture_output=True, text=True, env=env)
    assert src.returncode == 0 and "complete -o nosort -F _kprewrite_completion kprewrite" in src.stdout, src
    env = {**TREE_ENV, "_KPREWRITE_COMPLETE": "bash_complete", "COMP_WORDS": "kprewrite fu", "COMP_CWORD": "1"}
    r = subprocess.run(KPREWRITE, capture_output=True, text=True, env=env)
    assert r.stdout.split() == ["plain,funcs"], r
    env.update(COMP_WORDS="kprewrite check prog --kr", COMP_CWORD="3")
    r = subprocess.run(KPREWRITE, capture_output=True, text=True, env=env)
    assert r.stdout.split() == ["plain,--kretprobe"], r


@pytest.mark.skipif(not shutil.which("gdb") or ARCH != "x86_64", reason="gdb, natively")
def test_gdb_command(tmp_path):
    """`kprewrite gdb PROG ARGS`: gdb with the helper loaded; kp-run passes the SIGTRAPs of a
    breakpoint probe on, and the program's output is its own."""
    helper = kprewrite("gdb", "--print-path").stdout.strip()
    assert os.path.isfile(helper) and helper.endswith("kprewrite-gdb.py")
    prog = cc(tmp_path, "prog", '#include <stdio.h>\n__attribute__((noinline)) int f(int x) { return x + 1; }\n'
                                'int main(void) { printf("%d\\n", f(f(1))); return 0; }\n', "-O1")
    kprewrite("instrument", prog, "--kprobe", "f", "--no-optimize", "-o", tmp_path / "prog.kp")
    r = subprocess.run([*KPREWRITE, "gdb", tmp_path / "prog.kp"], input="kp-run\n", capture_output=True, text=True,
                       env=TREE_ENV, timeout=120)
    assert "\n3\n" in r.stdout and "exited normally" in r.stdout, r.stdout + r.stderr
    r = kprewrite("gdb", check=False)
    assert r.returncode != 0 and r.stderr == "kprewrite: name the program to debug: kprewrite gdb PROG [ARGS]...\n"
