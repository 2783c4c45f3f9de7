"""Linux user processes: executables (static or dynamic, PIE or not) and shared
objects.  New code and data go in two PT_LOAD segments appended to the file
(writer.py), unwind tables in a third (unwind.py); the runtime starts from a new entry point or the init arrays
(startup.py); breakpoint probes keep their SIGTRAP handler through the GOT
(sighook.py); the runtime's platform layer is runtime/platform/linux_user."""
from __future__ import annotations

from .. import base
from ...analysis import blacklist as bl
from ...arch import get_arch
from ...arch.base import ThreadKey
from ...emit.meta import META_SECTION
from ...errors import KprewriteError
from ...analysis.rules import NEVER_RETURNS, RETURNS_TWICE, SWITCHES, Rules
from . import ftrace, sighook, unwind, writer
from .startup import check_supported, diff_expected, emit_stubs, reserve_stubs  # noqa: F401
from .writer import plan_layout  # noqa: F401

name = "linux_user"
# The spec's `probes` (rewriter/probes/perfprobe): names resolved from the image's own DWARF.
PROBES_BY_NAME = True


def thread_key(image) -> ThreadKey:
    """The thread's identity, as the arch's psABI defines the thread pointer (x86-64:
    the TCB's self pointer, at 0 from it)."""
    return get_arch(image.machine).USER_THREAD_KEY


def load_symbols(image, system_map: str | None = None) -> None:
    """A user ELF's symbols are its own (.symtab, .dynsym, .eh_frame): nothing to add."""
    if system_map is not None:
        raise KprewriteError(f"--system-map: {image.path} is not a kernel image")


def rules(image, arch) -> Rules:
    """check_kprobe_address_safe()'s blacklist for a user image (blacklist.compute),
    and the image's ftrace sites (ftrace.py: function entries a -mnop-mcount or
    -fpatchable-function-entry build left as the arch's ftrace nop), which a probe takes
    as KPROBE_FLAG_FTRACE does, the bytes after a site's first refused as in a
    kernel.  The output keeps the sites' tables unchanged (write() does not touch
    them): nothing patches them at run time in a user process."""
    check_supported(image)          # the dynamic loader: refused by check as by instrument
    sites = ftrace.sites(image, arch)
    return Rules(bl.Index(bl.compute(image) + ftrace.inside_sites(image, arch, sites)), ftrace=sites, shared_regions=True,
                 short_jumps=True, evict_neighbours=True, light_hits=True, red_zone=True, retarget_branches=True,
                 kretprobe_blacklist=KRETPROBE_BLACKLIST, signal_syscalls=True,
                 kretprobe_clean_entry=arch.retprobe.CLEAN_ENTRY_IN_USER, kretprobe_pointer_tails=True,
                 kretprobe_branch_exits=True)


# kretprobe_blacklist for a process: the C library's (glibc's, and the names other C
# libraries share) functions whose return does not match their call.
KRETPROBE_BLACKLIST = {
    "_start": "the program's entry point has no caller to return to",
    "__libc_start_main": NEVER_RETURNS, "__libc_start_call_main": NEVER_RETURNS,
    "exit": NEVER_RETURNS, "_exit": NEVER_RETURNS, "_Exit": NEVER_RETURNS, "abort": NEVER_RETURNS,
    "pthread_exit": NEVER_RETURNS, "__stack_chk_fail": NEVER_RETURNS, "__assert_fail": NEVER_RETURNS,
    "__cxa_throw": NEVER_RETURNS, "_Unwind_Resume": NEVER_RETURNS,
    "setjmp": RETURNS_TWICE, "_setjmp": RETURNS_TWICE, "__sigsetjmp": RETURNS_TWICE, "sigsetjmp": RETURNS_TWICE,
    "vfork": RETURNS_TWICE, "fork": RETURNS_TWICE, "getcontext": RETURNS_TWICE,
    "longjmp": SWITCHES, "_longjmp": SWITCHES, "siglongjmp": SWITCHES, "__longjmp_chk": SWITCHES,
    "setcontext": SWITCHES, "swapcontext": SWITCHES,
}


def link_symbols(image):
    """Symbols of the image the runtime and handlers may call: none (they are self-contained)."""
    return None


def handler_headers(image) -> dict[str, str]:
    """Headers generated for the handlers from the image: none (runtime/include has them all)."""
    return {}


# The probe tables are whole C structures in the output's data (emit/tables.py).
TABLES_AT_BOOT = False
RUNTIME_KALLSYMS = False        # trace lines name addresses from a table compiled in


def table_base(image) -> int:
    """Unused: a process's tables are not built at start-up (TABLES_AT_BOOT)."""
    return 0


def derived_symbol(image, addr: int) -> str | None:
    """Unused (TABLES_AT_BOOT): no symbol name is left out of a process's tables."""
    return None


def address_c(image, addr: int) -> str:
    """An address in the generated tables: a number (the runtime adds a PIE's load bias)."""
    return f"{addr:#x}UL"


def tables_c(image, arch, any_breakpoint: bool) -> str:
    """The target's part of the generated C: the GOT slots sighook takes over."""
    return sighook.table_c(image, arch, any_breakpoint)


RUNTIME_HANDLERS = frozenset()


def runtime_probes(spec) -> None:
    """Probes the runtime itself needs: none in a user process."""


def before_link(image, arch, layout, plan):
    """What write() needs that the linked runtime does not change, started before
    the compiler and linker run (pipeline.build) and read while they do: the
    detours' unwind programs (unwind.Programs: in worker processes)."""
    return unwind.Programs(plan, layout, arch, path=image.path) if layout.target.unwind else None


def write(image, arch, layout, rx: bytearray, patches, blob, metadata: bytes, plan, early=None) -> bytes:
    """The output file: rx (stubs and detours) and the linked runtime in a new
    RX segment, the runtime's data in a new RW one, the probes' patches, the
    metadata section.  early: before_link()'s."""
    def put(addr, code, room):
        if len(code) > room:
            raise KprewriteError(f"internal error: stub at {addr:#x} is {len(code)} bytes")
        rx[addr - layout.rx_vaddr:addr - layout.rx_vaddr + len(code)] = code

    entry, file_patches = emit_stubs(image, arch, layout.stubs, blob.symbols, put, plan)
    rx = bytes(rx + blob.text)
    sections = [
        writer.NewSection(".kprewrite.text", 1, 6, layout.rx_vaddr, rx),
        writer.NewSection(".kprewrite.data", 1, 3, blob.data_addr, blob.data),
    ]
    if blob.data_memsz > len(blob.data):
        sections.append(writer.NewSection(".kprewrite.bss", 8, 3, blob.data_addr + len(blob.data), b"",
                                          blob.data_memsz - len(blob.data)))
    tables = None
    if layout.target.unwind:      # unwind.py: FDEs for the new code, PT_GNU_EH_FRAME repointed
        u_vaddr = writer.page_up(blob.data_addr + blob.data_memsz)
        u_bytes, hdr, hdr_size = unwind.build(image, arch, layout, rx, blob, plan, u_vaddr, early)
        tables = (u_vaddr, u_bytes, hdr, hdr_size)
        sections.append(writer.NewSection(".kprewrite.eh_frame", 1, 2, u_vaddr, u_bytes[:hdr - u_vaddr], align=8))
        sections.append(writer.NewSection(".kprewrite.eh_frame_hdr", 1, 2, hdr, u_bytes[hdr - u_vaddr:], align=4))
    sections.append(writer.NewSection(META_SECTION, 1, 0, 0, metadata, align=1))
    return writer.write_image(image, layout.target, patches, rx, blob.data_addr, blob.data, blob.data_memsz,
                              sections, entry, file_patches, tables)


base.declare(globals())
