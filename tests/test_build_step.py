"""kprewrite as a build step: `instrument --depfile` and
samples/build_step's Makefile and CMake project (Ninja and Makefile generators).
The rewrite runs when the program, the spec, a handler or a header it includes
changes, and only then."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ALL_ARCHES, ROOT, TREE_ENV, cc, kprewrite, run, write_spec

ARCHES = ALL_ARCHES

SAMPLE = ROOT / "samples" / "build_step"
KP = [sys.executable, "-m", "rewriter"]      # this tree's CLI (TREE_ENV puts it on PYTHONPATH)


def need(*tools):
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (.ci/run installs them)")


def sh(*cmd, cwd) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, env=TREE_ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def later(path):
    """Marks `path` changed: newer than anything in its sample folder, never in the
    future (a date ahead of the clock would leave the rebuilt outputs older than it,
    and make would rebuild them once more)."""
    root = next(p for p in path.parents if p.name == "build_step")
    t = max(f.stat().st_mtime for f in root.rglob("*")) + 0.01
    while time.time() <= t:
        time.sleep(0.01)
    os.utime(path, (t, t))


def sample(tmp_path):
    d = tmp_path / "build_step"
    shutil.copytree(SAMPLE, d)
    return d


def test_depfile_names_everything_read(tmp_path):
    prog = cc(tmp_path, "prog", "int work(int x) { return x + 1; }\nint main(void) { return work(1) - 2; }\n", "-O1")
    (tmp_path / "inc dir").mkdir()
    (tmp_path / "inc dir" / "my header.h").write_text("#define N 1\n")
    spec = write_spec(tmp_path, 'handlers = ["handlers.c"]\n[[kprobe]]\nsymbol_name = "work"\npre_handler = "h"\n',
                      '#include <kprewrite/kprobes.h>\n#include "inc dir/my header.h"\n'
                      'int h(struct kprobe *p, struct pt_regs *r) { return N - 1; }\n')
    kprewrite("instrument", prog, "--spec", spec, "-o", tmp_path / "out", "--depfile", tmp_path / "out.d")
    text = (tmp_path / "out.d").read_text()
    target, _, rest = text.partition(":")
    assert target == str(tmp_path / "out")
    deps = [d.strip().replace("\\ ", " ") for d in rest.replace("\\\n", "\n").splitlines() if d.strip()]
    assert deps[:3] == [str(prog), str(spec), str(tmp_path / "handlers.c")]
    assert str(tmp_path / "inc dir" / "my header.h") in deps and "my\\ header.h" in text
    assert str(ROOT / "runtime" / "include" / "kprewrite" / "kprobes.h") in deps
    runtime = sorted(str(p) for p in (ROOT / "runtime").rglob("*") if p.suffix in (".c", ".h", ".S"))
    assert set(runtime) <= set(deps) and len(deps) == len(set(deps))
    assert not (tmp_path / "handler0.c").exists() and not any("handler0" in d for d in deps)   # our wrapper is not a dependency
    assert (tmp_path / "out.d").stat().st_mode & 0o111 == 0
    # A failed rewrite writes no depfile.
    bad = write_spec(tmp_path, '[[kprobe]]\nsymbol_name = "nowhere"\n', name="bad.toml")
    r = kprewrite("instrument", prog, "--spec", bad, "-o", tmp_path / "o2", "--depfile", tmp_path / "o2.d", check=False)
    assert r.returncode == 1 and not (tmp_path / "o2").exists() and not (tmp_path / "o2.d").exists()


def test_makefile(tmp_path):
    need("make")
    d = sample(tmp_path)
    kp = f"KPREWRITE={shlex.join(KP)}"
    r = sh("make", kp, cwd=d)
    assert "instrument program --spec probes.toml -o program.kp --depfile program.kp.d" in r.stdout
    out = run(d / "program.kp", 3)
    assert out.stdout == "sum = 8\n" and out.stderr == "work(0)\nwork(1)\nwork(2)\n"
    assert "Nothing to be done" in sh("make", kp, cwd=d).stdout
    for changed in ("message.h", "handlers.c", "probes.toml"):
        later(d / changed)
        assert subprocess.run(["make", "-q", kp], cwd=d, env=TREE_ENV).returncode == 1, changed
        assert "instrument program" in sh("make", kp, cwd=d).stdout, changed
        assert "Nothing to be done" in sh("make", kp, cwd=d).stdout, changed


@pytest.mark.parametrize("generator", ["Ninja", "Unix Makefiles"])
def test_cmake(tmp_path, generator):
    need("cmake", "ninja" if generator == "Ninja" else "make")
    d = sample(tmp_path)
    b = d / "build"
    sh("cmake", "-S", d, "-B", b, "-G", generator, f"-DKPREWRITE={';'.join(KP)}", cwd=d)
    build = ["cmake", "--build", b]
    assert "kprewrite: probes into program" in sh(*build, cwd=d).stdout
    out = run(b / "program.kp", 2)
    assert out.stdout == "sum = 3\n" and out.stderr == "work(0)\nwork(1)\n"
    assert "kprewrite: probes into program" not in sh(*build, cwd=d).stdout
    later(d / "message.h")       # a header the handlers include: only the depfile knows it
    assert "kprewrite: probes into program" in sh(*build, cwd=d).stdout
    assert "kprewrite: probes into program" not in sh(*build, cwd=d).stdout
    later(d / "program.c")       # the program itself: rebuilt, then rewritten
    assert "kprewrite: probes into program" in sh(*build, cwd=d).stdout
