"""The kernel's Module.symvers: each exported symbol's CRC (CONFIG_MODVERSIONS).

A module that calls a kernel function it did not call before needs that symbol's
CRC in its `__versions` table: the module loader compares it with the kernel's
(check_version()), and Debian's kernel refuses a symbol without one ("disagrees
about version of symbol"; Debian's patch makes a missing CRC fail closed).  kbuild
reads them from Module.symvers; so does the writer, from `--system-map FILE` (for a
module: the kernel's Module.symvers) or, as kbuild finds it for an out-of-tree
module, /lib/modules/<the module's vermagic release>/build/Module.symvers.
"""
from __future__ import annotations

import re
from pathlib import Path

from ...errors import KprewriteError, file_error

_LINE = re.compile(r"^0x([0-9a-fA-F]{1,8})\t(\S+)\t(\S*)\t(EXPORT_\w+)")


def parse(text: str, path: str) -> dict[str, int]:
    """name -> CRC of a Module.symvers text."""
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _LINE.match(line)
        if m is None:
            raise KprewriteError(f"{path}: line {n}: not a Module.symvers line (0xCRC<TAB>symbol<TAB>module"
                                 f"<TAB>EXPORT_...); a kernel module takes the kernel's Module.symvers here")
        out[m.group(2)] = int(m.group(1), 16)
    return out


def release(mod) -> str | None:
    """The kernel release the module was built for (the first word of its .modinfo vermagic)."""
    info = mod.section_named(".modinfo")
    if info is None:
        return None
    for entry in mod.data[info.offset:info.offset + info.size].split(b"\0"):
        if entry.startswith(b"vermagic="):
            words = entry[9:].decode("ascii", "replace").split()
            return words[0] if words and "/" not in words[0] else None
    return None


def load(mod, given: str | None) -> tuple[dict[str, int] | None, str | None]:
    """(CRCs, their file) from the file given, else kbuild's place for the module's release, else (None, None)."""
    if given:
        try:
            text = Path(given).read_text(errors="replace")
        except OSError as e:
            raise file_error(given, e, role="the kernel's Module.symvers") from None
        return parse(text, given), given
    rel = release(mod)
    if rel:
        p = Path("/lib/modules") / rel / "build" / "Module.symvers"
        if p.is_file():
            return parse(p.read_text(errors="replace"), str(p)), str(p)
    return None, None
