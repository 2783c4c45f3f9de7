"""kprewrite: Linux-style kprobes compiled ahead of time into ELF images.

The Python API (api.py): instrument, check, diff, read_probes, read_blacklist (not `blacklist`: that is a submodule); every
failure is a KprewriteError carrying the CLI's one-line messages."""
__version__ = "0.1.0"    # the one place it is written: pyproject.toml reads it, `kprewrite --version` prints it

from .api import CheckResult, DiffResult, InstrumentResult, check, diff, instrument, read_blacklist, read_probes
from .errors import KprewriteError

__all__ = ["instrument", "check", "read_probes", "read_blacklist", "KprewriteError", "diff", "CheckResult", "InstrumentResult", "DiffResult"]
