"""The arm64 half of the module target: a .ko's relocations applied at the loader's
addresses (relocatable.py), its rules (rules.py) and the rewritten module, its detours
assembled and linked with `ld -r` (writer.py)."""

from . import relocatable, rules, writer  # noqa: F401  (linux_module._part() asks them)
