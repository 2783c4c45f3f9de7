"""Packaging: `python -m build` makes an sdist and, from it, a wheel that
carries the C runtime as package data (rewriter/_runtime), the gdb helper
(rewriter/_tools) and the manual pages (share/man/man1); the wheel, installed in a
fresh venv, runs the README's quick start from a folder outside the tree with its own
`kprewrite` (not this tree's, not the editable install of another checkout), and
rewrites to the same bytes as this tree does."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from conftest import KPREWRITE, ROOT, TREE_ENV

import rewriter

ARCHES = ["x86_64"]      # x86-64 only: packaging, with the host's gcc: nothing depends on the arch under test

SAMPLE = ROOT / "samples" / "kprobe_example"
RUNTIME_FILES = sorted(str(p.relative_to(ROOT / "runtime")) for p in (ROOT / "runtime").rglob("*")
                       if p.is_file() and p.suffix in (".c", ".h", ".S"))


def sh(cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd}:\n{r.stdout}\n{r.stderr}"
    return r


def test_wheel_quick_start(tmp_path):
    assert importlib.util.find_spec("build"), "no `build` module: pip install -e '.[test]'"
    # Build from a copy: no build/ or *.egg-info left in the tree, no stale build/ taken in.
    src, dist = tmp_path / "src", tmp_path / "dist"
    patterns = shutil.ignore_patterns(".git", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "*.o")
    # The top-level build/ only (a package of the tree may be named so).
    shutil.copytree(ROOT, src, ignore=lambda d, names: set(patterns(d, names)) | ({"build"} if Path(d) == ROOT else set()))
    sh([sys.executable, "-m", "build", "--outdir", dist, src])   # sdist, then the wheel from the sdist
    sdist, = dist.glob("kprewrite-*.tar.gz")
    wheel, = dist.glob("kprewrite-*.whl")
    with tarfile.open(sdist) as t:
        top = t.getnames()[0].split("/")[0]
        assert {f"{top}/runtime/{f}" for f in RUNTIME_FILES} <= set(t.getnames())
    with zipfile.ZipFile(wheel) as z:
        assert sorted(n.removeprefix("rewriter/_runtime/") for n in z.namelist()
                      if n.startswith("rewriter/_runtime/")) == RUNTIME_FILES

    # A fresh venv: the dependencies (lief, capstone, keystone...) from the system's
    # site-packages, kprewrite from the wheel only.
    venv = tmp_path / "venv"
    sh([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv])
    py, exe = venv / "bin" / "python", venv / "bin" / "kprewrite"
    sh([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--disable-pip-version-check", wheel])
    work = tmp_path / "quickstart"
    shutil.copytree(SAMPLE, work)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KPREWRITE_RUNTIME")}
    env["KPREWRITE_CACHE"] = str(tmp_path / "cache")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"

    def run(*cmd, **kw):
        return sh(cmd, cwd=work, env={**env, **kw})

    assert run(exe, "--version").stdout == f"kprewrite, version {rewriter.__version__}\n"
    site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
    where = run(py, "-c", "import rewriter, rewriter.link as l; print(rewriter.__file__); print(l.RUNTIME_DIR)")
    assert where.stdout.splitlines() == [str(site / "rewriter" / "__init__.py"), str(site / "rewriter" / "_runtime")]
    installed = sorted(p for p in (site / "rewriter").rglob("*") if "__pycache__" not in p.parts)

    # The README's quick start, natively.
    run("gcc", "-O2", "-o", "program", "program.c")
    assert run(exe, "check", "program", "--spec", "probes.toml").stdout == "kernel_clone+0x0  k  optimized\n"
    run(exe, "instrument", "program", "--spec", "probes.toml", "-o", "program.kp")
    r = run(work / "program.kp", "2", KPREWRITE_PROFILE="-")
    assert r.stdout == "sum = 4\n"
    pre = re.findall(r"^handler_pre: <kernel_clone> p->addr = 0x([0-9a-f]{16}), ip = ([0-9a-f]+), flags = 0x[0-9a-f]+$",
                     r.stderr, re.M)
    assert len(pre) == 2 and all(int(ip, 16) == int(addr, 16) + 1 for addr, ip in pre), r.stderr
    assert len(re.findall(r"^handler_post: <kernel_clone> p->addr = 0x[0-9a-f]{16}, flags = 0x[0-9a-f]+$",
                          r.stderr, re.M)) == 2, r.stderr
    assert re.search(r"^\s*p_kernel_clone_0\s+2\s+0$", r.stderr, re.M), r.stderr
    assert re.fullmatch(r"[0-9a-f]{16}  k  kernel_clone\+0x0 \[OPTIMIZED\]\n", run(exe, "list", "program.kp").stdout)

    # The manual, installed into the venv's share/man/man1 and found by `man` from PATH alone
    # (man-db looks in ../share/man of each PATH folder); the gdb helper, packaged.
    commands = run(py, "-c", "from rewriter.cli import main; print(*sorted(main.commands))").stdout.split()
    assert sorted(p.name for p in (venv / "share" / "man" / "man1").iterdir()) == sorted(
        ["kprewrite.1"] + [f"kprewrite-{c}.1" for c in commands])
    man_env = {k: v for k, v in env.items() if k != "MANPATH"}
    man_env.update(PATH=f"{venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin", MANPAGER="cat", MANWIDTH="100")
    if shutil.which("man"):
        page = sh(["man", "kprewrite"], cwd=work, env=man_env).stdout
        assert page.startswith("KPREWRITE(1)") and "kprewrite-check(1)" in page, page
        assert "--kprobe" in sh(["man", "kprewrite-check"], cwd=work, env=man_env).stdout.replace("\u2010", "-")
    helper = Path(run(exe, "gdb", "--print-path").stdout.strip())
    assert helper == site / "rewriter" / "_tools" / "kprewrite-gdb.py"
    assert helper.read_bytes() == (ROOT / "tools" / "kprewrite-gdb.py").read_bytes()

    # The runtime compiled into the user's cache, nothing written into the installed package.
    assert list((tmp_path / "cache").glob("runtime-*"))
    assert sorted(p for p in (site / "rewriter").rglob("*") if "__pycache__" not in p.parts) == installed
    # The packaged runtime is this tree's: the same cache key (a hash of its files), the same bytes out.
    sh([*KPREWRITE, "instrument", "program", "--spec", "probes.toml", "-o", "program.tree.kp", "-q"],
       cwd=work, env={**TREE_ENV, "KPREWRITE_CACHE": str(tmp_path / "tree-cache")})
    assert [p.name for p in (tmp_path / "cache").glob("runtime-*")] == [p.name for p in (tmp_path / "tree-cache").glob("runtime-*")]
    assert (work / "program.kp").read_bytes() == (work / "program.tree.kp").read_bytes()
