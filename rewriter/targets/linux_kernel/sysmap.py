"""System.map: the kernel's ``nm -n`` listing, ``ADDRESS TYPE NAME`` per line.

Debian ships only a stub in its image packages (one line, ``ffffffffffffffff B The real
System.map is in the linux-image-<version>-dbg package``); it is recognised and reported
as a stub, never taken for a symbol table.  Anything else malformed is a one-line
KprewriteError naming the file and the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rewriter.errors import KprewriteError, file_error

from .kallsyms import KSym, SymbolTable

# A real System.map has tens of thousands of lines; fewer than this is a stub.
STUB_LINES = 16

_LINE = re.compile(r"([0-9a-fA-F]{1,16})\s+(\S)\s+(\S+)(?:\s+\[\S+\])?\s*")


@dataclass
class SystemMap(SymbolTable):
    path: str
    symbols: list[KSym]
    stub: bool = False
    stub_text: str = ""

    def require_symbols(self) -> "SystemMap":
        """self, or a one-line error if this is a stub with no symbol table."""
        if self.stub:
            what = f": {self.stub_text!r}" if self.stub_text else ""
            raise KprewriteError(
                f"{self.path}: a stub System.map ({len(self.symbols)} symbol(s){what}), not the "
                f"kernel's symbol table; give the full one (Debian: the linux-image-*-dbg package) "
                f"or leave --system-map out to read the image's own kallsyms")
        return self


def parse_system_map(text: str, path: str = "System.map") -> SystemMap:
    lines = text.splitlines()
    nonblank = [(i, l) for i, l in enumerate(lines, 1) if l.strip()]
    if len(nonblank) < STUB_LINES:
        # A stub: keep whatever parses as a symbol, say what the rest says.
        syms, notes = [], []
        for _, l in nonblank:
            m = _LINE.fullmatch(l.strip())
            if m and int(m.group(1), 16) != (1 << 64) - 1:
                syms.append(KSym(int(m.group(1), 16), m.group(2), m.group(3)))
            else:
                parts = l.split(None, 2)
                notes.append(parts[2] if len(parts) == 3 else l.strip())
        return SystemMap(path, syms, stub=True, stub_text=" ".join(notes))
    syms = []
    for i, l in nonblank:
        m = _LINE.fullmatch(l.strip())
        if m is None:
            shown = l.strip()
            if len(shown) > 60:
                shown = shown[:57] + "..."
            raise KprewriteError(f"{path}:{i}: not a System.map line (ADDRESS TYPE NAME): {shown!r}")
        syms.append(KSym(int(m.group(1), 16), m.group(2), m.group(3)))
    return SystemMap(path, syms)


def read_system_map(path: str) -> SystemMap:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise file_error(path, e, role="the System.map") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise KprewriteError(f"{path}:{line}: not a System.map (not text)") from None
    return parse_system_map(text, path)
