"""`instrument --depfile FILE`: a make/ninja depfile naming every file the rewrite
read, so a build system re-runs it exactly when one of them changes (gcc -MD's
convention: `OUTPUT: PREREQ...`); and read(), for the depfiles gcc writes of the
handlers' compilation."""
from __future__ import annotations

import os
from pathlib import Path

from .errors import KprewriteError
from .output import write_all


def escape(path: str) -> str:
    """A path as make and ninja read it in a depfile: spaces and # escaped, $ doubled."""
    return path.replace("\\", "\\\\").replace(" ", "\\ ").replace("#", "\\#").replace("$", "$$")


def text(target: str, deps: list) -> str:
    seen, ordered = set(), []
    for d in deps:
        p = os.path.abspath(str(d))
        if p not in seen:
            seen.add(p)
            ordered.append(p)
    return escape(target) + ":" + "".join(f" \\\n  {escape(p)}" for p in ordered) + "\n"


def entry(path: str, target: str, deps: list, mode_from: str) -> tuple[str, bytes, int]:
    """The depfile as output.write_all() takes it: INPUT's mode, but not executable."""
    if os.path.isdir(path):
        raise KprewriteError(f"{path}: is a directory")
    return path, text(target, deps).encode(), os.stat(mode_from).st_mode & 0o666


def write(path: str, target: str, deps: list, mode_from: str) -> None:
    write_all([entry(path, target, deps, mode_from)])


def read(path) -> list:
    """The prerequisites of a make-style depfile gcc wrote (-MD), resolved."""
    text = Path(path).read_text().replace("\\\n", " ")
    _, _, rest = text.partition(": ")
    words, cur, i = [], "", 0
    while i < len(rest):
        ch = rest[i]
        if ch == "\\" and i + 1 < len(rest) and rest[i + 1] in " #":
            cur += rest[i + 1]
            i += 2
            continue
        if ch.isspace():
            if cur:
                words.append(cur)
            cur = ""
        elif ch == "$" and rest[i + 1:i + 2] == "$":
            cur += "$"
            i += 1
        else:
            cur += ch
        i += 1
    if cur:
        words.append(cur)
    return [Path(w).resolve() for w in words]
