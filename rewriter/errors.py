"""One error type for everything a user can get wrong.

Every failure the CLI reports is a KprewriteError: its message is one line that
names what is wrong and where.  Anything else escaping is a bug in kprewrite.
"""


class KprewriteError(Exception):
    """A user-facing failure: one line per problem, no traceback."""

    def __init__(self, *lines: str):
        self.lines = [l for l in lines if l]
        super().__init__("\n".join(self.lines))
