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

The layouts are those of runtime/platform/linux_kernel/kp_trace_buffer.c (btf.py's
_trace_layout(), as for a kernel image), plus `trace_event_class.raw_init`, which
the module's event calls set (they are registered by the module loader's trace
notifier from the module's `_ftrace_events` section, which calls raw_init first).
"""
from __future__ import annotations

import os
from pathlib import Path

from ..linux_kernel import btf

# Appended to btf._trace_layout()'s list (KP_TR_CLASS_RAW_INIT in the module's generated C).
EXTRA = (("trace_event_class", "raw_init"),)


def _from_file(path: Path) -> bytes | None:
    """The .BTF of an ELF file, or the raw BTF of a file that is one; None if neither."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if data[:4] == b"\x7fELF":
        from elftools.elf.elffile import ELFFile
        import io
        try:
            sec = ELFFile(io.BytesIO(data)).get_section_by_name(".BTF")
        except Exception:           # not an ELF pyelftools reads: no BTF to take
            return None
        return sec.data() if sec is not None else None
    return data if data[:2] == btf.BTF_MAGIC.to_bytes(2, "little") else None


def find(symvers_path: str | None, release: str | None) -> tuple[bytes, str] | None:
    """(the kernel's BTF, where it was read) or None."""
    places = []
    if symvers_path:
        places.append(Path(symvers_path).parent / "vmlinux")
    if release and os.uname().release == release:
        places.append(Path("/sys/kernel/btf/vmlinux"))
    for p in places:
        if p.is_file():
            data = _from_file(p)
            if data:
                return data, str(p)
    return None


def layout(data: bytes, where: str) -> list | None:
    """kp_kernel_trace[] (btf._trace_layout()) plus EXTRA, or None when the BTF lacks any of it;
    cached by the BTF's contents (parsing a kernel's BTF takes seconds)."""
    import json
    from ... import cache
    k = cache.key(b"module-trace-layout-1", repr(EXTRA).encode(), data)
    hit = cache.get("module-trace-layout", k)
    if hit is not None:
        return json.loads(hit)
    types = btf.parse(data, where)
    trace = btf._trace_layout(types)
    out = None
    if trace is not None and -1 not in trace:
        extra = [btf.member_offset(types, s, m) for s, m in EXTRA]
        out = None if None in extra else trace + extra
    cache.put("module-trace-layout", k, json.dumps(out).encode())
    return out
