"""The docs name what exists: every relative link of README.md, docs/, and the
READMEs of benchmarks/ and runtime/ resolves, every repository path they quote
(`rewriter/...`, `runtime/...`) is there, every Python file they quote by name
is one of ours, and nothing links outside the repository (a user's clone has
only what is in it)."""
import re
from pathlib import Path

from conftest import ALL_ARCHES

ARCHES = ALL_ARCHES      # conftest: not arch-specific

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "README.md",
        ROOT / "runtime" / "README.md"]
TOP = ("rewriter/", "runtime/", "tests/", "benchmarks/", "samples/", "docs/", "tools/", ".ci/")
EXTERNAL = ("samples/kprobes",)     # the kernel's own samples/, which ours port
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
QUOTED = re.compile(r"`([A-Za-z0-9_./<>*-]+)`")


def _docs():
    return [d for d in DOCS if d.exists()]


def test_relative_links_resolve():
    bad = []
    for d in _docs():
        for m in LINK.finditer(d.read_text()):
            target = m.group(1).split("#")[0]
            if not target or re.match(r"^[a-z]+:", target):
                continue
            if not (d.parent / target).exists():
                bad.append(f"{d.relative_to(ROOT)}: {m.group(1)}")
    assert not bad, bad


def test_nothing_points_outside_the_repository():
    bad = [f"{d.relative_to(ROOT)}: {line.strip()}" for d in _docs() for line in d.read_text().splitlines()
           if "../shared" in line or "shared/interface.md" in line or "/work/" in line]
    assert not bad, bad


def test_quoted_repository_paths_exist():
    bad = []
    for d in _docs():
        for m in QUOTED.finditer(d.read_text()):
            p = m.group(1).rstrip(".,:")
            if not p.startswith(TOP) or p.startswith(EXTERNAL) or any(c in p for c in "<>*"):
                continue
            if not (ROOT / p).exists():
                bad.append(f"{d.relative_to(ROOT)}: {p}")
    assert not bad, bad


def test_quoted_python_files_are_ours():
    """A module named by its file name alone (`emit/layout.py`) is a file of the
    repository: a renamed or split module leaves no stale name behind."""
    ours = {p.name for p in ROOT.rglob("*.py") if ".git" not in p.parts}
    bad = []
    for d in _docs():
        for m in QUOTED.finditer(d.read_text()):
            p = m.group(1).rstrip(".,:")
            if p.endswith(".py") and "/" not in p and p not in ours:
                bad.append(f"{d.relative_to(ROOT)}: {p}")
    assert not bad, bad
