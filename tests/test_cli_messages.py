"""One wording per kind of error (docs/reference/cli.md#rules-common-to-every-command):
`PATH: no such file`, `PATH: is a directory`, `PATH: cannot write: no such directory`,
the path as the user gave it, from every command and option that takes a file; and
`diff` naming the breakpoint each architecture writes (int3, AArch64's brk: tests/arches/)."""
import shutil

import pytest

from conftest import ALL_ARCHES, ALL_FACTS, ARCH, CROSS, cc, compiler, kprewrite, run

ARCHES = ALL_ARCHES

PROG = r"""
#include <stdio.h>
__attribute__((noinline)) int f(int x) { return x * 2 + 1; }
int main(void) { printf("%d\n", f(f(1))); return 0; }
"""


def _err(*args, cwd=None):
    r = kprewrite(*args, check=False, cwd=cwd)
    assert r.returncode != 0 and not r.stdout and "Traceback" not in r.stderr, r
    return r.stderr


def test_file_errors(tmp_path):
    prog = cc(tmp_path, "prog", PROG, "-O1")
    (tmp_path / "adir").mkdir()
    (tmp_path / "h.c").write_text("")
    (tmp_path / "t.txt").write_text("")
    given = "./sub/../nosuch"      # the path as given, not resolved
    for cmd in (["check", "{}", "--kprobe", "f"], ["instrument", "{}", "--kprobe", "f", "-o", "out"], ["list", "{}"],
                ["blacklist", "{}"], ["funcs", "{}"], ["probe-vars", "{}", "f"], ["probe-lines", "{}", "f"],
                ["trace", "{}"], ["report", "{}"], ["diff", "{}", "prog"], ["diff", "prog", "{}"],
                ["check", "prog", "--spec", "{}"], ["record", "--kprobe", "f", "--", "{}"],
                ["record", "--spec", "{}", "--", "./prog"], ["replay", "{}"]):
        if cmd[0] in ("record", "replay") and cmd[0] not in kprewrite("-h", cwd=tmp_path).stdout:
            continue
        # (record's PROG without a slash is looked for on PATH, as a shell does)
        for path, kind in ((given, "no such file"), ("./adir" if cmd[-2] == "--" else "adir", "is a directory")):
            err = _err(*[a.replace("{}", path) for a in cmd], cwd=tmp_path)
            assert err == f"kprewrite: {path}: {kind}\n", (cmd, err)
    # handler files, given by option (relative to the current folder) or in a spec
    assert _err("check", "prog", "--kprobe", "f", "--handlers", "nosuch.c", cwd=tmp_path) == \
        "kprewrite: --handlers: handler file 'nosuch.c': no such file\n"
    assert _err("check", "prog", "--kprobe", "f", "--handlers", "adir", cwd=tmp_path) == \
        "kprewrite: --handlers: handler file 'adir': is a directory\n"
    # what is written: OUTPUT, --depfile, trace -o, report --plot
    for args, path in ((["instrument", "prog", "--kprobe", "f", "-o", "{}"], "out"),
                       (["instrument", "prog", "--kprobe", "f", "-o", "o.kp", "--depfile", "{}"], "dep"),
                       (["trace", "t.txt", "-o", "{}"], "trace.json"),
                       (["record", "--kprobe", "f", "-o", "{}", "--", "./prog"], "rec.data")):
        if args[0] == "trace":
            (tmp_path / "t.txt").write_text("prog-1 [000] 1.000000: ev: (f+0x0/0x4) x=1\n")
        assert _err(*[a.replace("{}", "adir") for a in args], cwd=tmp_path) == "kprewrite: adir: is a directory\n"
        assert _err(*[a.replace("{}", f"nodir/{path}") for a in args], cwd=tmp_path) == \
            f"kprewrite: nodir/{path}: cannot write: no such directory\n"
    assert not (tmp_path / "o.kp").exists()


@pytest.mark.parametrize("arch", ALL_ARCHES)
def test_diff_names_the_breakpoint(tmp_path, arch):
    """A breakpoint probe in `diff`: `int3 (MODE)` on x86-64, `brk (MODE)` on AArch64, for a
    kprobe's site and a kretprobe's return hook alike; never another architecture's word."""
    gcc = compiler(arch)
    if not shutil.which(gcc):
        pytest.skip(f"no {gcc}")
    src = tmp_path / "prog.c"
    src.write_text(PROG)
    prog = tmp_path / "prog"
    import subprocess
    subprocess.run([gcc, "-O1", "-o", str(prog), str(src)], check=True)
    kprewrite("instrument", prog, "--kprobe", "f", "--kretprobe", "main", "--no-optimize", "-o", tmp_path / "prog.kp")
    lines = kprewrite("diff", prog, tmp_path / "prog.kp").stdout.splitlines()
    word = ALL_FACTS[arch].BREAKPOINT
    others = {f.BREAKPOINT for f in ALL_FACTS.values()} - {word}
    assert others, "one word per architecture"
    site = [line for line in lines if "  kprobe  f+0x0: " in line]
    assert len(site) == 1 and f"f+0x0: {word} (" in site[0], lines
    assert not any(f" {other}" in line for line in lines for other in others), lines
    if arch == ARCH:
        r = run(tmp_path / "prog.kp", env={"KPREWRITE_PROFILE": "-"}, runner="qemu" if CROSS else "native")
        assert r.stdout == "7\n", r
