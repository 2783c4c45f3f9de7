"""Architecture back ends.  A new architecture is one more folder here, providing
what arch/base.py's Arch declares, and its line in MACHINES: the rewriter's one
registry of back ends (tests/test_arch.py: no other code outside the arch folders
names one)."""
import platform
from importlib import import_module

# ELF e_machine -> back end folder.
MACHINES = {62: "x86_64", 183: "aarch64"}


def get_arch(machine: str):
    try:
        return import_module(f".{machine}", __name__)
    except ModuleNotFoundError:
        from ..errors import KprewriteError
        raise KprewriteError(f"architecture {machine} is not supported")


def host_machine() -> str:
    """The back end of the machine kprewrite runs on (for what is checked before an
    image names its own, e.g. event syntax in unit use)."""
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)     # other systems' names
