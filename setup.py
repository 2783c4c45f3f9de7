"""Build hook, nothing else (the project is described in pyproject.toml).

The C runtime stays at the top of the repository (runtime/); a wheel carries a copy
as the package data rewriter/_runtime, where rewriter.link.resources.runtime_dir() finds
it.  An editable install builds nothing here and reads runtime/ in place.  The sdist
takes runtime/ by MANIFEST.in, so a wheel built from it gets the same copy."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

RUNTIME = Path(__file__).resolve().parent / "runtime"
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


setup(cmdclass={"build_py": BuildPyWithRuntime})
