"""C string literals for generated C (the probe tables, fetch programs, events)."""
from __future__ import annotations

import re

# Printable ASCII but for `"` and `\`: written as it is (a symbol name; a table of
# thousands of them is generated at once).
_PLAIN = re.compile(r'[ !#-\[\]-~]*')


def c_string(s: str | None) -> str:
    """`s` as a C string literal (octal escapes outside printable ASCII); None: 0."""
    if s is None:
        return "0"
    if _PLAIN.fullmatch(s):
        return '"' + s + '"'
    out = []
    for ch in s.encode():
        if ch in (0x22, 0x5C):
            out.append("\\" + chr(ch))
        elif 0x20 <= ch < 0x7F:
            out.append(chr(ch))
        else:
            out.append(f"\\{ch:03o}")
    return '"' + "".join(out) + '"'
