"""The module's fixed assembly, read from its source files under runtime/ by parts (the
writer's detours and sections, orc.py's entry macro): a leaf both import."""
from __future__ import annotations

import re


def module_parts(rel: str) -> dict[str, str]:
    """A source file of templates under runtime/, by parts: each part's text follows its line
    `/* @NAME */` (the file's first comment says what they are)."""
    from ...link.runtime import RUNTIME_DIR
    parts = re.split(r"^/\* @(\w+) \*/\n", (RUNTIME_DIR / rel).read_text().split("*/\n", 1)[1], flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))
