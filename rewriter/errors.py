"""One error type for everything a user can get wrong.

Every failure the CLI reports is a KprewriteError: its message is one line that
names what is wrong and where.  Anything else escaping is a bug in kprewrite.
"""


class KprewriteError(Exception):
    """A user-facing failure: one line per problem, no traceback."""

    def __init__(self, *lines: str):
        self.lines = [l for l in lines if l]
        super().__init__("\n".join(self.lines))


def file_error(path, e: OSError, *, write: bool = False, role: str | None = None) -> KprewriteError:
    """The one wording of each kind of file error, naming the path as the user gave it:
    `PATH: no such file`, `PATH: is a directory`, `PATH: cannot write: no such directory`
    (OUTPUT's folder is missing), else `PATH: cannot read: REASON` (or write), the reason
    as the C library words it, in lower case.  `role`: what the file was read as (the
    kernel's Module.symvers...), added in parentheses."""
    if isinstance(e, IsADirectoryError):
        kind = "is a directory"
    elif isinstance(e, (FileNotFoundError, NotADirectoryError)):
        kind = "cannot write: no such directory" if write else "no such file"
    else:
        reason = e.strerror or str(e)
        kind = f"cannot {'write' if write else 'read'}: {reason[:1].lower()}{reason[1:]}"
    return KprewriteError(f"{path}: {kind}" + (f" ({role})" if role else ""))
