"""Writing the output file: atomically, with the input's mode, never over the input."""
from __future__ import annotations

import os
import tempfile

from .errors import KprewriteError, file_error


def write_atomically(path: str, data: bytes, mode_from: str) -> None:
    """Write OUTPUT atomically, with INPUT's file mode."""
    d = os.path.dirname(os.path.abspath(path)) or "."
    try:
        fd, tmp = tempfile.mkstemp(prefix=".kprewrite-", dir=d)
    except OSError as e:
        raise file_error(path, e, write=True) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, os.stat(mode_from).st_mode & 0o7777)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise file_error(path, e, write=True) from None
