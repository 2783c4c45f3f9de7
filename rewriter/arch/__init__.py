"""Architecture back ends.  A second architecture is one more folder here,
providing what arch/base.py's Arch declares."""
from importlib import import_module

# ELF e_machine -> back end folder.
MACHINES = {62: "x86_64"}


def get_arch(machine: str):
    try:
        return import_module(f".{machine}", __name__)
    except ModuleNotFoundError:
        from ..errors import KprewriteError
        raise KprewriteError(f"architecture {machine} is not supported")
