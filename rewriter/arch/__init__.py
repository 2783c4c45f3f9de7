"""Architecture back ends.  A second architecture is one more folder here."""
from importlib import import_module


def get_arch(machine: str):
    try:
        return import_module(f".{machine}", __name__)
    except ModuleNotFoundError:
        from ..errors import KprewriteError
        raise KprewriteError(f"architecture {machine} is not supported")
