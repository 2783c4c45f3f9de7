"""The interface every target answers, as arch.base.Arch is for architectures: what
differs between kinds of image.  This is the one file to read to learn what a target
is asked; each member has its default here.

A target is a package (linux_user/, linux_kernel/, linux_module/) whose __init__.py
defines the members it answers and ends with `base.declare(globals())`, which fills in
the defaults below and refuses a target that lacks a required member.  A new target is
a folder beside them with these members, and one line in targets.for_image().

Members without a default (REQUIRED) are what every image is asked: its name, its
symbols, its rules.  The back half's members (plan_layout ... diff_expected) default to a
refusal naming the target, for a target that writes its output by its own `build`.
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

    def address_c(self, image, addr: int) -> str:
        """An address of the image as a C constant in the generated tables: a number, or an
        expression the linker relocates (a kernel moved by KASLR)."""
        _own_build(self, "address_c")

    # --- the output ---
    # A target that writes its output by a linker of its own (a kernel module: `ld -r`)
    # answers build(session, objs, workdir, progress) -> bytes; the pipeline's layout,
    # tables, link and write are then not asked.  None: the pipeline's back half.
    build = None

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
    raise KprewriteError(f"{target['name'] if isinstance(target, dict) else target.name}: written by its own "
                         f"build(), not laid out in place ({member})")


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
