"""The interface every target answers, as arch.base.Arch is for architectures: what
differs between kinds of image.  This is the one file to read to learn what a target
is asked; each member has its default here.

A target is a package (linux_user/, linux_kernel/, linux_module/) whose __init__.py
defines the members it answers and ends with `base.declare(globals())`, which fills in
the defaults below and refuses a target that lacks a required member.  A new target is
a folder beside them with these members, and one line in targets.for_image().

Members without a default (REQUIRED) are what every image is asked: its name, its
symbols, its rules.

The back half (pipeline.build()) is the same steps for every target, each asked of the
target: lay_out -> tables -> the runtime (link/runtime.py's builder and cache, from the
target's recipe.py, as runtime_variant() says; False: none) -> link -> unlinked, emit ->
write.  Their defaults are the shared stages for an image laid out in place (new segments at addresses the rewriter chooses: emit/layout.py,
emit/tables.py, link/blob.py, emit/emission.py), which ask the in-place members
(plan_layout, reserve_stubs, tables_c, table_base, address_c, write); those default to a
refusal naming the target.  A target whose loader lays it out (a kernel module: `ld -r`,
its own relocations, ORC entries and the loader's order) answers the steps themselves, as
does the arm64 kernel (its new code and data placed by the link itself in the Image's own
room: targets/linux_kernel/aarch64/build.py).
"""
from __future__ import annotations

from typing import Any

from ..errors import KprewriteError

REQUIRED = ("name", "load_symbols", "rules")


class Target:
    """The members, their defaults and what each answers (`self` is the target module)."""

    name: str                          # also the runtime's folder: runtime/platform/<name>
    RUNTIME_HANDLERS: frozenset = frozenset()   # handler names the runtime defines (boot hooks...)
    TABLES_AT_BOOT: bool = False       # emit/tables.py writes compact records the runtime builds from
    RUNTIME_KALLSYMS: bool = False     # trace events name addresses from the running image's own
                                       # symbols (a kernel's kallsyms), not a table compiled in
    PROBES_BY_NAME: Any = False        # perf-probe definitions: True (DWARF), "btf" (DWARF if the
                                       # debug file is found, else the image's BTF), False (refused)
    DIFF_REFUSAL: str | None = None    # why `kprewrite diff` cannot compare this target's outputs

    # --- recognising and reading the image ---
    def detect(self, image) -> bool:
        """Whether a loaded image is this target's (targets.for_image())."""
        return False

    def unwrap(self, data: bytes, path: str):
        """(ELF bytes, container) when data is a container this target opens, else None."""
        return None

    def load_symbols(self, image, system_map: str | None = None) -> None:
        """Function symbols and bounds beyond the ELF's own (a kernel's kallsyms)."""

    def rules(self, image, arch) -> Any:
        """analysis.rules.Rules: the blacklist, reserved ranges, ftrace sites, refusals."""

    def runtime_probes(self, spec) -> None:
        """Add the probes the runtime needs (a kernel's boot and shutdown hooks)."""

    def debug_file_names(self, image) -> list[str]:
        """Where the image's separate debug file may be (PROBES_BY_NAME = "btf")."""
        return []

    def probe_btf(self, image):
        """The image's BTF for perf-probe definitions (PROBES_BY_NAME = "btf"), or None."""
        return None

    def refusals(self, image, plan, traces, spec_name: str) -> list[str]:
        """One line per probe the target cannot write beyond the rules' refusals (asked after
        planning, by `check` and `instrument` alike, so they agree)."""
        return []

    def notes(self, image, traces) -> list[str]:
        """Lines `instrument` prints about the output beside the plan's."""
        return []

    # --- where new code and data go ---
    def thread_key(self, image) -> Any:
        """arch.base.ThreadKey: how detours find the running thread (or CPU); None: none."""
        return None

    def plan_layout(self, image) -> Any:
        """Where the new code starts (rx_vaddr, after_phdrs) and the data (data_vaddr, None: after the code)."""
        _own_build(self, "plan_layout")

    def reserve_stubs(self, image, pos: int) -> tuple[dict[str, int], int]:
        """Start-up stubs' addresses from pos, and the position after them."""
        _own_build(self, "reserve_stubs")

    # --- the runtime, handlers and tables ---
    def handler_headers(self, image) -> dict[str, str]:
        """Headers made from the image for the handlers (path -> text): a kernel's types."""
        return {}

    def link_symbols(self, image) -> dict[str, int | None] | None:
        """The image's symbols the runtime and handlers may use (None: self-contained)."""
        return None

    def tables_c(self, image, arch, any_breakpoint: bool) -> str:
        """The target's part of the generated C tables."""
        _own_build(self, "tables_c")

    def table_base(self, image) -> int:
        """With TABLES_AT_BOOT: the link address the records' 32-bit offsets count from."""
        _own_build(self, "table_base")

    def derived_symbol(self, image, addr: int) -> str | None:
        """With TABLES_AT_BOOT: the symbol name the running image gives addr itself, so the
        records leave it out (None: always written)."""
        return None

    def code_room(self, image, lay) -> int | None:
        """With TABLES_AT_BOOT: bytes left for the runtime's code and rodata after the
        detours (lay: the layout), so that records too large for it go with the data
        (None: no bound)."""
        return None

    def address_c(self, image, addr: int) -> str:
        """An address of the image as a C constant in the generated tables: a number, or an
        expression the linker relocates (a kernel moved by KASLR)."""
        _own_build(self, "address_c")

    # --- the back half: pipeline.build() asks these in this order ---
    def lay_out(self, s, code) -> Any:
        """Where the new code and data go, for session s (code: emission.Code): an object the
        later steps get as `lay`, with detour(site) (the address `list` shows; 0: none known
        before a loader's).  Default: emit/layout.py's in place (plan_layout, reserve_stubs)."""
        from ..emit import layout
        return layout.place(code, s.target)

    def tables(self, s, code, lay) -> Any:
        """The generated sources compiled with the runtime (what differs per rewrite: the
        probes' facts).  Default: emit/tables.py's probe table (tables_c, table_base, address_c)."""
        from ..emit import tables
        return tables.generate(code, lay, s.target, s.traces)

    def runtime_variant(self, s, lay) -> str | None | bool:
        """Which of its recipe's VARIANTS the runtime is built as (link/runtime.py: built and
        cached per variant), None: the recipe's flags alone; False: no runtime of
        link/runtime.py's, link() gets none (the arm64 kernel's link() compiles and links the
        part of the runtime its Image has per rewrite: targets/linux_kernel/aarch64/runtime.py)."""
        return None

    def link(self, s, lay, table, runtime: list, objs: list, workdir, cc: str) -> Any:
        """The link, started: an object whose join() waits for it and result() is the linked
        output emit() and write() get as `blob` (link/blob.py's Linked, Linking).  runtime:
        link/runtime.py's objects of runtime/ for this target (its recipe.py), objs: the
        handlers'.  Default: the table, runtime and handlers linked at the layout's addresses
        (link/blob.py: in a thread, cached)."""
        from ..link import blob
        return blob.start(s, lay, table, runtime, objs, workdir, cc)

    def unlinked(self, s, code, lay) -> Any:
        """What emit() needs that the link does not change, made while the link runs (default:
        emission.unlinked(): the code and patches that do not reach the runtime)."""
        from ..emit import emission
        return emission.unlinked(code, lay)

    def emit(self, s, code, lay, blob, unlinked) -> tuple[Any, list]:
        """(rx, patches) for write(): the new code at its addresses and the image's bytes to
        change (default: emission.emit() with the linked symbols)."""
        from ..emit import emission
        return emission.emit(code, lay, blob.symbols, unlinked)

    def before_link(self, image, arch, layout, plan) -> Any:
        """What write() needs that the linked runtime does not change, started before the
        compiler and linker run (pipeline.build): an object whose result() is read while
        they do (write() gets it as `early`) and whose close() ends what it started (a
        user image's detour unwind programs, in worker processes); None when there is
        nothing."""
        return None

    def write(self, image, arch, layout, rx: bytearray, patches, blob, metadata: bytes, plan,
              early=None) -> bytes:
        """The output image's bytes (early: before_link()'s)."""
        _own_build(self, "write")

    def diff_expected(self, image, meta: dict) -> list[tuple[int, int, str]]:
        """Changes `kprewrite diff` may find besides the probe sites: (start, end, why)."""
        _own_build(self, "diff_expected")


def _own_build(target, member: str):
    raise KprewriteError(f"{target['name'] if isinstance(target, dict) else target.name}: not laid out in "
                         f"place ({member}): its back half's steps are its own")


def members() -> dict[str, Any]:
    """Every declared member and its default (functions take the target module's
    arguments, without `self`)."""
    out = {n: None for n in Target.__annotations__}
    out.update({n: v for n, v in vars(Target).items() if not n.startswith("_")})
    return out


def declare(namespace: dict) -> None:
    """Complete a target package's namespace (its __init__.py's globals()) with the
    declared defaults; a missing REQUIRED member is a programming error."""
    missing = [n for n in REQUIRED if n not in namespace]
    if missing:
        raise TypeError(f"target {namespace.get('__name__')} lacks {', '.join(missing)}")
    for n, default in members().items():
        if n in namespace:
            continue
        if callable(default):
            def bound(*a, _f=default, **k):
                return _f(namespace, *a, **k)
            bound.__name__, bound.__doc__ = n, default.__doc__
            bound.__signature__ = _without_self(default)
            namespace[n] = bound
        else:
            namespace[n] = default


def _without_self(f):
    import inspect
    sig = inspect.signature(f)
    return sig.replace(parameters=list(sig.parameters.values())[1:])
