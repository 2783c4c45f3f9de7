"""Where kprewrite finds the files it ships besides Python code: the C runtime
(runtime/ in the repository), compiled for each rewrite's handlers and image.

runtime_dir(): $KPREWRITE_RUNTIME if set; else the copy installed with the package
(rewriter/_runtime, put there by setup.py's build hook when a wheel is built, for
`pip install .` and wheels); else the source tree's runtime/ next to rewriter/
(an editable install, or PYTHONPATH pointing at a checkout).  Paths only, found on
the file system: nothing here imports or writes anything."""
from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent.parent      # rewriter/


def runtime_dir() -> Path:
    env = os.environ.get("KPREWRITE_RUNTIME")
    if env:
        return Path(env)
    packaged = _PACKAGE / "_runtime"
    if packaged.is_dir():
        return packaged
    return _PACKAGE.parent / "runtime"


def gdb_helper() -> Path:
    """tools/kprewrite-gdb.py: the copy installed with the package (rewriter/_tools, put
    there by setup.py's build hook), else the source tree's."""
    packaged = _PACKAGE / "_tools" / "kprewrite-gdb.py"
    if packaged.is_file():
        return packaged
    return _PACKAGE.parent / "tools" / "kprewrite-gdb.py"
