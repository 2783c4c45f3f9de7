"""The README's kernel quick start, run as written: its shell block (the first indented block
under "## Kernel quick start") pasted into bash in an empty folder that has the repository's
samples/ and `kprewrite` on PATH, as a user at the repository's folder has.  It fetches
Debian's cloud kernel with apt-get download, checks and rewrites it, and boots it with
`kprewrite boot`: the kernel's kprobe_example handlers fire on kernel_clone, and the profile
the --run command prints counts them."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.kernel

ROOT = Path(__file__).resolve().parents[2]


def quickstart_block() -> str:
    """The commands of the README's kernel quick start, as a user would paste them."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Kernel quick start\n", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"\n\n((?:    \S.*\n)+)", section)
    assert m, "no indented block in the README's kernel quick start"
    return "".join(line[4:] + "\n" for line in m.group(1).splitlines())


def test_the_readme_kernel_quick_start_runs_as_written(tmp_path):
    block = quickstart_block()
    assert "apt-get download" in block and "kprewrite boot vmlinuz.kp" in block
    work, bindir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bindir.mkdir()
    (work / "samples").symlink_to(ROOT / "samples")
    exe = bindir / "kprewrite"      # this tree's CLI, as `pip install .` would put it on PATH
    exe.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} -m rewriter \"$@\"\n")
    exe.chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block], cwd=work, env=env, capture_output=True,
                       text=True, timeout=1200)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert (work / "vmlinuz.kp").is_file()
    hits = r.stdout.count("handler_pre: <kernel_clone>")
    assert hits >= 1, r.stdout[-3000:]
    # The --run command's profile: the kprobe's row counts every hit the console showed so far
    # (later forks of the power-off path may add a few).
    m = re.search(r"^\s*p_kernel_clone_0\s+(\d+)\s+0\s*$", r.stdout, re.M)
    assert m and int(m.group(1)) >= 1, r.stdout[-3000:]
    assert "kprewrite-boot: init done" in r.stdout and "reboot: Power down" in r.stdout


def test_boot_refuses_what_is_not_a_kernel(tmp_path):
    """`kprewrite boot` of a user program or a non-ELF file: one line, no QEMU started."""
    (tmp_path / "junk").write_text("not an image\n")
    for path, why in (("/bin/true", "not a kernel image (boot takes a vmlinux, a bzImage or an arm64 Image)"),
                      (str(tmp_path / "junk"), "not an ELF file")):
        r = subprocess.run([sys.executable, "-m", "rewriter", "boot", path], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 1 and not r.stdout, r
        assert r.stderr.strip().splitlines() == [f"kprewrite: {path}: {why}"], r.stderr
