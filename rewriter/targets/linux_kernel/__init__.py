"""Linux kernel images: a vmlinux, with or without .symtab, or the one inside a boot
image (x86's bzImage).  The target, assembled from its parts, one job each:

- symbols.py: function symbols and bounds (.symtab, else a System.map given with
  --system-map, else the image's own kallsyms tables, kallsyms.py; a function ends
  where the next symbol starts, as kallsyms_lookup_size_offset() does), the symbols
  the runtime and handlers link against, addresses as the generated C writes them;
- reserved.py: the rules, the kernel's own (sites.py and the architecture's read the
  tables): the kprobe blacklist, sites patched at boot, ftrace sites, refusals;
- gap.py: where new code and data go (the text/rodata and rodata/data gaps);
- startup.py: how the runtime starts (boot, shutdown and task hooks: probes);
- unwind.py: stacks through probes (the kernel's unwinder takes our code as frame-pointer
  code registered as a BPF image's: struct bpf_ksym's layout for the runtime);
- generated_c.py: the target's part of the generated C tables and handler headers
  (btf.py: the image's types);
- writer.py: the output image and what `kprewrite diff` may find changed.

What differs by architecture (tables and opcodes, the breakpoint and return-thunk patches,
per-CPU access, the boot image and its KASLR table) is in the architecture's folder
here, x86_64/ (symbols.arch_of(): the image's arch name).
"""
from __future__ import annotations

from .. import base
from .gap import GapLayout, code_room, plan_layout  # noqa: F401
from .generated_c import (RUNTIME_KALLSYMS, TABLES_AT_BOOT, handler_headers, tables_c,  # noqa: F401
                          thread_key)
from .reserved import rules  # noqa: F401
from .startup import (BOOT_HOOKS, KRET_HOOKS, RUNTIME_HANDLERS, SHUTDOWN_HOOKS, reserve_stubs,  # noqa: F401
                      runtime_probes)
from .symbols import (KERNEL_HALF, PT_LOAD, address_c, derived_symbol, link_symbols, load_symbols,  # noqa: F401
                      table_base)
from .writer import before_link, diff_expected, write  # noqa: F401

name = "linux_kernel"
# The spec's `probes` (rewriter/probes/perfprobe): lines and locals from the kernel's DWARF where its
# debug file is found (debug_file_names()), else parameters by name from the image's BTF
# (btfprobe.py).
PROBES_BY_NAME = "btf"
# `kprewrite diff` on a bzImage (changes.py says so).
DIFF_REFUSAL = ("a bzImage's vmlinux is re-laid when written, so compare the vmlinux it holds "
                "and that vmlinux rewritten")


def debug_file_names(image) -> list[str]:
    """Where the kernel's DWARF is under a debug root (perf's vmlinux_path; Debian's
    linux-image-*-dbg installs boot/vmlinux-RELEASE), the release read from linux_banner."""
    import re
    m = re.search(rb"Linux version (\d+\.\d+[^\s%\x00]*) \(", image.data)
    if m is None:
        return []
    rel = m.group(1).decode("ascii", "replace")
    return [f"boot/vmlinux-{rel}", f"lib/modules/{rel}/vmlinux"]


def probe_btf(image):
    """The image's BTF types by id (btf.parse()), or None without .BTF."""
    from .btf import parse
    sec = image.section_named(".BTF")
    return None if sec is None else parse(image.data[sec.offset:sec.offset + sec.size], image.path)


def detect(image) -> bool:
    """A kernel image: an executable linked in the kernel half of the address space."""
    return image.e_type == 2 and any(s.type == PT_LOAD and s.vaddr >= KERNEL_HALF for s in image.segments)


def for_arch(image):
    """This target, or the architecture's variant of it where its folder has one (a
    `target` module: arm64's, which answers the back half's steps itself)."""
    from .symbols import arch_folders
    if image.machine in arch_folders():
        from importlib import import_module
        try:
            return import_module(f".{image.machine}.target", __package__)
        except ModuleNotFoundError:
            pass
    import sys
    return sys.modules[__name__]


def unwrap(data: bytes, path: str):
    """(vmlinux bytes, container) when data is a boot image around a vmlinux (x86's
    bzImage) of an architecture this target knows, else None."""
    from .symbols import arch_folders, arch_named
    for machine in arch_folders():
        found = arch_named(machine).unwrap(data, path)
        if found is not None:
            return found
    return None


base.declare(globals())
