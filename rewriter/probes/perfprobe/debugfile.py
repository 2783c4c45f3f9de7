"""Finding the separate debug file of an image, as perf and gdb find it: by build-id
under the debug roots (/usr/lib/debug, or $KPREWRITE_DEBUG_FILE_DIRECTORY), by
.gnu_debuglink next to the image, in its .debug/ folder or under the roots, or the file
$KPREWRITE_DEBUG_FILE names; a file whose build-id differs from the image's is not used."""
from __future__ import annotations

import os

from elftools.elf.elffile import ELFFile

DEBUG_ROOT = "/usr/lib/debug"
DEBUG_DIR_ENV = "KPREWRITE_DEBUG_FILE_DIRECTORY"
DEBUG_FILE_ENV = "KPREWRITE_DEBUG_FILE"


def debug_roots() -> list[str]:
    """The folders searched for separate debug files: $KPREWRITE_DEBUG_FILE_DIRECTORY's
    (colon-separated, as gdb's debug-file-directory), else DEBUG_ROOT."""
    env = os.environ.get(DEBUG_DIR_ENV)
    roots = [d for d in env.split(":") if d] if env else []
    return roots or [DEBUG_ROOT]


class NoDebugInfo(Exception):
    pass


def build_id(elf) -> str | None:
    """The GNU build-id note's hex (a kernel keeps it among its other notes, in .notes)."""
    notes = elf.get_section_by_name(".note.gnu.build-id")
    secs = [notes] if notes is not None else [s for s in elf.iter_sections() if s["sh_type"] == "SHT_NOTE"]
    for sec in secs:
        for n in sec.iter_notes():
            if n["n_type"] == "NT_GNU_BUILD_ID" and n["n_name"] == "GNU" and isinstance(n["n_desc"], str):
                return n["n_desc"]
    return None


def _debuglink_candidates(path: str, elf, names=()) -> list[str]:
    out = []
    roots = debug_roots()
    explicit = os.environ.get(DEBUG_FILE_ENV)
    if explicit:
        out.append(explicit)
    bid = build_id(elf)
    if bid:
        out += [os.path.join(r, ".build-id", bid[:2], bid[2:] + ".debug") for r in roots]
    link = elf.get_section_by_name(".gnu_debuglink")
    if link is not None:
        name = link.data().split(b"\0", 1)[0].decode("utf-8", "replace")
        d = os.path.dirname(os.path.abspath(path))
        out += [os.path.join(d, name), os.path.join(d, ".debug", name)]
        out += [r + os.path.join(d, name) for r in roots]
    out += [os.path.join(r, n) for n in names for r in roots]
    return out


def find_debug_file(path: str, elf, names=()):
    """(ELFFile, path) of the separate debug file of the image, or None; a candidate
    whose build-id is not the image's is skipped, KPREWRITE_DEBUG_FILE's is an error."""
    want = build_id(elf)
    explicit = os.environ.get(DEBUG_FILE_ENV)
    for cand in _debuglink_candidates(path, elf, names):
        if not os.path.isfile(cand):
            if cand == explicit:
                raise NoDebugInfo(f"{DEBUG_FILE_ENV}={cand}: "
                                  f"{'is a directory' if os.path.isdir(cand) else 'no such file'}")
            continue
        fh = open(cand, "rb")
        try:
            other = ELFFile(fh)
            ok = other.has_dwarf_info() and (other.get_section_by_name(".debug_info") is not None or
                                            other.get_section_by_name(".zdebug_info") is not None)
            theirs = build_id(other) if ok else None
        except Exception:
            ok, theirs = False, None
        if ok and (want is None or theirs is None or theirs == want):
            return other, cand
        fh.close()
        if cand == explicit:
            why = "no DWARF debug information" if not ok else \
                f"the build-id {theirs}, not the image's {want}"
            raise NoDebugInfo(f"{DEBUG_FILE_ENV}={cand} has {why}")
    return None
