"""Build hooks, nothing else (the project is described in pyproject.toml).

The C runtime stays at the top of the repository (runtime/); a wheel carries a copy
as the package data rewriter/_runtime, where rewriter.link.resources.runtime_dir() finds
it.  An editable install builds nothing here and reads runtime/ in place.  The sdist
takes runtime/ by MANIFEST.in, so a wheel built from it gets the same copy.  The gdb
helper tools/kprewrite-gdb.py goes into the wheel as rewriter/_tools/ the same way.

The manual pages (kprewrite.1, kprewrite-COMMAND.1) are made here from the click
program (rewriter/manpage.py, which needs click at build time: pyproject's
build-system requires) and installed as data files into share/man/man1 of the
environment, where `man kprewrite` finds them (man-db looks in ../share/man of each
folder on PATH)."""
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
RUNTIME = HERE / "runtime"
TOOLS = ["kprewrite-gdb.py"]        # tools/ files a user is told to run (docs/reference/cli.md)
MAN_DIR = "build/man/man1"          # relative to this file, as data_files wants it
SUFFIXES = (".c", ".h", ".S")       # the runtime's files (rewriter/link/runtime.py: runtime_sources())


class BuildPyWithRuntime(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        dest = Path(self.build_lib) / "rewriter" / "_runtime"
        shutil.rmtree(dest, ignore_errors=True)     # a build/ reused by `pip install .`: no stale files
        for f in sorted(RUNTIME.rglob("*")):
            if f.is_file() and f.suffix in SUFFIXES:
                target = dest / f.relative_to(RUNTIME)
                self.mkpath(str(target.parent))
                self.copy_file(str(f), str(target), preserve_mode=False)
        tools = Path(self.build_lib) / "rewriter" / "_tools"
        self.mkpath(str(tools))
        for name in TOOLS:
            self.copy_file(str(HERE / "tools" / name), str(tools / name), preserve_mode=False)


def man_pages() -> list[tuple[str, list[str]]]:
    sys.path.insert(0, str(HERE))
    try:
        from rewriter import manpage
        from rewriter.cli import main
    finally:
        sys.path.pop(0)
    shutil.rmtree(HERE / MAN_DIR, ignore_errors=True)
    paths = manpage.write(str(HERE / MAN_DIR), main)
    return [("share/man/man1", sorted(f"{MAN_DIR}/{Path(p).name}" for p in paths))]


setup(cmdclass={"build_py": BuildPyWithRuntime}, data_files=man_pages())
