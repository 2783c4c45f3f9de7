"""The kernel's BTF, for a module's trace events as the kernel's own event calls.

A module's `.BTF` is split BTF on top of the kernel's: it holds the module's own
types, not `struct trace_event_call` and its kin, whose layouts a real event call
(events/kprobes/<EVENT>/) needs.  They come from the kernel's BTF, found as kbuild
finds it to build a module's BTF (scripts/Makefile.modfinal: the `vmlinux` of the
build tree, beside its Module.symvers) or as the running kernel gives it:

- `vmlinux` beside the Module.symvers the rewrite reads (`--system-map FILE`, or
  /lib/modules/<release>/build/): an ELF with `.BTF`;
- /sys/kernel/btf/vmlinux, when the running kernel's release is the module's
  (raw BTF).

A `vmlinux` that is there but cannot be read, is neither an ELF file nor raw BTF,
is a damaged ELF, or whose `Linux version` banner names another release than the
module's vermagic is a bad input: one line naming it, nothing written.  An ELF
without `.BTF` (a kernel built without CONFIG_DEBUG_INFO_BTF), a BTF without the
layouts, or no kernel BTF found at all: the events are written as trace_printk()
lines, and `check` and `instrument` say so in one line on standard error (notes()).

The layouts are those of runtime/platform/linux_kernel/kp_trace_buffer.c (btf.py's
_trace_layout(), as for a kernel image), plus `trace_event_class.raw_init`, which
the module's event calls set (they are registered by the module loader's trace
notifier from the module's `_ftrace_events` section, which calls raw_init first).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ...errors import KprewriteError, file_error
from ..linux_kernel import btf

# Appended to btf._trace_layout()'s list (KP_TR_CLASS_RAW_INIT in the module's generated C).
EXTRA = (("trace_event_class", "raw_init"),)


def _from_file(path: Path, release: str | None) -> tuple[bytes | None, str | None]:
    """(the .BTF of an ELF file or the raw BTF of a file that is one, None) or (None, why
    the file has none: an ELF without .BTF); KprewriteError for a file that is there but
    unreadable, junk, a damaged ELF, or the vmlinux of another release than `release`."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise file_error(path, e, role="the kernel's vmlinux, for its BTF") from None
    if data[:2] == btf.BTF_MAGIC.to_bytes(2, "little"):
        return data, None
    if data[:4] != b"\x7fELF":
        raise KprewriteError(f"{path}: not an ELF file (read as the kernel's vmlinux, for its BTF)")
    m = re.search(rb"Linux version (\d+\.\d+[^\s%\x00]*) \(", data)
    if release and m and m.group(1).decode("ascii", "replace") != release:
        raise KprewriteError(f"{path}: the vmlinux of release {m.group(1).decode('ascii', 'replace')}, "
                             f"the module's vermagic says {release}")
    from ...elf.view import ElfView
    try:
        view = ElfView(data, None)
        sec = view.section(".BTF")
        btf_data = view.section_bytes(sec) if sec is not None else None
    except KprewriteError as e:     # elf.view's one line: a damaged file
        raise KprewriteError(f"{path}: damaged ELF file (read as the kernel's vmlinux, for its BTF): {e.args[0]}")
    if btf_data is None:
        return None, f"{path} has no .BTF (a kernel built without CONFIG_DEBUG_INFO_BTF)"
    return btf_data, None


def find(symvers_path: str | None, release: str | None) -> tuple[bytes | None, str]:
    """(the kernel's BTF, where it was read), or (None, why there is none)."""
    places = []
    if symvers_path:
        places.append(Path(symvers_path).parent / "vmlinux")
    if release and os.uname().release == release:
        places.append(Path("/sys/kernel/btf/vmlinux"))
    why = None
    for p in places:
        if p.is_file():
            data, why_not = _from_file(p, release)
            if data:
                return data, str(p)
            why = why or why_not
    return None, why or (f"no kernel BTF found (a vmlinux beside {symvers_path or 'the Module.symvers'}"
                         + (f", or /sys/kernel/btf/vmlinux of {release}" if release else "") + ")")


def event_layout(mod) -> tuple[list | None, str | None]:
    """(layout() of the kernel's BTF, None), or (None, the one line saying why the module's
    events are trace_printk() lines); read once per module (check and instrument ask)."""
    got = mod.event_layout
    if got is None:
        from . import symvers
        data, where = find(mod.symvers_path, symvers.release(mod))
        calls = layout(data, where) if data is not None else None
        if data is not None and calls is None:
            where = f"{where}: its BTF lacks the layout of struct trace_event_call and its kin"
        got = mod.event_layout = (calls, None if calls is not None else (
            f"{where}: the module's events are written as trace_printk() lines "
            f"(no events/kprobes/<EVENT>/)"))
    return got


def notes(image, traces) -> list[str]:
    """What `check` and `instrument` say of a module's events (one line, or none)."""
    mod = image.container
    if not traces or mod.symvers is None:
        return []
    return [n for n in event_layout(mod)[1:] if n]


def layout(data: bytes, where: str) -> list | None:
    """kp_kernel_trace[] (btf._trace_layout()) plus EXTRA, or None when the BTF lacks any of it;
    cached by the BTF's contents (parsing a kernel's BTF takes seconds)."""
    import json
    from ... import cache
    k = cache.key(b"module-trace-layout-3-bpf", repr(EXTRA).encode(), data)
    hit = cache.get("module-trace-layout", k)
    if hit is not None:
        return json.loads(hit)
    types = btf.parse(data, where)
    trace = btf._trace_layout(types)
    out = None
    if trace is not None and -1 not in trace[:btf.TRACE_CALL_LEN]:     # perf's may be -1
        extra = [btf.member_offset(types, s, m) for s, m in EXTRA]
        out = None if None in extra else trace + extra
    cache.put("module-trace-layout", k, json.dumps(out).encode())
    return out
