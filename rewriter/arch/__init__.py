"""Architecture back ends.  A second architecture is one more folder here,
providing what arch/base.py's Arch declares."""
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
    return {"amd64": "x86_64"}.get(m, m)
