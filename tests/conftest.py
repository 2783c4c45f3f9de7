"""Shared helpers: compile real programs with gcc, rewrite them with the real
CLI, run them natively and under qemu-x86_64."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))      # in-process imports of rewriter: this tree too
# The CLI of this tree, not whatever `kprewrite` comes first on PATH (another checkout).
KPREWRITE = [sys.executable, "-m", "rewriter"]
TREE_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
QEMU = shutil.which("qemu-x86_64")
RUNNERS = ["native", "qemu"]


def cc(tmp: Path, name: str, source: str, *flags: str, lang: str = "c") -> Path:
    src = tmp / f"{name}.{'cc' if lang == 'c++' else 'c'}"
    src.write_text(source)
    out = tmp / name
    compiler = "g++" if lang == "c++" else "gcc"
    r = subprocess.run([compiler, str(src), *flags, "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


def kprewrite(*args, check=True, cwd=None) -> subprocess.CompletedProcess:
    r = subprocess.run([*KPREWRITE, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=TREE_ENV)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def write_spec(tmp: Path, text: str, handlers: str | None = None, name="probes.toml") -> Path:
    if handlers is not None:
        (tmp / "handlers.c").write_text(handlers)
    p = tmp / name
    p.write_text(text)
    return p


def instrument(binary: Path, spec: Path, out: Path | None = None, *extra) -> Path:
    out = out or binary.with_name(binary.name + ".kp")
    kprewrite("instrument", binary, "--spec", spec, "-o", out, *extra)
    return out


def run(binary: Path, *args, runner="native", env=None, timeout=120) -> subprocess.CompletedProcess:
    cmd = [str(binary), *map(str, args)]
    if runner == "qemu":
        if not QEMU:
            pytest.skip("qemu-x86_64 not installed")
        cmd = [QEMU, *cmd]
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=timeout)


def profile(stderr: str) -> dict[str, tuple[int, int]]:
    """Parse the kprobe_profile lines the runtime writes with KPREWRITE_PROFILE=-."""
    out = {}
    for line in stderr.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() and line.startswith("  "):
            out[parts[0]] = (int(parts[1]), int(parts[2]))
    return out


@pytest.fixture(params=RUNNERS)
def runner(request):
    return request.param
