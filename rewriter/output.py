"""Writing the output files: atomically, with the input's mode, never over the input,
and all of them or none."""
from __future__ import annotations

import os
import tempfile

from .errors import KprewriteError, file_error


def same_file(a: str, b: str) -> bool:
    """a and b name one file (a symbolic or hard link to it counts): compared by device
    and inode, not by name.  A path that does not exist names no file yet."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def refuse_same(output: str, inputs: dict[str, str | None]) -> None:
    """An output that is one of `inputs` (what -> path) is refused before anything is read."""
    for what, path in inputs.items():
        if path and path != "-" and same_file(output, path):
            raise KprewriteError(f"{output}: is {what} ({path}); the output must be another file "
                                 f"({what} is never modified)")


def write_atomically(path: str, data: bytes, mode_from: str) -> None:
    """Write OUTPUT atomically, with INPUT's file mode."""
    write_all([(path, data, os.stat(mode_from).st_mode & 0o7777)])


def write_all(files: list[tuple[str, bytes, int]]) -> None:
    """Each (path, data, mode) written, or none of them: every file goes to a temporary
    file beside it first, and only when all are written are they renamed into place (a
    rename that fails takes back the ones before it)."""
    staged = []
    try:
        for path, data, mode in files:
            fd, tmp = _temporary_beside(path)
            staged.append((path, tmp))
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.chmod(tmp, mode)
            except OSError as e:
                raise file_error(path, e, write=True) from None
        done = []
        for path, tmp in staged:
            try:
                os.replace(tmp, path)
            except OSError as e:
                for p in done:
                    _unlink(p)
                raise file_error(path, e, write=True) from None
            done.append(path)
        staged = []
    finally:
        for _, tmp in staged:
            _unlink(tmp)


def _temporary_beside(path: str) -> tuple[int, str]:
    """(fd, name) of a new temporary file in path's folder, to be renamed onto path; a path
    that is a folder, or a folder that takes no new file, is refused in one line."""
    if os.path.isdir(path):
        raise file_error(path, IsADirectoryError())
    try:
        return tempfile.mkstemp(prefix=".kprewrite-", dir=os.path.dirname(os.path.abspath(path)) or ".")
    except OSError as e:
        raise file_error(path, e, write=True) from None


def _unlink(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


def write_streamed(path: str, produce, mode: int) -> None:
    """Text written a part at a time (produce(write) calls write(str) for each part) to a
    temporary file beside path, renamed into place once all is written: write_all()'s
    all-or-nothing without the whole text in memory."""
    fd, tmp = _temporary_beside(path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            produce(f.write)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as e:
        _unlink(tmp)
        raise file_error(path, e, write=True) from None
    except BaseException:
        _unlink(tmp)
        raise
